"""Host cost of launching a CUDA graph, by node kind: what a decode segment's replay costs the host.

A decode token replays ~50 graph segments; on the H200 host a GDN layer's segment (105 nodes) cost ~180 us
of cudaGraphLaunch, ~1.7 us a node, and the host issues them one after the other. This captures graphs of
N nodes of one kind and times `replay()` on the host (the device work is tiny):

    kernel   y.add_(1)                       (an elementwise kernel node)
    copy     dst.copy_(src), same dtype      (a device-to-device memcpy node)
    mul1     torch.mul(src, 1, out=dst)      (the same copy as a kernel: x * 1 keeps every bit, -0.0 too)
    mixed    the segment's mix: 7 copies per 100 nodes
    forked   a decode token graph's shape: every 40 kernels on the main stream, 4 on a forked stream and
             4 on another, joined back by events (a graph with forks is not straight-line: CUDA launches
             straight-line graphs in constant time, others in time that grows with the nodes)

and, per kind, `start`: the device's time from the replay call to a first node's completion, the first node
a ~0.5 ms spin (torch.cuda._sleep) ahead of the rest, against the same graph's host launch: when the device
waits for the whole launch before its first node, replay-to-first-node exceeds the launch time.

    python scripts/bench_graph_launch.py [--nodes 25,100,2000] [--reps 200] [--kinds kernel,forked]
"""

from __future__ import annotations

import argparse
import time

import torch

from strata_ray.config import int_list, name_list

KINDS = ("kernel", "copy", "mul1", "mixed", "forked")


def build(kind: str, n: int, dev, first=None) -> torch.cuda.CUDAGraph:
    """A graph of n nodes of one kind; first(): a node captured ahead of them (the start measure's spin)."""
    a = torch.zeros(2048, device=dev)
    b = torch.zeros(2048, device=dev)
    c = torch.zeros(2048, device=dev)
    forks = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))

    def forked(i: int) -> None:
        # 48 nodes: 40 kernels on the capturing stream, 4 on each of two forks joined back
        main = torch.cuda.current_stream(dev)
        if i % 48 == 0:
            for s in forks:
                s.wait_stream(main)
        if i % 48 < 40:
            a.add_(1)
        else:
            s = forks[(i % 48 - 40) // 4]
            with torch.cuda.stream(s):
                (b if s is forks[0] else c).add_(1)
            if i % 48 == 47 or i == n - 1:
                for s in forks:
                    main.wait_stream(s)

    ops = {
        "kernel": lambda i: a.add_(1),
        "copy": lambda i: b.copy_(a),
        "mul1": lambda i: torch.mul(a, 1, out=b),
        "mixed": lambda i: b.copy_(a) if i % 14 == 0 else a.add_(1),
        "forked": forked,
    }[kind]

    def body() -> None:
        if first is not None:
            first()
        for i in range(n):
            ops(i)
        if kind == "forked" and (n - 1) % 48 < 40:  # the last group's forks, forked but not yet joined
            main = torch.cuda.current_stream(dev)
            for s in forks:
                main.wait_stream(s)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    g._keep = (a, b, c, forks)  # the graph reads them: keep them alive with it
    return g


def start_us(kind: str, n: int, dev, reps: int) -> tuple[float, float]:
    """(median host replay us, median us from the replay call to the first node's end) for a graph whose
    first node spins ~0.5 ms and then signals through a pinned flag the host polls."""
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    one = torch.ones(1, dtype=torch.int32, device=dev)

    def first() -> None:
        torch.cuda._sleep(1_000_000)  # ~0.5 ms at the H200's clock
        flag.copy_(one, non_blocking=True)  # device -> pinned host: the host sees it land

    g = build(kind, n, dev, first)
    g.replay()
    torch.cuda.synchronize()
    launches, firsts = [], []
    for _ in range(max(10, reps // 10)):
        flag.zero_()
        t = time.perf_counter()
        g.replay()
        launches.append(time.perf_counter() - t)
        while int(flag[0]) == 0:
            pass
        firsts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    launches.sort()
    firsts.sort()
    return launches[len(launches) // 2] * 1e6, firsts[len(firsts) // 2] * 1e6


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="25,100", type=int_list(1), help="nodes a graph, a list: a graph each")
    ap.add_argument("--reps", type=int, default=200, help="timed replays of each graph")
    ap.add_argument("--kinds", default=",".join(KINDS), type=name_list(KINDS),
                    help=f"comma list of {', '.join(KINDS)}")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA device")
    dev = torch.device("cuda")
    for n in args.nodes:
        for kind in args.kinds:
            g = build(kind, n, dev)
            g.replay()
            torch.cuda.synchronize()
            us = launch_us(g, args.reps)
            launch, first = start_us(kind, n, dev, args.reps)
            print(f"{kind:6s} x {n:4d} nodes: replay {us:7.1f} us on the host ({us / n:.2f} us a node); "
                  f"with a 0.5 ms first node: launch {launch:7.1f} us, first node done {first:7.1f} us "
                  f"after the call", flush=True)


if __name__ == "__main__":
    main()
