"""kernels/precompile: every CPU kernel form compiles through the engine's own wrappers, once."""

import os
import subprocess
import sys
import time

import pytest

from strata_ray.kernels import expert_cpu_kernels, expert_cpu_token
from strata_ray.kernels.cpu_token_rows import team_layer_ok
from strata_ray.kernels.precompile import FORMS, cold_forms, forms_for, precompile, run_parallel, start


def test_precompile_runs_every_form_and_each_kernel_has_one_signature():
    forms = [name for name, seconds in precompile(2)]
    assert forms[:4] == ["expert rows, one thread, quantized", "expert rows, one thread, float",
                         "expert rows, the pool, quantized", "expert rows, the pool, float"]
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


def _cold_in(cache_dir) -> str:
    """cold_forms of every form, in a fresh process whose numba cache is the given (empty) folder."""
    code = ("from strata_ray.kernels.precompile import FORMS, cold_forms; "
            "print(','.join(cold_forms(FORMS)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_cold_forms_reads_numbas_cache(tmp_path):
    precompile(2)  # this session's cache now holds every form this host runs
    assert cold_forms(forms_for(2)) == ()
    assert _cold_in(tmp_path) == ",".join(FORMS)  # an empty cache: every form is cold, nothing compiled
    assert not any(tmp_path.rglob("*.nbc"))


def test_forms_compile_in_processes_of_their_own():
    precompile(2)  # warm: each process loads its form from the cache (seconds), the same machinery
    steps, failed = run_parallel(("worker", "rows-one"), 2, 2)
    assert failed == {}
    assert [s.label for s in steps] == [  # FORMS order, whichever process ended first
        "expert rows, one thread, quantized", "expert rows, one thread, float",
        "decode worker, one thread a layer", "decode worker, a parallel region a layer"]
    assert all(s.seconds >= 0 for s in steps)
    # a process that fails is reported with its last line, and the others' steps are kept
    steps, failed = run_parallel(("rows-one", "team"), 1, 2)  # team with one thread: refused by its process
    assert list(failed) == ["team"] and "needs --threads >= 2" in failed["team"]
    assert [s.label for s in steps] == ["expert rows, one thread, quantized",
                                        "expert rows, one thread, float"]


def test_the_command_refuses_a_bad_form_or_job_count():
    run = [sys.executable, "-m", "strata_ray.kernels.precompile"]
    for flags, message in ((["--forms", "rows-one,bogus"], "--forms: unknown form 'bogus'"),
                           (["--jobs", "0"], "--jobs must be at least 1"),
                           (["--threads", "1", "--forms", "team"], "--forms team needs --threads >= 2")):
        r = subprocess.run([*run, *flags], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr.splitlines()[-1], (flags, r.stderr)


def test_the_engine_precompiles_in_the_background_only_where_it_gains(monkeypatch):
    from strata_ray.experts import build

    assert build.precompile_in_background("cpu") is None  # the CPU engine compiles its one or two forms
    precompile(2)
    monkeypatch.setattr("strata_ray.kernels.cpu_pool.cpu_count", lambda: 16)
    assert build.precompile_in_background("cuda") is None  # every form cached: nothing to start
    # two forms the cache lacks (as numba would say on a fresh install): a process each, joined by the load
    monkeypatch.setattr("strata_ray.kernels.precompile.cold_forms", lambda forms: ("rows-one", "worker"))
    background = build.precompile_in_background("cuda")
    assert sorted(background.procs) == ["rows-one", "worker"]
    stages = []
    build._join_precompile(background, stages.append, poll_s=0.01)
    assert stages[0] == "compiling kernels (0 of 2 forms)" and set(stages) <= {
        f"compiling kernels ({i} of 2 forms)" for i in range(2)}  # the load's bar counts the forms done
    assert background.failed == {} and all(p.returncode == 0 for p in background.procs.values())
    monkeypatch.setenv("STRATA_PRECOMPILE", "0")
    assert build.precompile_in_background("cuda") is None


def test_precompiling_joins_at_the_blocks_end_and_kills_where_it_raises(monkeypatch):
    """build.precompiling, the load's and bench_tiers' one way to run the forms beside their work: a block
    that ends joins the processes (each exited 0); one that raises (a bad flag, a refused profile) kills them
    and passes the exception on."""
    from strata_ray.experts import build

    precompile(2)
    monkeypatch.setattr("strata_ray.kernels.cpu_pool.cpu_count", lambda: 16)
    monkeypatch.setattr("strata_ray.kernels.precompile.cold_forms", lambda forms: ("rows-one", "worker"))
    with build.precompiling("cuda") as background:
        pass
    assert all(p.returncode == 0 for p in background.procs.values())
    with pytest.raises(SystemExit, match="a refused flag"), build.precompiling("cuda") as background:
        raise SystemExit("a refused flag")
    assert all(p.returncode is not None and p.returncode != 0 for p in background.procs.values())
    with build.precompiling("cpu") as background:  # nothing to start: None, and nothing to join
        assert background is None


def test_a_killed_background_leaves_no_process():
    background = start(("rows-one",), 1)
    background.kill()  # a load that failed: nothing left compiling behind it
    assert all(p.returncode is not None and p.returncode != 0 for p in background.procs.values())


def test_the_processes_end_with_their_parent(tmp_path):
    """A precompile process outliving its parent (a killed actor) ends too: SIGTERM on the parent's death.
    Its cache is empty, so its compile alone would take half a minute or more."""
    code = ("import sys, os; from strata_ray.kernels.precompile import start; "
            "bg = start(('rows-one',), 1); print(bg.procs['rows-one'].pid, flush=True); "
            "import time; time.sleep(float(sys.argv[1])); os._exit(0)")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    for delay in ("0", "4"):  # the parent gone before the child's guard, and after it
        r = subprocess.run([sys.executable, "-c", code, delay], capture_output=True, text=True, timeout=120,
                           env=env)
        child = int(r.stdout.split()[0])
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child), f"the precompile process {child} outlived its parent (delay {delay} s)"


def _alive(pid: int) -> bool:
    """A process that has not exited (a zombie has: its parent, reaped by init, is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_failed_load_kills_its_precompile(monkeypatch):
    """The CUDA load on a host without CUDA fails at its dense weights, after starting the precompile: no
    process is left compiling behind the error."""
    import pytest
    import torch

    from strata_ray.config import EngineConfig
    from strata_ray.experts import build
    from strata_ray.kernels import precompile as pc

    if torch.cuda.is_available():
        pytest.skip("needs a host where the CUDA load fails")
    started = []
    real_start = pc.start
    monkeypatch.setattr(pc, "start", lambda forms, n: started.append(real_start(forms, n)) or started[-1])
    monkeypatch.setattr("strata_ray.kernels.cpu_pool.cpu_count", lambda: 16)
    monkeypatch.setattr(pc, "cold_forms", lambda forms: ("rows-one", "worker"))
    with pytest.raises((RuntimeError, AssertionError)):
        build.load_tiered_model(EngineConfig(), "cuda")
    assert len(started) == 1 and all(p.returncode not in (None, 0) for p in started[0].procs.values())
