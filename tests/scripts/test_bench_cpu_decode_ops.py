"""scripts/bench_cpu_decode_ops.py: a line a call at tiny sizes, and its flags' one-line errors."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/bench_cpu_decode_ops.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_a_line_a_call_with_its_ratio():
    r = _run("--embd", 32, "--heads", "2,1,8", "--n-rot", 4, "--ff", 8, "--keys", "1,5", "--experts", 5,
             "--top-k", 3, "--expert-ff", 64, "--reps", 2)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    names = [line[:24].strip() for line in lines[1:]]
    assert names == ["rms_norm", "add + rms_norm", "shared activation", "q / k norm + rope",
                     "attention, 1 keys", "attention, 5 keys", "router 5 x 32, top-3", "combine of 3 rows",
                     "3 experts + combine"]
    for line in lines[1:]:
        torch_us, numba_us, ratio, taken = line[24:].split()
        assert float(torch_us) > 0 and float(numba_us) > 0 and taken == "yes"
        # the ratio is of the unrounded times, which the line prints to 0.1 us: it lies within the ratios
        # their rounding allows (a 3.3 us numba call was 3.25-3.35 us), to the ratio's own 0.01
        t, n = float(torch_us), float(numba_us)
        assert (t - 0.05) / (n + 0.05) - 0.005 <= float(ratio) <= (t + 0.05) / max(n - 0.05, 1e-9) + 0.005


def test_a_width_the_experts_cannot_take_leaves_their_line_out():
    r = _run("--embd", 16, "--heads", "2,1,8", "--n-rot", 4, "--ff", 8, "--keys", "1", "--reps", 2)
    assert r.returncode == 0, r.stderr
    names = [line[:24].strip() for line in r.stdout.splitlines()[1:]]
    assert names[-2:] == ["router 16 x 16, top-2", "combine of 2 rows"]


def test_bad_flags_are_refused_with_one_line():
    bad = ((("--heads", "3,2,8"), "--heads"), (("--n-rot", 5), "--n-rot"), (("--reps", 0), "--reps"),
           (("--keys", "0"), "--keys"), (("--experts", 4, "--top-k", 5), "--top-k"),
           (("--top-k", 0), "--top-k"), (("--expert-ff", 48), "--expert-ff"))
    for args, word in bad:
        r = _run(*args)
        assert r.returncode == 2 and word in r.stderr.splitlines()[-1], r.stderr
