"""scripts/bench_token_rows.py: with one thread no team forms, so the team forms are said not run (they were
printed as the two-region form again, with member 0's steps all zeros)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_thread_runs_no_team_and_says_so():
    r = subprocess.run([sys.executable, "scripts/bench_token_rows.py", "--threads", "1", "--layers", "1",
                        "--experts", "11", "--tokens", "2", "--misses", "1", "--mixer-us", "5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[1] == "1 threads, 1 CPU entries a layer (1.8 MB of experts):"
    assert lines[2].startswith("  expert_ffn_cpu call per layer: ")
    assert lines[3].startswith("  token worker, two regions a layer: ") and " ms flag to flag, " in lines[3]
    assert lines[4:] == ["  one team a token: not run (1 thread: a team needs 2 or more)"]
