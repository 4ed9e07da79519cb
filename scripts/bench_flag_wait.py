"""What the in-graph host-flag wait's memory order costs a decode layer (kernels/flag_wait.ORDERS).

The pipelined decode waits for the CPU worker's rows once a layer, inside the token's graph (flag_wait),
then a kernel reads those rows from page-locked host memory over PCIe. The wait's spin loads were relaxed
(volatile) until session 57; "acquire" makes them `ld.acquire.sys`, "fence" adds one `fence.acq_rel.sys`
after a relaxed spin. Either gives the PTX memory model's promise that the reads after the wait see the
worker's rows; this times what each costs.

A graph of --layers layers, each a wait on a flag already at its target (the cost of the order itself, not
of waiting) and a one-program kernel that reads a layer's worker rows (--rows x 2,048 floats) from
page-locked host memory into device memory, as the combine does; "none" is the reads alone. Forms are
timed in interleaved rounds (a graph's replays each), so a drifting clock touches them alike.

    python scripts/bench_flag_wait.py [--layers 48] [--rows 10] [--reps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from strata_ray.kernels.flag_wait import ORDERS, wait_flag

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch
E = 2048  # a row's floats (n_embd of the 80B model)


def _read_body(SRC, DST, N: tl.constexpr):
    # SRC f32 [N] (page-locked host memory, read over PCIe), DST f32 [N] (device). One program.
    i = tl.arange(0, N)
    tl.store(DST + i, tl.load(SRC + i))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48, help="layers in a graph (default 48)")
    ap.add_argument("--rows", type=int, default=10, help="worker rows a layer reads (default 10: top-10)")
    ap.add_argument("--reps", type=int, default=200, help="graph replays a timing (default 200)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every form (default 5)")
    ap.add_argument("--json-out", default=None, help="also write the results here")
    args = ap.parse_args()
    if min(args.layers, args.rows, args.reps, args.rounds) < 1:
        ap.error("--layers, --rows, --reps and --rounds must be at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("bench_flag_wait: needs a CUDA GPU (the flag is read over PCIe)")
    from strata_ray.kernels.lazy_triton import jit_bodies
    from strata_ray.kernels.stream_flags import HostFlag

    (read_k,) = jit_bodies(_read_body)
    dev = torch.device("cuda")
    n = args.rows * E
    n_pow2 = 1 << (n - 1).bit_length()
    src = torch.randn(n_pow2, pin_memory=True)
    dst = torch.empty(n_pow2, device=dev)
    flag = HostFlag(dev)
    base = torch.zeros(1, dtype=torch.int64, device=dev)
    flag.set(args.layers + 1)  # every layer's target (base + layer) already reached

    def layers(form: str) -> None:
        for layer in range(args.layers):
            if form != "none":
                wait_flag(flag.tensor, base, layer, order=form)
            read_k[(1,)](src, dst, N=n_pow2, num_warps=8)

    graphs = {}
    for form in ("none", *ORDERS):
        layers(form)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers(form)
        graphs[form] = graph
    times: dict[str, list[float]] = {form: [] for form in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.rounds):
        for form, graph in graphs.items():
            for _ in range(5):
                graph.replay()
            start.record()
            for _ in range(args.reps):
                graph.replay()
            end.record()
            end.synchronize()
            times[form].append(start.elapsed_time(end) * 1e3 / args.reps / args.layers)
    results = []
    none = statistics.median(times["none"])
    for form, ts in times.items():
        med = statistics.median(ts)
        results.append({"form": form, "us_per_layer": round(med, 3), "over_none_us": round(med - none, 3),
                        "spread_us": [round(min(ts), 3), round(max(ts), 3)]})
        print(f"{form:8s} {med:7.3f} us a layer (+{med - none:6.3f} over the reads alone; "
              f"rounds {min(ts):.3f}-{max(ts):.3f})", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "layers": args.layers, "rows": args.rows,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
