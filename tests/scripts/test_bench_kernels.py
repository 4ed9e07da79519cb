"""scripts/bench_kernels.py: its flags are refused with one line before any timing (the timing itself is a
benchmark, run on the GPU machine, not a test)."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py")


def test_bad_flags_are_refused_with_one_line():
    for flags, message in ((["--sweep-with", "cuda_itres"], "--sweep-with: unknown knob(s) cuda_itres (of "),
                           (["--tokens", "9"], "--tokens: invalid value '9' (allowed: comma-separated, "
                                                "each an integer from 1 to 8)"),
                           (["--tokens", "one"], "--tokens: invalid value 'one'"),
                           (["--types", "Q5_0"], "--types: unknown 'Q5_0' (allowed: a comma-separated"),
                           (["--variants", "words,fast"], "--variants: unknown 'fast'"),
                           (["--mma-stages", "8,9"], "--mma-stages: invalid value '8,9'"),
                           (["--mma-stages", "8,6"], "--mma-stages: 4 or 8 blocks a stage, got 8,6"),
                           (["--mma-warp-entries", "32,48"], "--mma-warp-entries: 32 or 64, got 32,48")):
        r = subprocess.run([sys.executable, SCRIPT, *flags, "--no-gpu"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2 and message in r.stderr.splitlines()[-1], (flags, r.stderr)
    r = subprocess.run([sys.executable, SCRIPT, "--no-gpu"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "STRATA_ROWS_EARLY": "1"})
    assert r.returncode == 2 and "unset STRATA_ROWS_EARLY" in r.stderr.splitlines()[-1], r.stderr


def test_every_sweep_knob_names_a_setting_the_kernels_read(monkeypatch):
    """--sweep-with takes the knob names of the sweeps; each must be a key of the dict it tunes (a renamed
    setting would leave a sweep that changes nothing)."""
    import importlib.util

    import strata_ray.kernels.expert_gpu as eg
    import strata_ray.kernels.expert_words as ew

    monkeypatch.syspath_prepend(str(Path(SCRIPT).parent))  # its sibling modules, as when run as a script
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for sweep, knobs in ((bench.WIDE_DECODE_SWEEP, eg.WIDE), (bench.SPLIT_SWEEP, eg.SPLIT),
                         (bench.WORDS_SWEEP, ew.WORDS)):
        assert {name for k in sweep for name in k} <= set(knobs)
