"""A decode layer's CPU rows: one `expert_ffn_cpu` call per layer (the decode path today) against the token
worker (`CpuTokenRows`: every layer in one nogil numba call, released by a flag), on the same experts.

A thread plays the device: per layer it writes ids and x, raises the `routed` flag and spins until the rows
flag comes back; the time between the two is what the device would wait. The direct path times the call the
host makes today (Python driver, the pool's parallel call). Layers of random Q4_0 blocks, Qwen3-Next-80B
shapes (E 2048, n_ff 512), top-10 with `--misses` entries a layer on the CPU.

    PYTHONPATH=. python scripts/bench_token_rows.py [--threads 2] [--layers 8] [--misses 3,6] [--tokens 10]
        [--experts 24] [--fresh] [--mixer-us 80]

--mixer-us N plays a layer's mixer too: before each layer's routing the thread hands the worker the layer's
prediction (its routing itself: the H200 predicted 98.5% right) and spins N us, as the device's mixer takes;
the team then runs twice, cold and warming (CpuTokenRows(warm=True): each member reads its share of the
predicted rows' weights meanwhile). The flag to flag time is the CPU rows' share of the token.

By default every token routes to the same experts, and 8 layers of 24 experts (340 MB) are reused for all
48: on a host with a large L3 (the H200 machine's 300 MiB) much of that is served from cache, so the rate
is above what the engine sees. --fresh draws new routing every token and layer, and with --layers 48
--experts 64 (5.4 GB) the experts come from DRAM as in the engine.

The thread playing the device spins on a core of its own: give the pool at most the other cores (on the
2-core VM, --threads 1), or the pool's threads and the spinner share cores and both numbers mean little. A
team needs 2 threads or more: with one, the team forms are not run (one line says so).
"""

from __future__ import annotations

import argparse
import threading
import time

import numba
import numpy as np

from strata_ray.config import int_list
from strata_ray.kernels.block_dots import HALF_ROWS, ROWS
from strata_ray.kernels.contract import Q4_0
from strata_ray.kernels.cpu_pool import CpuPool
from strata_ray.kernels.cpu_token_rows import PHASES, CpuTokenRows, cycles_per_second
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.kernels.expert_cpu_token import COUNTER, DYNAMIC, GATHER, reached
from strata_ray.kernels.random_weights import random_layer

