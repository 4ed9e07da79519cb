"""scripts/bench_flag_wait.py's command line: bad counts refused with argparse's line, one line without a GPU
(it runs on the GPU machine: DEVICE-NOTES session 57)."""

import pytest
import torch

from tests.scripts.script_run import last_line, run_script


@pytest.mark.parametrize("flag", ["--layers", "--rows", "--reps", "--rounds"])
def test_bad_counts_are_refused(flag):
    out = run_script("bench_flag_wait.py", flag, "0")
    assert out.returncode == 2 and "--layers, --rows, --reps and --rounds must be at least 1" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_without_a_gpu_one_line():
    out = run_script("bench_flag_wait.py")
    assert out.returncode == 1
    assert last_line(out) == "bench_flag_wait: needs a CUDA GPU (the flag is read over PCIe)"
