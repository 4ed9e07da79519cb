"""The MoE router of a decode or verify window on the CPU in one numba call: the CPU twin of kernels/router.

A small model's router is dispatch: for the embedded strata-tiny-next (16 experts of 128 values, top-2)
torch's F.linear, softmax, topk, sum and divide cost ~25 us a layer on the 2-core VM, for 2K multiply-adds.
Here:

- `_route_rows`: each expert's logit as a float32 dot of 8 lanes (lane j sums the values j, j + 8, ... in
  order) added in a fixed tree (fused_small_cpu.dot_lanes, as kernels/attention_decode_cpu's scores), for
  matrices of at most SMALL_ROUTER values; larger ones (a 512 x 2048 router) take F.linear's logits, which a
  numba GEMV does not beat (session 48: 2-3x slower), and `_pick_rows` alone;
- `_pick_rows`: softmax (the max subtracted, exp in float32, the sum in float64 in index order), then the
  k largest by k arg-max passes (ties: the lower expert id, as the CUDA kernel), divided by their sum taken
  in pick order.

`router.route_reference` is the twin. The two pick the same experts unless two probabilities are within
rounding of each other; their weights agree to rounding. In the numba dot's form a token's result does
not depend on the other tokens of the call; F.linear's logits may (a one-row product is another BLAS call).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from .fused_small import fused_call, needs_grad
from .fused_small_cpu import as_array, dot_lanes
from .router import check_topk

# experts x width up to which the logits are the numba dot's (F.linear's past it). On the 2-core VM a whole
# route of one token: 16 x 128 11.8 us (F.linear + the picks 16.1), 64 x 512 24.4 (24.3), 64 x 1024 34.1
# (25.1), 128 x 2048 102 (43.4); torch's form 22-25 us at 16 x 128
SMALL_ROUTER = 1 << 14


@numba.njit(nogil=True, inline="always")
def _pick(lg, k, ids, wts, p):
    """One token's logits lg f32 [X] -> ids int64 [k], wts f32 [k]; p f32 [X] scratch."""
    X = lg.shape[0]
    m = lg[0]
    for e in range(1, X):
        m = max(m, lg[e])
    s = 0.0  # float64, in index order
    for e in range(X):
        p[e] = np.exp(lg[e] - m)
        s += p[e]
    inv = np.float32(s)
    for e in range(X):
        p[e] = p[e] / inv
    total = np.float32(0.0)
    for i in range(k):
        best = 0
        for e in range(1, X):
            # strictly: the lower id keeps a tie; a NaN (a NaN or infinite logit) counts as the largest, as
            # torch.topk's, so that k distinct experts are picked whatever the logits
            a, b = p[e], p[best]
            if a > b or (a != a and b == b):
                best = e
        ids[i] = best
        wts[i] = p[best]
        total += p[best]
        p[best] = -1.0  # never picked again
    for i in range(k):
        wts[i] = wts[i] / total


@numba.njit(nogil=True, cache=True)
def _pick_rows(logits, k, ids, wts):
    """logits f32 [T, X] -> ids int64 [T, k], wts f32 [T, k]."""
    p = np.empty(logits.shape[1], np.float32)
    for t in range(logits.shape[0]):
        _pick(logits[t], k, ids[t], wts[t], p)


@numba.njit(nogil=True, cache=True)
def _route_rows(x, w, k, ids, wts):
    """x f32 [T, E], router w f32 [X, E] -> ids int64 [T, k], wts f32 [T, k]."""
    X = w.shape[0]
    lg = np.empty(X, np.float32)
    p = np.empty(X, np.float32)
    for t in range(x.shape[0]):
        for e in range(X):
            lg[e] = dot_lanes(x[t], w[e])
        _pick(lg, k, ids[t], wts[t], p)


def route_cpu_serves(x: Tensor, router_w, n_tokens: int) -> bool:
    """Whether moe.route of x [N, E] takes this module: a fused_small.fused_call (decode or verify window) on
    float32 CPU tensors, the router a float32 [X, E] matrix that autograd does not track."""
    return (x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and isinstance(router_w, Tensor)
            and router_w.dtype == torch.float32 and router_w.dim() == 2 and router_w.shape[1] == x.shape[-1]
            and not needs_grad(router_w) and fused_call(x, n_tokens))


def route_cpu(x: Tensor, router_w: Tensor, k: int,
              out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """moe.route on float32 CPU tensors: x [N, E], router_w [X, E] -> (ids [N, K] int64, weights [N, K]
    float32), into `out` (two contiguous tensors of those shapes and types) when given."""
    N = x.shape[0]
    check_topk(k, router_w.shape[0], out, N, "route_cpu")
    if out is None:
        ids_a, wts_a = np.empty((N, k), np.int64), np.empty((N, k), np.float32)
        out = torch.from_numpy(ids_a), torch.from_numpy(wts_a)
    else:
        ids_a, wts_a = out[0].numpy(), out[1].numpy()
    if N:
        if router_w.numel() <= SMALL_ROUTER:
            _route_rows(as_array(x), as_array(router_w), k, ids_a, wts_a)
        else:
            logits = torch.nn.functional.linear(x, router_w)  # [N, X]
            _pick_rows(logits.numpy(), k, ids_a, wts_a)
    return out


def warm_up() -> None:
    """Compile both forms (or load numba's cache of them) now, not at the first decode step."""
    route_cpu(torch.zeros(1, 4), torch.zeros(2, 4), 1)
    route_cpu(torch.zeros(1, 16), torch.zeros(SMALL_ROUTER // 16 + 1, 16), 1)