E, N_FF, K = 2048, 512, 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="token worker threads (the team)")
    ap.add_argument("--layers", type=int, default=8, help="distinct expert layers (reused to make 48)")
    ap.add_argument("--experts", type=int, default=24, help="experts per layer")
    ap.add_argument("--misses", default="6", type=int_list(1, K),
                    help="CPU entries a layer (a list: a run each)")
    ap.add_argument("--tokens", type=int, default=10, help="tokens timed, each over the 48 layers")
    ap.add_argument("--fresh", action="store_true", help="new routing every token (else the same experts)")
    ap.add_argument("--mixer-us", type=float, default=0.0,
                    help="a mixer's time before each routing, the prediction handed over first (0: none)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    distinct = [random_layer(rng, args.experts, E, N_FF, (Q4_0, Q4_0, Q4_0), from_floats=False)
                for _ in range(args.layers)]
    layers = [distinct[i % len(distinct)] for i in range(48)]
    res = np.full(48 * args.experts, -1, np.int32)
    n_routes = args.tokens if args.fresh else 1
    routes = [np.stack([rng.choice(args.experts, K, replace=False) for _ in layers]) for _ in range(n_routes)]

    def route(token: int, misses: int) -> np.ndarray:
        """Token's ids [48, K], its first K - misses entries marked resident in `res` (between tokens:
        the worker reads the table only during its call)."""
        ids = routes[token % n_routes]
        res[:] = -1
        for layer in range(48):
            res[layer * args.experts + ids[layer, : K - misses]] = 0
        return ids

    xs = rng.standard_normal((48, 1, E)).astype(np.float32)
    blob_mb = 3 * E * N_FF // 32 * 18 / 1e6
    held = args.layers * args.experts * blob_mb
    print(f"experts: {args.layers} distinct layers x {args.experts} ({held:.0f} MB), "
          f"{'new' if args.fresh else 'the same'} routing every token")

    pool = CpuPool(args.threads)
    for misses in args.misses:
        direct = []
        for token in range(args.tokens):
            ids = route(token, misses)
            for layer, lay in enumerate(layers):
                miss = ids[layer, K - misses :]
                t = time.perf_counter()
                expert_ffn_cpu(xs[layer], np.zeros(miss.size, np.int64), miss, lay, pool=pool)
                direct.append(time.perf_counter() - t)

        waits, warmed, phases = {}, {}, {}
        # two parallel regions a layer, then one region a token (its barriers a shared counter, then gathered
        # arrival lines, with fixed shares in half-tile and whole-tile gate/up units and then units taken from
        # a counter), then (with a mixer) that team warming
        variants = [(False, False, GATHER, HALF_ROWS), (True, False, COUNTER, HALF_ROWS),
                    (True, False, GATHER, HALF_ROWS), (True, False, GATHER, ROWS),
                    (True, False, DYNAMIC, HALF_ROWS)]
        if args.mixer_us:
            variants.append((True, True, GATHER, HALF_ROWS))
        no_team = None  # why the team forms were not run
        for key in variants:
            team, warm, form, unit_rows = key
            worker = CpuTokenRows(layers, res, K, args.threads, single_thread_bytes=0, team=team, warm=warm,
                                  form=form, unit_rows=unit_rows)
            if team and not worker.team:
                # CpuTokenRows runs the two-region form where it cannot form a team (one thread, or a
                # threading layer that does not run a team's members at once): timed under the team's labels,
                # that form was printed again as each team variant, and member 0's steps, which only a team
                # stamps, as zeros (--threads 1)
                no_team = (f"{worker.n_threads} thread: a team needs 2 or more" if worker.n_threads < 2 else
                           f"numba's threading layer {numba.threading_layer()!r} runs no team")
                continue
            b = worker.buf
            waits[key], phases[key] = [], []
            base = 1
            for token in range(args.tokens):
                ids = route(token, misses)
                b["routed"][0] = b["rows_flag"][0] = b["predicted"][0] = base - 1
                thread = threading.Thread(target=worker.run, args=(base,))
                thread.start()
                for layer in range(48):
                    v = base + layer
                    if args.mixer_us:  # the prediction, then the mixer's time
                        b["pred_ids"][:] = ids[layer]
                        b["predicted"][0] = v
                        t = time.perf_counter()
                        while time.perf_counter() - t < args.mixer_us * 1e-6:
                            pass
                    b["ids"][:] = ids[layer]
                    worker.put_x(xs[layer])
                    t = time.perf_counter()
                    b["routed"][0] = v
                    while not reached(b["rows_flag"], v):
                        pass
                    waits[key].append(time.perf_counter() - t)
                thread.join()
                base += 48
                if token:  # the first token of each: warm-up
                    phases[key].append(worker.phase_cycles())
            warmed[key] = worker.n_warm.copy()
        skip = 48  # the first token of each: warm-up
        d = np.median(direct[skip:]) * 1e3
        mb = misses * blob_mb
        print(f"{args.threads} threads, {misses} CPU entries a layer ({mb:.1f} MB of experts):")
        print(f"  expert_ffn_cpu call per layer:          {d:.3f} ms (median of {len(direct) - skip})")
        labels = {(False, False, GATHER, HALF_ROWS): "token worker, two regions a layer:  ",
                  (True, False, COUNTER, HALF_ROWS): "one team a token, counter barriers: ",
                  (True, False, GATHER, HALF_ROWS): "one team a token, gather barriers:  ",
                  (True, False, GATHER, ROWS): "the same, whole-tile gate/up units: ",
                  (True, False, DYNAMIC, HALF_ROWS): "one team a token, units by counter: ",
                  (True, True, GATHER, HALF_ROWS): f"the team warming ({args.mixer_us:g} us mixer):"}
        rate = cycles_per_second() or 1.0
        for key in waits:
            label = labels[key]
            w = np.median(waits[key][skip:]) * 1e3
            n = len(waits[key]) - skip
            print(f"  {label} {w:.3f} ms flag to flag, {mb / w:.1f} GB/s (median of {n})")
            if key[0] and phases[key]:
                us = np.median(np.concatenate(phases[key]), axis=0) / rate * 1e6
                print("    member 0's steps, median us: "
                      + ", ".join(f"{name} {u:.1f}" for name, u in zip(PHASES, us, strict=True)))
            if key[1]:
                n_warm = warmed[key]
                print(f"    read ahead: {int(n_warm[:, 0].sum())} entries, {int(n_warm[:, 1].sum())} used "
                      "(the last token)")
        if no_team:
            print(f"  one team a token: not run ({no_team})")


if __name__ == "__main__":
    main()
