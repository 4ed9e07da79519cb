"""scripts/bench_cpu_kernels.py: its flags' one-line errors, and --paired's line (pairs of a host memcpy and a
kernel pass, the median of their ratios) on a tiny pool."""

import re

import pytest

from tests.scripts.script_run import last_line, run_script


def _run(*args: str):
    return run_script("bench_cpu_kernels.py", *args, timeout=600)


@pytest.mark.parametrize("args,message", [
    (["--paired", "1"], "--paired must be 0 (off) or at least 2, not 1"),
    (["--paired", "-3"], "--paired must be 0 (off) or at least 2, not -3"),
    (["--reps", "0"], "--reps must be at least 1, not 0"),
    (["--experts", "5"], "--experts 5 is fewer than --top-k 10"),
])
def test_bad_flags_are_one_line(args, message):
    out = _run(*args)
    assert out.returncode == 2 and message in last_line(out)


def test_paired_passes_give_a_median_ratio():
    out = _run("--threads", "1", "--types", "Q8_0", "--tokens", "1", "--top-k", "2", "--experts", "4",
               "--paired", "3")
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if "1 tok x top-2" in ln)
    m = re.search(r"paired: (\d+)% of memcpy \(median of 3; (\d+)-(\d+)%\), kernel ([\d.]+) GB/s, "
                  r"memcpy ([\d.]+) GB/s", line)
    assert m, line
    median, lo, hi = (int(m.group(i)) for i in (1, 2, 3))
    assert lo <= median <= hi and float(m.group(4)) > 0 and float(m.group(5)) > 0
