"""Decode attention over the KV cache on the GPU (a script, not a test): attention_decode as the eager
forward calls it, DeviceAttention as the decode graphs replay it, and the norm + rope launch before it.

    python scripts/bench_attention.py [--keys 1024,8192,32768] [--heads 16,2,256] [--reps 200]
        [--tiles 64x32x8x1x256,32x16x4x2x64 | --tiles sweep] [--graph-only]

Per call: device time from CUDA events over `reps` calls (attention_decode launched from Python, so its
host launch cost shows when it exceeds the kernels'; DeviceAttention replayed from one CUDA graph), GB/s
of K and V bytes read against the card's copy bandwidth, and whether the two give the same bits; once per
key tiling (STRATA_ATTN_TILES: SPLITxBKxWARPSxSTAGESxDC; `sweep`: SWEEP's grid).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
from bandwidth import device_copy_gbs  # a sibling module (scripts/ is sys.path[0] when run)

from strata_ray.config import int_list
from strata_ray.kernels.attention_decode import (
    BEFORE_39,
    TILES,
    AttnTiles,
    DeviceAttention,
    attention_decode,
    attn_tiles_value,
    tiles_now,
)
from strata_ray.kernels.norm_rope import norm_rope_fused
from strata_ray.model import ops

# --tiles sweep: the form before session 39 with a head's values combined 256 (whole), 128, 64 and 32 a
# program, then splits of 32 to 128 keys, steps of 16 to 64 keys, 4 or 8 warps, 1 to 3 stages, combined 64 a
# program (each form once)
SWEEP = list(dict.fromkeys([BEFORE_39._replace(dc=dc) for dc in (256, 128, 64, 32)] + [
    AttnTiles(sp, bk, w, st, 64)
    for sp, bk, w, st in itertools.product((32, 64, 128), (16, 32, 64), (4, 8), (1, 2, 3)) if bk <= sp]))


def tiles_list(raw: str) -> list[AttnTiles]:
    """--tiles: `sweep`, or tilings joined by commas (argparse's one line for a bad one)."""
    if raw == "sweep":
        return SWEEP
    out = []
    for t in raw.split(","):
        try:
            out.append(attn_tiles_value(t))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{t!r}: each tiling {e}") from None
    return out


def _timed(fn, reps: int) -> float:
    """Seconds a call, from CUDA events around `reps` calls after a warm-up."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _graphed(fn):
    """fn captured once into a CUDA graph; returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _one(n: int, H: int, Hkv: int, D: int, scale: float, tiles: AttnTiles, copy_gbs: float, reps: int,
         graph_only: bool) -> None:
    """One table row: `n` keys under `tiles`."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(n)
    q = torch.randn(1, H, D, device=dev, generator=g)
    caches = torch.randn(2, n + 64, Hkv, D, device=dev, generator=g)  # room past the keys, as a cache has
    k, v = caches[0, :n], caches[1, :n]
    attn = DeviceAttention(H, Hkv, D, max(n, 1 << 15), dev)
    table = torch.tensor(attn.table_row(caches[0], caches[1]), dtype=torch.int64, device=dev)
    pos = torch.tensor([n - 1], dtype=torch.int64, device=dev)
    replay = _graphed(lambda: attn(q, table, pos, scale))
    t_graph = _timed(replay, reps)
    if graph_only:
        eager, same = "", ""
    else:
        ref = attention_decode(q, k, v, n - 1, scale)
        eager = f"{_timed(lambda: attention_decode(q, k, v, n - 1, scale), reps) * 1e6:.1f} us"
        same = str(torch.equal(attn(q, table, pos, scale), ref))
    gbs = 2 * n * Hkv * D * 4 / t_graph / 1e9
    share = gbs / copy_gbs  # as the kernels bench counts it: bytes read / the copy rate
    print(f"| {tiles} | {n} | {eager} | {t_graph * 1e6:.1f} us | {gbs:.0f} ({share:.0%}) | {same} |",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="1024,8192,32768", type=int_list(2),
                    help="cache lengths (keys, the new one included)")
    ap.add_argument("--heads", default="16,2,256", type=int_list(1),
                    help="query heads, kv heads, head size (the 80b-a3b's)")
    ap.add_argument("--n-rot", type=int, default=64, help="rotated values a head (norm + rope row)")
    ap.add_argument("--reps", type=int, default=200, help="timed calls of each form (after a warm-up)")
    ap.add_argument("--tiles", type=tiles_list, default=None,
                    help=f"key tilings SPLITxBKxWARPSxSTAGESxDC joined by commas, or `sweep` ({len(SWEEP)} "
                         f"of them; default: STRATA_ATTN_TILES, else {TILES})")
    ap.add_argument("--graph-only", action="store_true",
                    help="time only the graphs' form (a sweep: half the compiles and calls)")
    args = ap.parse_args(argv)
    if len(args.heads) != 3:
        ap.error(f"--heads: three integers (query heads, kv heads, head size), got {len(args.heads)}")
    if not torch.cuda.is_available():
        print("error: bench_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    H, Hkv, D = args.heads
    dev = torch.device("cuda")
    copy_gbs = device_copy_gbs(dev, 256 << 20, repeats=20)  # read + write
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write)")
    print("| tiles | keys | attention_decode (eager) | DeviceAttention (graph) | GB/s of K+V (graph) "
          "| same bits |")
    print("|---|---:|---:|---:|---:|---|")
    scale = D**-0.5
    for tiles in args.tiles or [tiles_now()]:
        os.environ["STRATA_ATTN_TILES"] = str(tiles)  # read by each launch and each DeviceAttention
        for n in args.keys:
            try:
                _one(n, H, Hkv, D, scale, tiles, copy_gbs, args.reps, args.graph_only)
            except Exception as e:  # a tiling past the SM's shared memory: say so, go on with the next
                if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e):
                    raise
                print(f"| {tiles} | {n} | | does not fit: {str(e).splitlines()[0][:80]} | | |", flush=True)
                break
    # q / k norms + rope (+ gate) for one token, graphed: the launch that replaced ~16 small ops
    T = 1
    qg = torch.randn(T, H, 2 * D, device=dev)
    kk = torch.randn(T, Hkv, D, device=dev)
    w = torch.ones(D, device=dev)
    cos, sin = ops.rope_tables(torch.tensor([5000], device=dev), args.n_rot, 1e7)
    t_nr = _timed(_graphed(lambda: norm_rope_fused(qg, kk, w, w, 1e-6, cos, sin)), args.reps)
    print(f"norm + rope + gate, 1 token, graphed: {t_nr * 1e6:.1f} us a layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
