"""scripts/bench_pdl.py's command line: bad counts refused with argparse's line, one line without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/bench_pdl.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_bad_counts_are_refused():
    out = _run("--chain", "0")
    assert out.returncode == 2 and "--chain and --reps must be at least 1" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_without_a_gpu_one_line():
    out = _run()
    assert out.returncode == 1
    want = "bench_pdl: needs a CUDA GPU (programmatic dependent launch is Hopper's)"
    assert out.stderr.strip().splitlines()[-1] == want
