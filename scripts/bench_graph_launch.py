"""Host cost of launching a CUDA graph, by node kind: what a decode segment's replay costs the host.

A decode token replays ~50 graph segments; on the H200 host a GDN layer's segment (105 nodes) cost ~180 us
of cudaGraphLaunch, ~1.7 us a node, and the host issues them one after the other. This captures graphs of
N nodes of one kind and times `replay()` on the host (the device work is tiny):

    kernel   y.add_(1)                       (an elementwise kernel node)
    copy     dst.copy_(src), same dtype      (a device-to-device memcpy node)
    mul1     torch.mul(src, 1, out=dst)      (the same copy as a kernel: x * 1 keeps every bit, -0.0 too)
    mixed    the segment's mix: 7 copies per 100 nodes

    python scripts/bench_graph_launch.py [--nodes 25,100] [--reps 200]
"""

from __future__ import annotations

import argparse
import time

import torch


def build(kind: str, n: int, dev) -> torch.cuda.CUDAGraph:
    a = torch.zeros(2048, device=dev)
    b = torch.zeros(2048, device=dev)
    ops = {
        "kernel": lambda i: a.add_(1),
        "copy": lambda i: b.copy_(a),
        "mul1": lambda i: torch.mul(a, 1, out=b),
        "mixed": lambda i: b.copy_(a) if i % 14 == 0 else a.add_(1),
    }[kind]
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for i in range(n):
            ops(i)
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            ops(i)
    g._keep = (a, b)  # the graph reads them: keep them alive with it
    return g


def launch_us(g: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median host time of one replay (synchronising every 10 launches, so the queue never fills)."""
    times = []
    for i in range(reps):
        t = time.perf_counter()
        g.replay()
        times.append(time.perf_counter() - t)
        if i % 10 == 9:
            torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="25,100")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA device")
    dev = torch.device("cuda")
    for n in (int(v) for v in args.nodes.split(",")):
        for kind in ("kernel", "copy", "mul1", "mixed"):
            g = build(kind, n, dev)
            g.replay()
            torch.cuda.synchronize()
            us = launch_us(g, args.reps)
            print(f"{kind:6s} x {n:4d} nodes: replay {us:7.1f} us on the host ({us / n:.2f} us a node)",
                  flush=True)


if __name__ == "__main__":
    main()
