"""scripts/bench_pdl.py's command line: bad counts refused with argparse's line, one line without a GPU."""

import pytest
import torch

from tests.scripts.script_run import last_line, run_script


def test_bad_counts_are_refused():
    out = run_script("bench_pdl.py", "--chain", "0")
    assert out.returncode == 2 and "--chain and --reps must be at least 1" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_without_a_gpu_one_line():
    out = run_script("bench_pdl.py")
    assert out.returncode == 1
    assert last_line(out) == "bench_pdl: needs a CUDA GPU (programmatic dependent launch is Hopper's)"
