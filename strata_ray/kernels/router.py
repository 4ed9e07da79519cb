"""The MoE router of a few tokens in two launches: logits, then softmax + top-k + renormalisation.

In torch the router of one decode token is ~12 kernels (a cuBLAS split-K GEMV and its reduce, softmax,
topk's radix and bitonic sorts, gather, sum, divide): ~2 ms a token over the 80b-a3b's 48 layers on the H200
(session 7 trace), for 4 MB of weights a layer. Here:

- `_logits_body`: a float32 GEMV, BN expert rows a program over the whole width in steps of BK
  (`logits_tiles`; a Q8_0 router goes through dense_q8's GEMV instead);
- `_topk_body`: one program a token (one warp up to 1024 experts) holds its X probabilities and picks the k
  largest by k arg-max passes (ties: the lower expert id), then divides them by their sum taken in pick order.

`route_reference` is moe.route's torch form. The two pick the same experts unless two probabilities are
within rounding of each other; their weights agree to rounding. A token's result does not depend on the
other tokens of the call (one program a token, tiles fixed by the shapes).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .lazy_triton import jit_bodies
from .pdl import pdl_args
from .tile_plan import next_pow2

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


def route_reference(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Router logits [N, X] -> (ids [N, K] int64, weights [N, K] float32): softmax, top-k, renormalise."""
    probs = torch.softmax(logits.float(), dim=-1)  # [N, X]
    w, ids = torch.topk(probs, k, dim=-1)
    return ids, w / w.sum(-1, keepdim=True)


def _logits_body(X, W, OUT, N, K, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    # X f32 [T, K], W f32 [N, K], OUT f32 [T, N]. Program: token t (fastest), rows BN, all of K. PDL: the
    # first step's weights load while the kernel before finishes (kernels/pdl.py)
    pid = tl.program_id(0)
    n_tok = tl.num_programs(0) // tl.cdiv(N, BN)
    t = pid % n_tok
    rows = (pid // n_tok) * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    cols = tl.arange(0, BK)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    live = cols < K
    w = tl.load(W + rows_c[:, None] * K + cols[None, :], mask=live[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + t.to(tl.int64) * K + cols, mask=live, other=0.0)
    acc = w * x[None, :]  # the loop's first step (0 + w * x: the same bits, but for an exact zero's sign)
    for k0 in range(BK, K, BK):
        live = k0 + cols < K
        w = tl.load(W + rows_c[:, None] * K + (k0 + cols)[None, :], mask=live[None, :], other=0.0)
        x = tl.load(X + t.to(tl.int64) * K + k0 + cols, mask=live, other=0.0)
        acc += w * x[None, :]
    tl.store(OUT + t.to(tl.int64) * N + rows, tl.sum(acc, axis=1), mask=rows < N)


def _topk_body(LOGITS, IDS, WTS, X, K: tl.constexpr, BX: tl.constexpr, BKP: tl.constexpr, PDL: tl.constexpr):
    # LOGITS f32 [T, X] -> IDS int64 [T, K], WTS f32 [T, K]. One program a token. PDL: it starts early, then
    # waits for the logits (kernels/pdl.py)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BX)
    live = e < X
    lg = tl.load(LOGITS + t * X + e, mask=live, other=float("-inf"))
    p = tl.exp(lg - tl.max(lg, axis=0))
    p = p / tl.sum(p, axis=0)  # softmax; padding lanes 0
    p = tl.where(live, p, -1.0)  # never picked
    slots = tl.arange(0, BKP)
    picked = tl.zeros((BKP,), tl.float32)
    for i in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BX), axis=0)  # the lowest id among equal maxima
        tl.store(IDS + t * K + i, idx.to(tl.int64))
        picked = tl.where(slots == i, best, picked)
        p = tl.where(e == idx, -1.0, p)
    total = 0.0
    for i in tl.static_range(K):  # the sum in pick order (each term is one slot's value, exactly)
        total += tl.sum(tl.where(slots == i, picked, 0.0), axis=0)
    tl.store(WTS + t * K + slots, picked / total, mask=slots < K)


@functools.cache
def _kernels():
    return jit_bodies(_logits_body, _topk_body)


def router_logits(x: Tensor, w: Tensor) -> Tensor:
    """x float32 [T, E] @ w[X, E]^T -> [T, X] (a float32 router matrix), one launch."""
    T, E = x.shape
    n = w.shape[0]
    out = torch.empty((T, n), dtype=torch.float32, device=x.device)
    if T:
        bn, bk = logits_tiles(n, E)
        grid = (T * -(-n // bn),)
        _kernels()[0][grid](x.contiguous(), w.contiguous(), out, n, E, BN=bn, BK=bk, num_warps=4,
                            **pdl_args(out))
    return out


def logits_tiles(n: int, k: int) -> tuple[int, int]:
    """(BN rows, BK columns) of a logits program, from the shape alone (batch invariance). A whole row of up
    to 2048 values in one step, so every load of a program is in flight at once: the 80b-a3b's 512 x 2048
    router is 512 programs of 8 KiB (session 14; BN 4 x BK 512, 128 programs walking 4 steps, took 3.9 us on
    the H200, latency-bound), its 1 x 2048 shared-expert gate one program."""
    return (2 if n >= 4096 else 1), min(2048, max(16, next_pow2(k)))


def check_topk(k: int, X: int, out: tuple[Tensor, Tensor] | None, T: int, who: str) -> None:
    """ValueError (one line, naming `who`) unless 0 < k <= X and `out`, where given, is two contiguous tensors
    of T x k: ids int64 and weights float32 (route_topk's and router_cpu.route_cpu's rule)."""
    if not 0 < k <= X:
        raise ValueError(f"{who}: k={k} of {X} experts")
    if out is not None and (out[0].shape != (T, k) or out[1].shape != (T, k) or out[0].dtype != torch.int64
                            or out[1].dtype != torch.float32
                            or not (out[0].is_contiguous() and out[1].is_contiguous())):
        raise ValueError(f"{who}: out must be contiguous int64 and float32 [{T}, {k}]")


def route_topk(logits: Tensor, k: int, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """route_reference in one launch: logits [T, X] -> (ids [T, K] int64, weights [T, K] float32), into
    `out` (two contiguous tensors of those shapes and types) when given."""
    T, X = logits.shape
    check_topk(k, X, out, T, "route_topk")
    if out is None:
        ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
        wts = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    else:
        ids, wts = out
    if T:
        bx, bkp = next_pow2(X), max(2, next_pow2(k))
        # one warp up to 1024 experts: the k arg-max passes reduce by shuffles alone (4 warps: 2k block-wide
        # reductions through shared memory, 4.6 us a layer for 512 experts on the H200, session 14)
        warps = max(1, min(8, bx // 1024))
        _kernels()[1][(T,)](logits.contiguous(), ids, wts, X, K=k, BX=bx, BKP=bkp, num_warps=warps,
                            **pdl_args(ids))
    return ids, wts
