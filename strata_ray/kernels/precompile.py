"""Compile the CPU expert kernels into numba's on-disk cache ahead of their first use.

The kernels are `cache=True` numba functions: a fresh install compiles them on first use, minutes on a small
host (the decode token worker's two forms and the pool's parallel kernel are most of it), then loads them in
about a second. `python -m strata_ray.kernels.precompile` does that work ahead, for an image build or for CI
while it builds something else, through the same wrappers the engine calls, so the cached signatures are the
ones a run looks up (the wrappers give every caller one set of argument types: read-only weights, plain-int
quant types, int64 shares, uint32 flag values).

    python -m strata_ray.kernels.precompile [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .contract import F16, Q4_0
from .cpu_pool import CpuPool
from .cpu_token_rows import CpuTokenRows, team_layer_ok
from .expert_cpu import expert_ffn_cpu
from .random_weights import random_layer

N_EXPERT, N_EMBD, N_FF, K = 4, 256, 256, 2  # the smallest layer every path accepts (K-quant rows are 256)


def _token(layers, n_threads: int, single_thread_bytes: int, team: bool, warm: bool) -> None:
    """One token of the decode worker whose flags are already raised, so no layer waits."""
    res = np.full(len(layers) * N_EXPERT, -1, np.int32)  # nothing resident: every entry is the CPU's
    worker = CpuTokenRows(layers, res, K, n_threads, single_thread_bytes=single_thread_bytes, team=team,
                          warm=warm)
    worker.buf["ids"][:] = np.arange(K)
    worker.buf["routed"][0] = len(layers)  # a warming team takes the routing as it would a late prediction
    if worker.run(1) != -1:
        raise RuntimeError("the decode worker stopped in its precompile token")


def precompile(n_threads: int = 2) -> list[tuple[str, float]]:
    """Compile (or load from the cache) every CPU kernel form; returns (form, seconds) in order."""
    rng = np.random.default_rng(0)
    quant = random_layer(rng, N_EXPERT, N_EMBD, N_FF, (Q4_0, Q4_0, Q4_0))
    floats = random_layer(rng, N_EXPERT, N_EMBD, N_FF, (F16, F16, F16))
    x = np.zeros((1, N_EMBD), np.float32)  # [1, E]
    one = np.zeros(1, np.int64)
    timings = []

    def timed(name: str, fn, *args) -> None:
        t = time.perf_counter()
        fn(*args)
        timings.append((name, time.perf_counter() - t))

    with CpuPool(1) as single, CpuPool(max(2, n_threads)) as pool:
        for kind, lay in (("quantized", quant), ("float", floats)):
            timed(f"expert rows, one thread, {kind}", expert_ffn_cpu, x, one, one, lay, single)
            timed(f"expert rows, the pool, {kind}", expert_ffn_cpu, x, one, one, lay, pool)
    timed("decode worker, one thread a layer", _token, [quant], n_threads, 1 << 40, False, False)
    timed("decode worker, a parallel region a layer", _token, [quant], n_threads, 0, False, False)
    if n_threads > 1 and team_layer_ok():
        timed("decode worker, one team a token", _token, [quant], n_threads, 0, True, True)
    return timings


def main(argv: list[str] | None = None) -> int:
    summary = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m strata_ray.kernels.precompile", description=summary)
    parser.add_argument("--threads", type=int, default=2,
                        help="threads of the parallel forms (their compiled code does not depend on it; >= 2 "
                             "compiles the team form too; default 2)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    t = time.perf_counter()
    for name, seconds in precompile(args.threads):
        print(f"{name}: {seconds:.1f} s", flush=True)
    print(f"CPU kernels compiled (or loaded from the cache) in {time.perf_counter() - t:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
