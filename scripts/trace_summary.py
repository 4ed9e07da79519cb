"""Where a traced decode's device time goes: busy time, idle gaps and kernels by name, from a Chrome trace.

    python scripts/trace_summary.py out/decode-trace-80.json --tokens 3 [--timeline 2]

torch.profiler's tables add up kernel times; they do not say how long the device sat idle between kernels
(launch latency inside graphs, host waits, flag round trips). This reads the trace's device events
(kernels, copies, memsets), merges them into busy intervals over all streams, and prints the span, the busy
time, the gaps by size, and the kernels by total time, each per token. --timeline N then lists N layers
of the middle token event by event (start, length, stream, gap before): what one layer waits on.
--by-layer NAME lists an op's length by layer (e.g. the flag wait, `_wait_body`: which layers wait).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_EDGES_US = (2, 5, 10, 20, 50, 100, 1000)


LAYER_MARK = "_combine_body"  # the fused combine opens every decode layer's first graph (and the head's)


def device_events(path: str, with_stream: bool = False) -> list[tuple]:
    """(start us, end us, name) of every device event in the trace, by start; with_stream: (start, end,
    name, stream)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    out = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"], *((e.get("tid"),) if with_stream else ()))
           for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"]
    return sorted(out)


def timeline(events: list[tuple], layers: int) -> str:
    """Event by event, `layers` layers from the middle of the trace (a layer opens at LAYER_MARK): start
    offset, length and the idle gap before each (all streams merged), the stream, the name."""
    marks = [i for i, e in enumerate(events) if e[2] == LAYER_MARK]
    if len(marks) < layers + 1:
        return f"timeline: fewer than {layers + 1} '{LAYER_MARK}' events in the trace"
    first = len(marks) // 2
    lo, hi = marks[first], marks[min(first + layers, len(marks) - 1)]
    t0, end = events[lo][0], events[lo][0]
    lines = [f"timeline of {layers} layers from event {lo} (us: start, length, idle before, stream, op):"]
    for start, stop, name, stream in events[lo:hi]:
        idle = max(0.0, start - end)
        lines.append(f"  {start - t0:9.1f} {stop - start:8.1f} {idle:7.1f}{' *' if idle >= 5 else '  '} "
                     f"{stream!s:>6} {name[:70]}")
        end = max(end, stop)
    lines.append(f"  {events[hi][0] - t0:9.1f}  (the next layer opens)")
    return "\n".join(lines)


def by_layer(events: list[tuple], name: str, tokens: int) -> str:
    """The events named `name` (one a layer a token, as the flag wait's), by their place within a token: the
    layer's mean length over the tokens, the spread over layers, and the longest layers."""
    durs = [stop - start for start, stop, n, *_ in events if n == name]
    if not durs or len(durs) % tokens:
        return f"by layer: {len(durs)} '{name}' events do not split evenly over {tokens} tokens"
    n = len(durs) // tokens
    means = [sum(durs[t * n + i] for t in range(tokens)) / tokens for i in range(n)]
    ranked = sorted(means)
    lines = [f"'{name}' by layer ({n} a token; us, the mean over {tokens} tokens): min {ranked[0]:.1f}, "
             f"median {ranked[n // 2]:.1f}, max {ranked[-1]:.1f}, sum {sum(means) / 1e3:.2f} ms a token"]
    top = sorted(range(n), key=lambda i: -means[i])[:8]
    lines.append("  longest: " + ", ".join(f"#{i} {means[i]:.1f}" for i in top))
    lines.append("  all: " + " ".join(f"{m:.0f}" for m in means))
    return "\n".join(lines)


def busy_intervals(events: list[tuple[float, float, str]]) -> list[tuple[float, float]]:
    """The union of the events' intervals over all streams."""
    merged: list[list[float]] = []
    for start, end, _ in events:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def summarize(events: list[tuple[float, float, str]], tokens: int, top: int) -> str:
    if not events:
        return "no device events in the trace"
    busy = busy_intervals(events)
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(b - a for a, b in busy)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:], strict=False)]
    lines = [f"{len(events)} device events over {span / 1e3:.2f} ms: busy {busy_us / 1e3:.2f} ms "
             f"({busy_us / span:.0%}), idle {(span - busy_us) / 1e3:.2f} ms; per token ({tokens}): "
             f"span {span / tokens / 1e3:.2f} ms, busy {busy_us / tokens / 1e3:.2f} ms, "
             f"{len(events) / tokens:.0f} events"]
    lines.append("idle gaps by size (count, total ms per token):")
    lo = 0.0
    for hi in (*GAP_EDGES_US, float("inf")):
        sel = [g for g in gaps if lo <= g < hi]
        if sel:
            per_token_ms = sum(sel) / tokens / 1e3
            lines.append(f"  {lo:>6g}-{hi:<6g} us: {len(sel) / tokens:7.0f}  {per_token_ms:7.2f} ms")
        lo = hi
    by_name: dict[str, list[float]] = defaultdict(list)
    for start, end, name in events:
        by_name[name].append(end - start)
    lines.append(f"top {top} device ops by total time per token (count, total ms, mean us):")
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, durs in ranked:
        lines.append(f"  {len(durs) / tokens:6.0f}  {sum(durs) / tokens / 1e3:7.3f} ms  "
                     f"{sum(durs) / len(durs):8.1f} us  {name[:90]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a Chrome trace from torch.profiler (bench_tiers --trace-out)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens the trace covers (per-token figures)")
    ap.add_argument("--top", type=int, default=30, help="how many ops to list")
    ap.add_argument("--timeline", type=int, default=0, metavar="N",
                    help="then list N layers of the middle of the trace event by event")
    ap.add_argument("--by-layer", default="", metavar="NAME",
                    help="then each layer's mean length of the op NAME (one a layer a token: _wait_body)")
    args = ap.parse_args()
    if args.tokens < 1 or args.timeline < 0:
        ap.error("--tokens must be at least 1 and --timeline at least 0")
    events = device_events(args.trace, with_stream=True)
    print(summarize([e[:3] for e in events], args.tokens, args.top))
    if args.timeline:
        print(timeline(events, args.timeline))
    if args.by_layer:
        print(by_layer(events, args.by_layer, args.tokens))


if __name__ == "__main__":
    main()
