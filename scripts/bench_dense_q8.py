"""Dense Q8_0 GEMV benchmark (a script, not a test): q8_linear at 1, 4 and 8 tokens against the
device's copy bandwidth, in both forms (the CUDA C kernel of dense_q8_cuda and the Triton one), and the
float32 F.linear they replace; with --forms q4k,q6k also dense_scaled's form of Q4_K / Q6_K matrices (the
same CUDA C kernel with float32 chunk scales, and offsets for Q4_K), which a Q4_K_M file's matrices take.

    PYTHONPATH=. python scripts/bench_dense_q8.py [--tokens 1,4,8] [--shapes 12352x2048,...]
        [--forms cuda,triton,q4k,q6k] [--sweep] [--no-f32]

The default shapes are a decode token's of the 80B-A3B: the GDN's q k v | z | b a, an attention layer's
q | k | v, the out projections, the shared expert's gate | up and down, the LM head.

GB/s counts the weight bytes a call reads (qs + d) once. % copy is against a measured device-to-device
copy (read + write bytes). Each timing is the median over replays of one CUDA graph that holds many
calls (no Python launch gaps), rotating over enough weight copies that L2 cannot hold them.
Target: >= 60% of copy bandwidth at 1 token on the default shapes. --sweep times other tiles at
1 token (gemv_tiles picks by shape alone; the bits of a row depend on the tiles, so a change is a
change of outputs, never of batch invariance).
"""

from __future__ import annotations

import argparse
import statistics

from bandwidth import device_copy_gbs  # a sibling module (scripts/ is sys.path[0] when run)

SHAPES = ["12352x2048", "9216x2048", "2048x4096", "1024x2048", "2048x512", "151936x2048"]  # [N, K]
SWEEP = [(1, 1024, 2), (2, 1024, 4), (4, 512, 4), (4, 1024, 4), (4, 1024, 8), (8, 512, 4), (8, 1024, 8),
         (16, 256, 4), (2, 2048, 4)]  # (BN, BK, warps)
L2_BUST_BYTES = 512 << 20  # weights cycled per graph: >> the H200's 50 MB L2
GRAPH_CALLS = 64
REPLAYS = 21


def graph_seconds(torch, calls) -> float:
    """Median seconds per call: `calls` (a list of thunks) captured in one graph, replayed REPLAYS times."""
    for fn in calls[:4]:  # compile / allocate outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) / 1e3 / len(calls))
    del graph
    return statistics.median(times)


