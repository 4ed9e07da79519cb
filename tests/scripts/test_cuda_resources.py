"""scripts/cuda_resources.py: its flags, the line it ends with where NVRTC or ptxas is missing, and where they
are installed (pip's nvidia-cuda-nvrtc-cu12 / nvidia-cuda-nvcc-cu12), each kernel form's resources."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).resolve().parents[2] / "scripts" / "cuda_resources.py")


def _run(*flags, env=None):
    return subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_bad_flags_are_refused_with_one_line():
    for flags, message in ((["--types", "Q5_0"], "--types: unknown 'Q5_0' (allowed: a comma-separated list"),
                           (["--kernels", "attention"], "--kernels: unknown 'attention'"),
                           (["--arch", "hopper"], "--arch: invalid value 'hopper'"),
                           (["--kquant-ctas", "5"], "--kquant-ctas: invalid choice: 5")):
        r = _run(*flags)
        assert r.returncode == 2 and message in r.stderr.splitlines()[-1], (flags, r.stderr)


def test_missing_tools_end_with_what_to_install(tmp_path):
    r = _run(env={"STRATA_NVRTC_LIB": str(tmp_path / "libnvrtc.so.12"), "STRATA_PTXAS": str(tmp_path / "no")})
    assert r.returncode == 1
    assert r.stderr.strip() == ("error: needs NVRTC and ptxas: pip install nvidia-cuda-nvrtc-cu12 "
                                "nvidia-cuda-nvcc-cu12 (or set STRATA_NVRTC_LIB and STRATA_PTXAS)")


def test_the_kquant_cap_moves_the_prompt_rows_to_three_ctas_an_sm():
    pytest.importorskip("nvidia.cuda_nvrtc")
    pytest.importorskip("nvidia.cuda_nvcc")
    rows = {}
    for n in ("1", "3"):
        r = _run("--kernels", "mma", "--types", "Q4_0,Q6_K", "--kquant-ctas", n, "--mma-warp-entries", "32")
        assert r.returncode == 0, r.stderr
        rows[n] = {" ".join(line.split()[1:4]): line.split() for line in r.stdout.splitlines()[1:]}
    # the warp tile of 32 entries, where the cap matters: the compiler takes more than 168 registers for Q6_K
    # (2 CTAs an SM; Q4_K took 244-255 before session 54's copies, 168 since; the 64-entry tile, the default
    # since, takes 128-140 either way)
    q6k, q40 = "Q6_K gate+up k=2048", "Q4_0 gate+up k=2048"
    assert int(rows["1"][q6k][4]) > 168 and rows["1"][q6k][8] == "2"  # registers, CTAs an SM
    assert int(rows["3"][q6k][4]) <= 168 and rows["3"][q6k][8] == "3"
    assert rows["1"][q40] == rows["3"][q40]  # Q4_0 untouched
