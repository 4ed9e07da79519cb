"""scripts/bench_flag_wait.py's command line: bad counts refused with argparse's line, one line without a GPU
(it runs on the GPU machine: DEVICE-NOTES session 57)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/bench_flag_wait.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flag", ["--layers", "--rows", "--reps", "--rounds"])
def test_bad_counts_are_refused(flag):
    out = _run(flag, "0")
    assert out.returncode == 2 and "--layers, --rows, --reps and --rounds must be at least 1" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_without_a_gpu_one_line():
    out = _run()
    assert out.returncode == 1
    want = "bench_flag_wait: needs a CUDA GPU (the flag is read over PCIe)"
    assert out.stderr.strip().splitlines()[-1] == want
