"""kernels/precompile: every CPU kernel form compiles through the engine's own wrappers, once."""

import subprocess
import sys

from strata_ray.kernels import expert_cpu_kernels, expert_cpu_token
from strata_ray.kernels.cpu_token_rows import team_layer_ok
from strata_ray.kernels.precompile import precompile


def test_precompile_runs_every_form_and_each_kernel_has_one_signature():
    forms = [name for name, seconds in precompile(2)]
    assert forms[:4] == ["expert rows, one thread, quantized", "expert rows, the pool, quantized",
                         "expert rows, one thread, float", "expert rows, the pool, float"]
    assert forms[4:6] == ["decode worker, one thread a layer", "decode worker, a parallel region a layer"]
    assert ("decode worker, one team a token" in forms) == team_layer_ok()
    # one compiled signature each, in this whole test session too: every caller passes the same types
    # (a second signature is minutes of compile on a small host, on first use and in CI). The kernels
    # Python calls: a callee loaded from the cache inside its caller's code lists no signature of its own.
    kernels = [expert_cpu_kernels.ffn_parallel, expert_cpu_kernels.gate_up_share,
               expert_cpu_kernels.down_share, expert_cpu_token.token_rows]
    if team_layer_ok():
        kernels.append(expert_cpu_token.token_rows_team)
    counts = {k.py_func.__name__: len(k.signatures) for k in kernels}
    assert counts == dict.fromkeys(counts, 1)


def test_the_command_prints_each_form_and_refuses_a_bad_flag():
    run = [sys.executable, "-m", "strata_ray.kernels.precompile"]
    r = subprocess.run([*run, "--threads", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines()[-1].endswith("--threads must be at least 1")
    r = subprocess.run([*run, "--threads", "1"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("expert rows, one thread, quantized: ") and lines[-1].startswith(
        "CPU kernels compiled (or loaded from the cache) in ")
    assert not any("team" in line for line in lines)  # one thread: no team form
