"""The scripts' list flags (--depths 1024,8192, --types Q4_0,Q8_0) are refused with argparse's one line,
before any model or kernel is loaded (they were parsed after the load, as a traceback)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.parametrize("script,flag,value,message", [
    ("bench_tiers.py", "--depths", "1024,abc", "invalid value '1024,abc' (allowed: comma-separated, each an "
                                               "integer >= 1)"),
    ("bench_cpu_kernels.py", "--threads", "0", "invalid value '0'"),
    ("bench_cpu_kernels.py", "--types", "Q4_0,Q5_0", "unknown 'Q5_0' (allowed: a comma-separated list of "),
    ("bench_cpu_kernels.py", "--drivers", "numba,omp", "unknown 'omp'"),
    ("bench_token_rows.py", "--misses", "11", "each an integer from 1 to 10"),
    ("compare_llamacpp_cpu.py", "--contexts", "1k", "invalid value '1k'"),
    ("bench_graph_launch.py", "--nodes", "", "invalid value ''"),
    ("bench_graph_launch.py", "--kinds", "kernal", "unknown 'kernal'"),
    ("bench_team_units.py", "--entries", "1,,2", "invalid value '1,,2'"),
    ("bench_attention.py", "--keys", "1", "each an integer >= 2"),
    ("bench_tiers.py", "--hbm-gbs", "0", "invalid value '0' (allowed: a number > 0 and <= 1e+06)"),
    ("bench_tiers.py", "--temperature", "-1", "invalid value '-1' (allowed: a number >= 0 and <= 100)"),
    ("bench_tiers.py", "--card-gib", "nan", "invalid value 'nan'"),
    ("bench_attention.py", "--heads", "16,2", "--heads: three integers"),
    ("bench_attention.py", "--tiles", "64x32x8x1x64,32x64x4x1x64", "'32x64x4x1x64': each tiling SPLITx"),
    ("bench_attention.py", "--tiles", "swept", "each tiling SPLITxBKxWARPSxSTAGESxDC"),
    ("bench_cpu_kernels.py", "--experts", "8", "--experts 8 is fewer than --top-k 10"),
    ("bench_cpu_kernels.py", "--reps", "0", "--reps must be at least 1, not 0"),
])
def test_a_bad_list_is_one_line(script, flag, value, message):
    r = subprocess.run([sys.executable, str(SCRIPTS / script), flag, value], capture_output=True, text=True,
                       timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and message in last and "Traceback" not in r.stderr, r.stderr
