"""CPU expert kernel benchmark: GB/s of expert bytes read vs host memcpy, per thread count.

`python scripts/bench_cpu_kernels.py [--threads 1,2] [--types Q8_0,Q4_0,Q4_K,Q6_K] [--tokens 1,4]
[--drivers numba,pool] [--model M.gguf [--layers 8] [--arena]]`
Shape: Qwen3-Next-80B-A3B experts (E = 2048, n_ff = 512, top-10). Calls walk the whole expert pool, ten
distinct experts a call, and the pool is twice the L3 cache by default (the H200 host has 300 MiB of L3),
so the weights come from DRAM. GB/s = bytes of every
distinct expert's gate+up+down read per call / time per call; memcpy is counted read + write, the
same way as scripts/bench_kernels.py.

`--paired N` times N passes of each case, each right after a host memcpy of its own, and gives the median of
the N ratios (kernel GB/s / that memcpy's) with their range: on a shared VM both rates swing up to 2x from
minute to minute (session 57: memcpy 28-57 GB/s, Q4_0 0.76-1.57 ms a call in five runs), so a ratio of
best passes measured minutes apart says little, while the two halves of a pair share the machine's state.

`--model` runs the same calls over a GGUF's expert layers as the engine holds them (the host store: views of
the memory-mapped file, or with `--arena` copies in anonymous memory), one layer per pass in turn, so the
kernels' rate in the bench and in the engine can be told apart from where the bytes live.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numba
import numpy as np
from bandwidth import host_copy_gbs  # a sibling module (scripts/ is sys.path[0] when run)

from strata_ray.config import int_list, name_list
from strata_ray.experts.pcie_share import HostCopy
from strata_ray.kernels.contract import BLOCK, ExpertLayer, type_name
from strata_ray.kernels.cpu_pool import CpuPool
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.kernels.random_weights import Q_TYPES_FOR_TESTS as TYPES  # the types random_layer builds
from strata_ray.kernels.random_weights import random_layer

E, N_FF, TOP_K = 2048, 512, 10
QK_ELEMS = {t: BLOCK[t][0] for t in TYPES.values()}  # values per block
BLOCK_BYTES = {t: BLOCK[t][1] for t in TYPES.values()}


_LAYERS: dict = {}


def bench_type(wtype: int, pool: CpuPool, n_tok: int, n_expert: int, reps: int, rng,
               top_k: int = TOP_K, ratios: list | None = None) -> tuple[float, float]:
    """(ms per call, GB/s) for n_tok tokens x top_k experts over a pool of n_expert experts (ratios:
    bench_layers')."""
    key = (wtype, n_expert)
    if key not in _LAYERS:  # one random pool per type and size (random bytes of a GB take seconds)
        _LAYERS.clear()
        _LAYERS[key] = random_layer(rng, n_expert, E, N_FF, (wtype,) * 3)
    return bench_layers([_LAYERS[key]], pool, n_tok, reps, rng, top_k, ratios)


def bench_layers(layers: list[ExpertLayer], pool: CpuPool, n_tok: int, reps: int, rng,
                 top_k: int = TOP_K, ratios: list | None = None) -> tuple[float, float]:
    """(ms per call, GB/s): n_tok tokens x top_k distinct experts a call, every expert of every layer
    once per pass (layer after layer, as a decode token walks them), best pass of `reps`. ratios: a list to
    which each pass appends (its GB/s, the GB/s of a host memcpy just before it), the memcpy run first."""
    per = sum(w.shape[1] * w.shape[2] for w in (layers[0].gate, layers[0].up, layers[0].down))
    n_embd = layers[0].n_embd
    x = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    tok = np.repeat(np.arange(n_tok), top_k).astype(np.int32)
    calls = []  # every expert once per pass: nothing is left in the caches from the last call
    for layer in layers:
        n_expert = layer.gate.shape[0]
        for s in rng.permutation(n_expert)[: n_expert // top_k * top_k].reshape(-1, top_k):
            exp = np.concatenate([rng.permutation(s) for _ in range(n_tok)]).astype(np.int32)
            calls.append((layer, tok, exp))
    expert_ffn_cpu(x, *calls[0][1:], calls[0][0], pool=pool)  # compile / warm
    best = 1e9
    copier = HostCopy(pool, 1 << 28) if ratios is not None else None  # one memcpy pass before each
    for _ in range(reps):
        copy_gbs = 0.0
        if copier is not None:
            copy_gbs = copier.gbs()
            # the pool's threads wake on an untimed call: the pass's last, whose experts the pass's first
            # calls evict from the caches before it comes round (a pass is twice the L3)
            expert_ffn_cpu(x, calls[-1][1], calls[-1][2], calls[-1][0], pool=pool)
        t = time.perf_counter()
        for layer, tk, ex in calls:
            expert_ffn_cpu(x, tk, ex, layer, pool=pool)
        dt = (time.perf_counter() - t) / len(calls)
        best = min(best, dt)
        if ratios is not None:
            ratios.append((top_k * per / dt / 1e9, copy_gbs))
    return best * 1e3, top_k * per / best / 1e9


def paired_line(pairs: list[tuple[float, float]]) -> str:
    """The pairs' median ratio of kernel to memcpy GB/s, its range, and the median of each rate."""
    ratios = [k / c for k, c in pairs]
    kernel, copy = statistics.median(k for k, _ in pairs), statistics.median(c for _, c in pairs)
    return (f"paired: {100 * statistics.median(ratios):.0f}% of memcpy (median of {len(pairs)}; "
            f"{100 * min(ratios):.0f}-{100 * max(ratios):.0f}%), kernel {kernel:.1f} GB/s, "
            f"memcpy {copy:.1f} GB/s")


def model_layers(path: str, n_layers: int, arena: bool) -> tuple[list[ExpertLayer], str]:
    """The first n_layers expert layers of a GGUF as the engine's host store holds them, and a label."""
    from strata_ray.experts.host_store import HostStore
    from strata_ray.model.gguf_file import GGUFFile

    store = HostStore(GGUFFile(path), prefault_pages=True)
    blocks = sorted(store.layers)[:n_layers]
    if arena:  # those layers only: anonymous memory instead of the file map (not page-locked)
        need = sum(store.layouts[b].nbytes * store.n_expert for b in blocks)
        store.move_to_arena(need / 2**30 + 1e-3, register=False)
    layers = [store.layer(b) for b in blocks]
    gib = sum(a.nbytes for lay in layers for a in (lay.gate, lay.up, lay.down)) / 2**30
    where = "anonymous arena" if arena else "file map"
    return layers, f"{len(layers)} layers of {path} ({gib:.1f} GiB, {where})"


def l3_bytes() -> int:
    """The L3 cache size from sysfs (32 MiB when unknown)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
    except OSError:
        return 32 << 20
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def pool_experts(wtype: int, requested: int | None) -> int:
    """Experts in the pool: the requested count, else enough for twice the L3 (at least 64)."""
    if requested:
        return requested
    per = 3 * N_FF * E // QK_ELEMS[wtype] * BLOCK_BYTES[wtype]
    return max(64, -(-2 * l3_bytes() // per))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", type=int_list(1), help="CPU pool threads, a list: a run each")
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q6_K", type=name_list(TYPES),
                    help="expert weight types, a list")
    ap.add_argument("--tokens", default="1,4", type=int_list(1),
                    help="tokens a call, a list (each routed to --top-k experts)")
    ap.add_argument("--top-k", default=str(TOP_K), type=int_list(1),
                    help="experts per call, e.g. 2,5,10: the time per call "
                    "against the count gives the call's fixed cost (the engine's decode calls hold ~5)")
    ap.add_argument("--experts", type=int, default=None, help="expert pool size (default: twice the L3)")
    ap.add_argument("--reps", type=int, default=5, help="timed passes of each case (the best is shown)")
    ap.add_argument("--paired", type=int, default=0, metavar="N",
                    help="N passes of each case instead, each after a host memcpy of its own: the median "
                    "ratio of the pairs (a shared machine's rates swing between minutes)")
    ap.add_argument("--drivers", default="numba", type=name_list(("numba", "pool")),
                    help="numba (one parallel numba call), pool (a job per "
                    "Python thread), or both: numba,pool")
    ap.add_argument("--model", default=None, help="also time the calls over this GGUF's expert layers, as "
                    "the engine's host store holds them (--types is ignored for them)")
    ap.add_argument("--layers", type=int, default=8, help="expert layers of --model to walk (default 8)")
    ap.add_argument("--arena", action="store_true", help="--model's layers copied into anonymous memory "
                    "(the store's arena, not page-locked) instead of read from the file map")
    args = ap.parse_args()
    # each call routes a token to top-k distinct experts of the pool (an IndexError deep in the case before)
    if args.experts is not None and args.experts < max(args.top_k):
        ap.error(f"--experts {args.experts} is fewer than --top-k {max(args.top_k)}: a token's experts are "
                 "distinct")
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, not {args.reps}")
    if args.paired < 0 or args.paired == 1:
        ap.error(f"--paired must be 0 (off) or at least 2, not {args.paired}")
    if args.model and args.layers < 1:  # read only with --model
        ap.error(f"--layers must be at least 1, not {args.layers}")
    rng = np.random.default_rng(0)
    model = model_layers(args.model, args.layers, args.arena) if args.model else None
    for n_threads, driver in ((t, d) for t in args.threads for d in args.drivers):
        with CpuPool(n_threads, numba_parallel=driver == "numba") as pool:
            print(f"threads {n_threads} ({driver}): host memcpy {host_copy_gbs(pool, 1 << 28):.1f} GB/s "
                  "(read + write)")
            cases = [(t, k) for t in args.tokens for k in args.top_k]
            for name in args.types:
                for n_tok, k in cases:
                    n_expert = pool_experts(TYPES[name], args.experts)
                    pairs = [] if args.paired else None
                    ms, gbs = bench_type(TYPES[name], pool, n_tok, n_expert, args.paired or args.reps, rng, k,
                                         pairs)
                    case = f"{type_name(TYPES[name]):5s} {n_tok} tok x top-{k}"
                    paired = f"; {paired_line(pairs)}" if pairs else ""
                    print(f"  {case}: {ms:7.2f} ms  {gbs:6.1f} GB/s{paired}", flush=True)
            if driver == "numba" and n_threads > 1:  # omp, tbb or workqueue
                print(f"  numba threading layer: {numba.threading_layer()}, GOMP_SPINCOUNT="
                      f"{os.environ.get('GOMP_SPINCOUNT')}")
            if model is not None:
                layers, label = model
                print(f"  {label}:")
                for n_tok, k in cases:
                    pairs = [] if args.paired else None
                    ms, gbs = bench_layers(layers, pool, n_tok, args.paired or args.reps, rng, k, pairs)
                    case = f"{type_name(layers[0].gate_type):5s} {n_tok} tok x top-{k}"
                    paired = f"; {paired_line(pairs)}" if pairs else ""
                    print(f"  {case}: {ms:7.2f} ms  {gbs:6.1f} GB/s{paired}", flush=True)


if __name__ == "__main__":
    main()