def random_weights(torch, Q8Weight, n: int, k: int, copies: int):
    """`copies` random Q8_0 matrices [n, k] on the GPU (codes in [-127, 127], scales ~1e-2)."""
    out = []
    for _ in range(copies):
        qs = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
        d = (torch.rand(n, k // 32, device="cuda") * 0.02 + 1e-3).half()
        out.append(Q8Weight(qs, d))
    return out


def scaled_weights(torch, n: int, k: int, copies: int, offsets: bool):
    """`copies` random dense_scaled matrices [n, k] on the GPU: Q4_K-like (codes 0..15, offsets) or
    Q6_K-like (codes -32..31)."""
    from strata_ray.kernels.dense_scaled import ScaledWeight

    out = []
    for _ in range(copies):
        lo, hi = (0, 16) if offsets else (-32, 32)
        qs = torch.randint(lo, hi, (n, k), dtype=torch.int8, device="cuda")
        scale = torch.rand(n, k // 16, device="cuda") * 0.02 + 1e-3
        out.append(ScaledWeight(qs, scale, torch.rand(n, k // 16, device="cuda") * 0.1 if offsets else None))
    return out


def bench_scaled(torch, n: int, k: int, tokens: list[int], forms: list[str]) -> list[tuple]:
    from strata_ray.kernels.dense_scaled import scaled_linear

    rows = []
    for form in [f for f in forms if f in ("q4k", "q6k")]:
        per = n * k + 4 * (n * k // 16) * (2 if form == "q4k" else 1)
        copies = max(2, -(-L2_BUST_BYTES // per))
        ws = scaled_weights(torch, n, k, copies, form == "q4k")
        for t in tokens:
            x = torch.randn(t, k, device="cuda")
            calls = [(lambda w=w, x=x: scaled_linear(x, w)) for w in ws] * -(-GRAPH_CALLS // copies)
            sec = graph_seconds(torch, calls)
            rows.append((f"{n}x{k}", t, f"{form} scaled cuda", sec, per / sec / 1e9))
        del ws
    return rows


def bench_shape(torch, F, dq, n: int, k: int, tokens: list[int], forms: list[str], sweep: bool,
                f32: bool, loads_list: list[int]) -> list[tuple]:
    import os

    from strata_ray.kernels import dense_q8_cuda as dqc

    rows = bench_scaled(torch, n, k, tokens, forms)
    forms = [f for f in forms if f in ("cuda", "triton")]
    per = n * k + 2 * n * (k // 32)
    copies = max(2, -(-L2_BUST_BYTES // per))
    ws = random_weights(torch, dq.Q8Weight, n, k, copies) if forms else []
    for t in tokens:
        x = torch.randn(t, k, device="cuda")
        for form in forms:  # STRATA_DENSE_CUDA is read at each call
            os.environ["STRATA_DENSE_CUDA"] = "1" if form == "cuda" else "0"
            for loads in (loads_list if form == "cuda" else [None]):
                if loads is not None:
                    dqc.LOADS_A_GROUP = loads
                calls = [(lambda w=w, x=x: dq.q8_linear(x, w)) for w in ws] * -(-GRAPH_CALLS // copies)
                sec = graph_seconds(torch, calls)
                name = f"q8 cuda loads {loads}" if form == "cuda" else \
                    "q8 triton " + "/".join(map(str, dq.gemv_tiles(n, k)))
                rows.append((f"{n}x{k}", t, name, sec, per / sec / 1e9))
    if sweep and ws:
        x = torch.randn(1, k, device="cuda")
        for tiles in SWEEP:
            out = torch.empty(1, n, device="cuda")
            calls = [(lambda w=w, o=out, tl=tiles: dq.q8_gemv(x, w, out=o, tiles=tl)) for w in ws]
            sec = graph_seconds(torch, calls * -(-GRAPH_CALLS // copies))
            rows.append((f"{n}x{k}", 1, "sweep " + "/".join(map(str, tiles)), sec, per / sec / 1e9))
    del ws
    if not f32:
        return rows
    # the float32 weights this replaces, same shape (fewer copies still bust L2: 4 bytes a weight)
    f32 = [torch.randn(n, k, device="cuda") for _ in range(max(2, -(-L2_BUST_BYTES // (4 * n * k))))]
    for t in tokens:
        x = torch.randn(t, k, device="cuda")
        calls = [(lambda w=w, x=x: F.linear(x, w)) for w in f32] * -(-GRAPH_CALLS // len(f32))
        sec = graph_seconds(torch, calls)
        rows.append((f"{n}x{k}", t, "f32 F.linear", sec, 4 * n * k / sec / 1e9))
    del f32
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,8", help="comma-separated token counts (<= 16: the GEMV)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated NxK weight shapes")
    ap.add_argument("--forms", default="cuda,triton",
                    help="GEMV forms to time: cuda (dense_q8_cuda, needs cupy), triton, q4k and q6k "
                    "(dense_scaled's Q4_K / Q6_K form through the CUDA kernel, needs cupy)")
    ap.add_argument("--loads", default=None,
                    help="the cuda form's 16-byte loads a lane a row group, comma-separated (default: the "
                    "module's LOADS_A_GROUP)")
    ap.add_argument("--sweep", action="store_true", help="also time other Triton tiles at 1 token")
    ap.add_argument("--no-f32", action="store_true", help="leave out the float32 F.linear baseline")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: bench_dense_q8 needs a CUDA device (none found)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("error: bench_dense_q8 needs triton (pip install triton)") from None
    import torch.nn.functional as F

    from strata_ray.kernels import dense_q8 as dq

    torch.backends.cuda.matmul.allow_tf32 = False  # the f32 baseline is the fp32 forward of today
    from strata_ray.kernels.nvrtc import has_cupy

    forms = [f for f in args.forms.split(",") if f]
    if any(f not in ("cuda", "triton", "q4k", "q6k") for f in forms) or not forms:
        raise SystemExit(f"error: --forms {args.forms!r}: a comma-separated list of cuda, triton, q4k, q6k")
    if {"cuda", "q4k", "q6k"} & set(forms) and not has_cupy():
        raise SystemExit("error: the cuda form needs cupy (pip install cupy-cuda12x or cupy-cuda13x)")
    from strata_ray.kernels.dense_q8_cuda import LOADS_A_GROUP

    try:
        loads_list = [int(v) for v in args.loads.split(",")] if args.loads else [LOADS_A_GROUP]
        tokens = [int(v) for v in args.tokens.split(",")]
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    except ValueError:
        raise SystemExit("error: --tokens, --loads: comma-separated integers; --shapes: NxK,...") from None
    if any(len(sh) != 2 or min(sh) <= 0 or sh[1] % 32 for sh in shapes) or min(tokens + loads_list) <= 0:
        raise SystemExit("error: shapes NxK with K a multiple of 32, and positive token and load counts")
    copy = device_copy_gbs("cuda", repeats=20)
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy:.0f} GB/s (read + write)")
    print(f"{'shape':>12} {'T':>3} {'kernel':>20} {'us':>9} {'GB/s':>8} {'% copy':>7}")
    for n, k in shapes:
        for shape, t, name, sec, gbs in bench_shape(torch, F, dq, n, k, tokens, forms, args.sweep,
                                                      not args.no_f32, loads_list):
            print(f"{shape:>12} {t:>3} {name:>20} {sec * 1e6:>9.2f} {gbs:>8.0f} {100 * gbs / copy:>6.1f}%")


if __name__ == "__main__":
    main()
