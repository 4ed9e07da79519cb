"""A CPU decode step's small numba calls against their torch twins (a script, not a test): us a call.

    python scripts/bench_cpu_decode_ops.py [--embd 128] [--heads 4,2,32] [--n-rot 16] [--ff 512]
        [--keys 64,512,2048] [--experts 16] [--top-k 2] [--expert-ff 128] [--reps 2000]

Times, on one torch thread (as the decode runs on a small host), each of kernels/fused_small_cpu's calls and
kernels/attention_decode_cpu's one-query core beside the torch form it replaces, at one token: the RMSNorm of
an [1, embd] row, the residual add and norm, the shared expert's activation ([1, ff]), the attention's q / k
head norms and rope, the attention core over each key count, the MoE router ([experts, embd], top-k; its
numba dots up to router_cpu.SMALL_ROUTER values, F.linear's logits past it) and the combine of the k expert
rows (against the numpy form it replaced), and a token's Q8_0 experts with that combine in one call
(kernels/token_moe_cpu.TokenMoe, against expert_ffn_cpu_token then combine_rows; where --embd is a
multiple of 32). The defaults are the embedded model's shapes. A line a call: the torch form's median,
the numba form's median, their ratio, and whether the numba form is within the bound its dispatch applies
(the attention's ONE_QUERY_MAX_WORK, the router's SMALL_ROUTER for its dots).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from strata_ray.config import int_list
from strata_ray.kernels import attention_decode_cpu as attn_cpu
from strata_ray.kernels import fused_small_cpu as small_cpu
from strata_ray.kernels import router_cpu
from strata_ray.kernels.contract import Q8_0
from strata_ray.kernels.expert_cpu import expert_ffn_cpu_token, token_layer
from strata_ray.kernels.fused_small import shared_act_reference
from strata_ray.kernels.norm_rope import norm_rope_reference
from strata_ray.kernels.random_weights import random_layer
from strata_ray.kernels.router import route_reference
from strata_ray.kernels.token_moe_cpu import TokenMoe
from strata_ray.model import moe, ops


def median_us(fn: Callable[[], object], reps: int) -> float:
    """The median of 5 rounds of `reps` calls each, in microseconds a call (after a warm-up call)."""
    fn()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        rounds.append((time.perf_counter() - t) / reps * 1e6)
    return statistics.median(rounds)


def cases(args) -> list[tuple[str, Callable[[], object], Callable[[], object], bool]]:
    """(name, torch form, numba form, whether the dispatch takes the numba form there)."""
    g = torch.Generator().manual_seed(0)
    E, (H, Hkv, D), F = args.embd, args.heads, args.ff
    x, d, w = torch.randn(1, E, generator=g), torch.randn(1, E, generator=g), torch.randn(E, generator=g)
    gu, w_gate = torch.randn(1, 2 * F, generator=g), torch.randn(E, generator=g)
    qg = torch.randn(1, H, 2 * D, generator=g)
    k_new = torch.randn(1, Hkv, D, generator=g)
    wq, wk = torch.randn(D, generator=g), torch.randn(D, generator=g)
    cos, sin = ops.rope_tables(torch.tensor([100]), args.n_rot, 1e7)
    out = [
        ("rms_norm", lambda: ops.rms_norm_reference(x, w, 1e-6), lambda: small_cpu.rms_norm_cpu(x, w, 1e-6),
         True),
        ("add + rms_norm", lambda: (x + d, ops.rms_norm_reference(x + d, w, 1e-6)),
         lambda: small_cpu.add_rms_norm_cpu(x, d, w, 1e-6), True),
        ("shared activation", lambda: shared_act_reference(gu[:, :F], gu[:, F:], x, w_gate),
         lambda: small_cpu.shared_act_cpu(gu[:, :F], gu[:, F:], x, w_gate), True),
        ("q / k norm + rope", lambda: norm_rope_reference(qg, k_new, wq, wk, 1e-6, cos, sin),
         lambda: small_cpu.norm_rope_cpu(qg, k_new, wq, wk, 1e-6, cos, sin), True),
    ]
    q = torch.randn(1, H, D, generator=g)
    for S in args.keys:
        k, v = torch.randn(2, S, Hkv, D, generator=g)
        out.append((f"attention, {S} keys", lambda k=k, v=v: ops.attention_one_query(q, k, v, D**-0.5),
                    lambda k=k, v=v: attn_cpu.one_query_cpu(q, k, v, D**-0.5),
                    attn_cpu.one_query_cpu_serves(q, k, v)))
    X, K = args.experts, args.top_k
    router_w = torch.randn(X, E, generator=g)
    out.append((f"router {X} x {E}, top-{K}", lambda: route_reference(ops.linear(x, router_w), K),
                lambda: router_cpu.route_cpu(x, router_w, K), router_w.numel() <= router_cpu.SMALL_ROUTER))
    rows, wts = torch.randn(1, K, E, generator=g), torch.rand(1, K, generator=g)
    out.append((f"combine of {K} rows", lambda: moe.combine_rows_numpy(rows, wts),
                lambda: small_cpu.combine_rows_cpu(rows, wts), True))
    if E % 32:  # Q8_0 experts hold 32-value blocks: their line needs --embd a multiple of 32
        return out
    tl = token_layer(random_layer(np.random.default_rng(0), X, E, args.expert_ff, (Q8_0,) * 3))
    x_h, ids_h, wts_h = x.numpy(), np.arange(K, dtype=np.int64), wts.numpy()
    token_moe = TokenMoe(tl)

    def rows_then_combine():
        rows_h = torch.from_numpy(expert_ffn_cpu_token(x_h, ids_h, tl))[None]  # [1, K, E]
        return small_cpu.combine_rows_cpu(rows_h, wts)

    out.append((f"{K} experts + combine", rows_then_combine,
                lambda: token_moe(x_h, ids_h, wts_h), True))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--embd", type=int, default=128, help="model width (the norms' rows); default 128")
    ap.add_argument("--heads", type=int_list(1), default=(4, 2, 32),
                    help="query heads, kv heads, head size; default 4,2,32")
    ap.add_argument("--n-rot", type=int, default=16, help="rotated values a head; default 16")
    ap.add_argument("--ff", type=int, default=512, help="the shared expert's hidden width; default 512")
    ap.add_argument("--keys", type=int_list(1), default=(64, 512, 2048),
                    help="key counts of the attention core; default 64,512,2048")
    ap.add_argument("--experts", type=int, default=16, help="the router's experts; default 16")
    ap.add_argument("--top-k", type=int, default=2, help="experts a token (router and combine); default 2")
    ap.add_argument("--expert-ff", type=int, default=128,
                    help="the routed experts' hidden width (a multiple of 32); default 128")
    ap.add_argument("--reps", type=int, default=2000, help="calls a timing round (5 rounds); default 2000")
    args = ap.parse_args(argv)
    if len(args.heads) != 3 or args.heads[0] % args.heads[1]:
        ap.error("--heads: three counts, query heads a multiple of kv heads")
    if args.n_rot % 2 or not 0 < args.n_rot <= args.heads[2]:
        ap.error("--n-rot: an even count of at most the head size")
    if not 1 <= args.top_k <= args.experts:
        ap.error("--top-k: at least 1 and at most --experts")
    if args.expert_ff < 32 or args.expert_ff % 32:
        ap.error("--expert-ff: a multiple of 32 (the Q8_0 experts' blocks)")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    torch.set_num_threads(1)
    print(f"{'call':<24} {'torch us':>9} {'numba us':>9} {'ratio':>6}  taken")
    with torch.inference_mode():
        for name, reference, fast, taken in cases(args):
            ref_us, fast_us = median_us(reference, args.reps), median_us(fast, args.reps)
            ratio, word = ref_us / fast_us, "yes" if taken else "no"
            print(f"{name:<24} {ref_us:9.1f} {fast_us:9.1f} {ratio:6.2f}  {word}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
