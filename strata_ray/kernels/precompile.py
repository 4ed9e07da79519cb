"""Compile the CPU expert kernels into numba's on-disk cache ahead of their first use.

The kernels are `cache=True` numba functions: a fresh install compiles them on first use, minutes on a small
host (the decode token worker's two forms and the pool's parallel kernel are most of it), then loads them in
about a second. `python -m strata_ray.kernels.precompile` does that work ahead, for an image build or for CI
while it builds something else, through the same wrappers the engine calls, so the cached signatures are the
ones a run looks up (the wrappers give every caller one set of argument types: read-only weights, plain-int
quant types, int64 shares, uint32 flag values).

numba compiles on one core, and a caller re-optimizes the code of every function it calls (it links their
LLVM modules), so the forms are independent minutes of work: on a fresh cache each runs in a process of its
own (`--jobs`), and the wall time is the slowest form's (the decode team: ~3 of the ~4.5 minutes on one
core of the 2-core VM) instead of their sum. The engine's load does the same on CUDA (`start`), where the
decode worker's forms would otherwise compile one after another inside its "decode graphs" stage.

    python -m strata_ray.kernels.precompile [--threads N] [--jobs J] [--forms a,b]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np

from .contract import F16, Q4_0
from .cpu_pool import CpuPool, cpu_count
from .cpu_token_rows import CpuTokenRows, team_layer_ok
from .expert_cpu import expert_ffn_cpu
from .random_weights import random_layer

N_EXPERT, N_EMBD, N_FF, K = 4, 256, 256, 2  # the smallest layer every path accepts (K-quant rows are 256)

# the forms in the order a sequential precompile runs them; "team" only where a team can run (>= 2 threads
# and a threading layer that starts a prange's iterations at once)
FORMS = ("rows-one", "rows-pool", "worker", "team")
# their cold compile on one core of the 2-core VM: team ~175 s, rows-pool ~60, rows-one ~33, worker ~21; a
# parallel precompile starts the slowest first
SLOWEST_FIRST = ("team", "rows-pool", "rows-one", "worker")

# the dispatchers whose cache says whether a form was compiled: (module, function) each
_FORM_KERNELS = {
    "rows-one": (("expert_cpu_kernels", "gate_up_share"), ("expert_cpu_kernels", "down_share")),
    "rows-pool": (("expert_cpu_kernels", "ffn_parallel"),),
    "worker": (("expert_cpu_token", "token_rows"),),
    "team": (("expert_cpu_token", "token_rows_team"),),
}


PARENT_ENV = "STRATA_PRECOMPILE_PARENT"  # set by `start`: the pid its processes end with


class Form(NamedTuple):
    label: str  # what the command prints
    seconds: float


def _token(layers, n_threads: int, single_thread_bytes: int, team: bool, warm: bool) -> None:
    """One token of the decode worker whose flags are already raised, so no layer waits."""
    res = np.full(len(layers) * N_EXPERT, -1, np.int32)  # nothing resident: every entry is the CPU's
    worker = CpuTokenRows(layers, res, K, n_threads, single_thread_bytes=single_thread_bytes, team=team,
                          warm=warm)
    worker.buf["ids"][:] = np.arange(K)
    worker.buf["routed"][0] = len(layers)  # a warming team takes the routing as it would a late prediction
    if worker.run(1) != -1:
        raise RuntimeError("the decode worker stopped in its precompile token")


def forms_for(n_threads: int) -> tuple[str, ...]:
    """The forms a precompile with n_threads compiles."""
    team = n_threads > 1 and team_layer_ok()
    return tuple(f for f in FORMS if f != "team" or team)


def precompile(n_threads: int = 2, forms: tuple[str, ...] | None = None) -> list[Form]:
    """Compile (or load from the cache) the CPU kernel forms (default: forms_for(n_threads)) in this
    process; returns each step's label and seconds, in order."""
    forms = forms_for(n_threads) if forms is None else forms
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise ValueError(f"unknown kernel form {unknown[0]!r} (known: {', '.join(FORMS)})")
    rng = np.random.default_rng(0)
    quant = random_layer(rng, N_EXPERT, N_EMBD, N_FF, (Q4_0, Q4_0, Q4_0))
    floats = random_layer(rng, N_EXPERT, N_EMBD, N_FF, (F16, F16, F16))
    x = np.zeros((1, N_EMBD), np.float32)  # [1, E]
    one = np.zeros(1, np.int64)
    timings: list[Form] = []

    def timed(label: str, fn, *args) -> None:
        t = time.perf_counter()
        fn(*args)
        timings.append(Form(label, time.perf_counter() - t))

    with CpuPool(1) as single, CpuPool(max(2, n_threads)) as pool:
        for form, driver, where in (("rows-one", single, "one thread"), ("rows-pool", pool, "the pool")):
            if form in forms:
                for kind, lay in (("quantized", quant), ("float", floats)):
                    timed(f"expert rows, {where}, {kind}", expert_ffn_cpu, x, one, one, lay, driver)
    if "worker" in forms:
        timed("decode worker, one thread a layer", _token, [quant], n_threads, 1 << 40, False, False)
        timed("decode worker, a parallel region a layer", _token, [quant], n_threads, 0, False, False)
    if "team" in forms:
        if n_threads < 2 or not team_layer_ok():
            raise ValueError("the team form needs n_threads >= 2 and numba's omp or workqueue threading "
                             "layer")
        timed("decode worker, one team a token", _token, [quant], n_threads, 0, True, True)
    return timings


def _cached(module: str, function: str) -> bool:
    """Whether numba's on-disk cache holds a current entry for the function (its index, stamped with the
    source file's, lists one). False where that cannot be told."""
    import importlib

    disp = getattr(importlib.import_module(f"{__package__}.{module}"), function)
    try:
        return bool(disp._cache._cache_file._load_index())  # numba's FunctionCache: {} when stale or missing
    except Exception:  # another numba's internals: unknown, so cold (a precompile of a cached form is ~1 s)
        return False


