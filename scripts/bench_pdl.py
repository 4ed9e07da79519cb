"""What programmatic dependent launch (PDL) saves between the decode chain's small kernels, in a CUDA graph.

A decode layer is ~12 small kernels in a row (norms, GEMVs of one token, the router, the GDN step), each
1.3-13 us, with ~0.4 us idle before each and a ramp of its own (session 41 trace). With PDL (Hopper+), a
kernel launched with `launch_pdl=True` may start while the kernel before it finishes: its programs run up to
`gdc_wait()` (which returns once the kernel before has completed and its writes are visible), so the launch,
the programs' start and any loads that do not depend on the kernel before (weights) overlap its tail. The
kernel before lets it start early with `gdc_launch_dependents()`.

This times chains of N kernels captured in one graph, replayed: a one-program norm over 2,048 floats
(`norm`), a 512-program float GEMV of 512 x 2,048 (`rows`, the router's logits), and the two alternating
(`mixed`), each plain, with PDL (wait first), and with PDL where `rows` loads its weights before the wait.

    python scripts/bench_pdl.py [--chain 96] [--reps 200]
"""

from __future__ import annotations

import argparse
import json

import torch

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


def _norm_body(X, W, Y, N: tl.constexpr, PDL: tl.constexpr):
    # X, W, Y f32 [N]: Y = X * rsqrt(mean(X^2) + eps) * W. One program.
    i = tl.arange(0, N)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(W + i)  # weights: not written by the kernel before
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + i)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + 1e-6)
    tl.store(Y + i, x * r * w)


def _rows_body(X, W, Y, K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    # X f32 [K], W f32 [R, K], Y f32 [R] (the first K of them also feed the next kernel). One program a row.
    r = tl.program_id(0)
    k = tl.arange(0, K)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if EARLY:
        w = tl.load(W + r.to(tl.int64) * K + k)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if not EARLY:
        w = tl.load(W + r.to(tl.int64) * K + k)
    x = tl.load(X + k)
    tl.store(Y + r, tl.sum(w * x, axis=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chain", type=int, default=96, help="kernels in a graph (default 96)")
    ap.add_argument("--reps", type=int, default=200, help="graph replays timed (default 200)")
    ap.add_argument("--json-out", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.chain < 1 or args.reps < 1:
        ap.error("--chain and --reps must be at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("bench_pdl: needs a CUDA GPU (programmatic dependent launch is Hopper's)")
    from strata_ray.kernels.lazy_triton import jit_bodies

    norm_k, rows_k = jit_bodies(_norm_body, _rows_body)
    n, rows = 2048, 512
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, device=dev, generator=g)
    w_norm = torch.rand(n, device=dev, generator=g)
    w_rows = torch.randn(rows, n, device=dev, generator=g) / n
    y_rows = torch.empty(rows, device=dev)

    def chain(kind: str, pdl: bool, early: bool) -> None:
        for i in range(args.chain):
            use_norm = kind == "norm" or (kind == "mixed" and i % 2 == 0)
            if use_norm:
                norm_k[(1,)](x, w_norm, x, N=n, PDL=pdl, num_warps=4, launch_pdl=pdl)
            else:
                # the GEMV's output is not fed back (rows < n): the graph orders the launches all the same
                rows_k[(rows,)](x, w_rows, y_rows, K=n, PDL=pdl, EARLY=early, num_warps=4, launch_pdl=pdl)

    results = []
    for kind in ("norm", "rows", "mixed"):
        for label, pdl, early in (("plain", False, False), ("pdl", True, False), ("pdl-early", True, True)):
            if kind == "norm" and early:
                continue
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                chain(kind, pdl, early)  # compile and warm
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(kind, pdl, early)
            for _ in range(10):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            best = float("inf")
            for _ in range(3):
                start.record()
                for _ in range(args.reps):
                    graph.replay()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) * 1e3 / args.reps / args.chain)
            results.append({"chain": kind, "mode": label, "us_per_kernel": round(best, 3)})
            print(f"{kind:6s} {label:9s} {best:6.2f} us a kernel ({args.chain} a graph)", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