def cold_forms(forms: tuple[str, ...]) -> tuple[str, ...]:
    """The forms among `forms` that numba's cache does not hold yet."""
    return tuple(f for f in forms if not all(_cached(m, fn) for m, fn in _FORM_KERNELS[f]))


class Background:
    """Precompile processes, one a form, started by `start`; `wait` joins them."""

    def __init__(self, procs: dict[str, subprocess.Popen]):
        self.procs = procs
        self.failed: dict[str, str] = {}  # form -> the last line its process wrote to stderr

    def n_done(self) -> int:
        """How many of the processes have ended."""
        return sum(p.poll() is not None for p in self.procs.values())

    def done(self) -> bool:
        return self.n_done() == len(self.procs)

    def kill(self) -> None:
        """End the processes still running (the caller failed: their forms are not waited for)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()

    def wait(self) -> list[Form]:
        """Each process's steps, in the order of `procs`. A process that failed is listed in `failed` (its
        form then compiles in the caller on first use, as without a precompile). Never raises."""
        out: list[Form] = []
        for form, proc in self.procs.items():
            stdout, stderr = proc.communicate()
            if proc.returncode != 0:
                self.failed[form] = (stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
                continue
            for line in stdout.splitlines():
                label, _, seconds = line.rpartition(": ")
                if label and seconds.endswith(" s"):
                    out.append(Form(label, float(seconds[:-2])))
        return out


def start(forms: tuple[str, ...], n_threads: int) -> Background:
    """Start `python -m strata_ray.kernels.precompile --jobs 1 --forms F` for each form, each compiling
    into numba's cache (the same folder: the environment is inherited). Processes of different forms write
    different functions' index files, and those they share (callees) hold the same entry, written
    atomically by numba."""
    procs = {
        form: subprocess.Popen(
            [sys.executable, "-m", "strata_ray.kernels.precompile", "--threads", str(n_threads),
             "--jobs", "1", "--forms", form],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, PARENT_ENV: str(os.getpid())})
        for form in forms
    }
    return Background(procs)


def _end_with_parent(parent: int) -> None:
    """In a `start` process: on Linux, SIGTERM when the parent dies (a killed actor or driver), so no compile
    outlives the run that asked for it; set here rather than between fork and exec (preexec_fn), which is
    unsafe in a parent with threads. A parent gone before this line: exit now. Elsewhere nothing: those
    processes exit when their compile ends."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        sys.exit(1)


def run_parallel(forms: tuple[str, ...], n_threads: int, jobs: int) -> tuple[list[Form], dict[str, str]]:
    """Each form in a process of its own, at most `jobs` at a time, the slowest first; returns the steps in
    FORMS order and the forms whose process failed."""
    queue = sorted(forms, key=SLOWEST_FIRST.index)
    running: dict[str, Background] = {}
    steps: dict[str, list[Form]] = {}
    failed: dict[str, str] = {}
    while queue or running:
        while queue and len(running) < jobs:
            form = queue.pop(0)
            running[form] = start((form,), n_threads)
        finished = [form for form, bg in running.items() if bg.done()]
        for form in finished:
            bg = running.pop(form)
            steps[form] = bg.wait()
            failed.update(bg.failed)
        if not finished:
            time.sleep(0.05)
    return [s for form in FORMS for s in steps.get(form, ())], failed


def main(argv: list[str] | None = None) -> int:
    summary = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m strata_ray.kernels.precompile", description=summary)
    parser.add_argument("--threads", type=int, default=2,
                        help="threads of the parallel forms (their compiled code does not depend on it; >= 2 "
                             "compiles the team form too; default 2)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes: each form not yet in numba's cache compiles in a process of its "
                             "own, this many at a time at most (default: the host's cores; 1: every form in "
                             "this process, one after another)")
    parser.add_argument("--forms", default=None,
                        help=f"comma-separated forms to compile, of {', '.join(FORMS)} (default: every form "
                             "the thread count uses)")
    args = parser.parse_args(argv)
    if os.environ.get(PARENT_ENV, "").isdigit():
        _end_with_parent(int(os.environ[PARENT_ENV]))
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    jobs = cpu_count() if args.jobs is None else args.jobs
    if jobs < 1:
        parser.error("--jobs must be at least 1")
    forms = forms_for(args.threads)
    if args.forms is not None:
        forms = tuple(f for f in args.forms.split(",") if f)
        unknown = [f for f in forms if f not in FORMS]
        if unknown or not forms:
            parser.error(f"--forms: unknown form {unknown[0] if unknown else args.forms!r} (known: "
                         f"{', '.join(FORMS)})")
        if "team" in forms and (args.threads < 2 or not team_layer_ok()):
            parser.error("--forms team needs --threads >= 2 and numba's omp or workqueue threading layer")
    t = time.perf_counter()
    cold = cold_forms(forms) if jobs > 1 else ()
    cold = cold if len(cold) > 1 else ()  # a single cold form compiles here: no process to start
    steps, failed = run_parallel(cold, args.threads, jobs) if cold else ([], {})
    rest = tuple(f for f in forms if f not in cold)
    steps += precompile(args.threads, rest) if rest else []
    for step in steps:
        print(f"{step.label}: {step.seconds:.1f} s", flush=True)
    for form, why in failed.items():
        print(f"{form}: its precompile process failed: {why}", file=sys.stderr, flush=True)
    where = f" ({len(cold)} processes)" if cold else ""
    print(f"CPU kernels compiled (or loaded from the cache) in {time.perf_counter() - t:.1f} s{where}",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
