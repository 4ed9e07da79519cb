"""One query's attention over the KV cache as one numba call: the CPU form of a decode token's attention core.

`ops.attention_one_query` is a one-token attention in torch ops: per group of query heads that share a kv
head, a batched product, a scale, a softmax and a second product, then a stack (~15 ops for 4 heads over 2
kv heads). On the 2-core VM each op costs a few microseconds of dispatch whatever its size, so at the embedded
strata-tiny-next's shapes (4 heads of 32, 2 kv heads) the core was mostly dispatch. Here every head runs in
one compiled call:

- the scores q . k: each key's dot in float32 as 8 lanes (lane j sums the head dimension's values j, j + 8,
  ... in order) added in a fixed tree, so the compiler packs the lanes into one vector without reordering
  any sum (a dot in index order does not vectorize, and one across keys reads them strided: 3-7x slower);
  then the scale, as the reference scales the product;
- the softmax: max-subtracted exponentials, their sum in float64 in key order;
- p . v: the keys outer and the head dimension inner (vectorized across it), each output's sum in key order.

The sums run in another order than torch's, so the bits differ at rounding level; the result does not depend
on anything but this query and the cache (batch invariant). `ops.attention_one_query` is the twin.
Contexts where the torch form's batched products are faster take it: ONE_QUERY_MAX_WORK.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from .fused_small import fused_call, needs_grad
from .fused_small_cpu import as_array, dot_lanes

# H * S * D (query heads x keys x head size) up to which the numba call runs. Measured on the 2-core VM
# (scripts/bench_cpu_decode_ops.py, BENCHMARKS "Session 48"): 4 heads of 32 over 2 kv heads, 1.1-1.8x the
# torch form's speed at 512-1024 keys and 0.8x at 2048; 32 heads of 128 over 4, 3.4x at 64 keys and 0.6x at
# 1024. Past the bound, the torch form's batched products (and their vectorized exp) win.
ONE_QUERY_MAX_WORK = 1 << 17


@numba.njit(nogil=True, cache=True)
def _one_query(q, keys, values, scale, out):
    """q f32 [H, D], keys / values f32 [S, Hkv, D] (S >= 1) -> out f32 [H, D]; query head h reads kv head
    h // (H / Hkv)."""
    H, D = q.shape
    S, Hkv = keys.shape[0], keys.shape[1]
    rep = H // Hkv
    scores = np.empty(S, np.float32)
    acc = np.empty(D, np.float32)
    for h in range(H):
        g = h // rep
        for s in range(S):  # each score's sum as 8 lanes (lane j: d = j mod 8, in order), added in a tree
            scores[s] = dot_lanes(q[h], keys[s, g])
        top = np.float32(-np.inf)
        for s in range(S):
            scores[s] *= np.float32(scale)
            top = max(top, scores[s])
        total = 0.0  # float64, key order
        for s in range(S):
            scores[s] = np.exp(scores[s] - top)
            total += scores[s]
        inv = np.float32(1.0 / total)
        for d in range(D):
            acc[d] = 0.0
        for s in range(S):  # the head dimension inner: each output's sum in key order
            p = scores[s] * inv
            for d in range(D):
                acc[d] += p * values[s, g, d]
        for d in range(D):
            out[h, d] = acc[d]


def one_query_cpu_serves(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether one query q [1, H, D] that sees every key of k, v [S, Hkv, D] takes _one_query: a
    fused_small.fused_call on float32 CPU tensors (none tracked by autograd), H a multiple of Hkv, at most
    ONE_QUERY_MAX_WORK."""
    H, D = q.shape[1], q.shape[2]
    S, Hkv = k.shape[0], k.shape[1]
    return (q.is_cpu and q.dtype == k.dtype == v.dtype == torch.float32 and S > 0 and H % Hkv == 0
            and H * S * D <= ONE_QUERY_MAX_WORK and fused_call(q, 1) and not needs_grad(k, v))


def one_query_cpu(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """ops.attention_one_query on float32 CPU tensors: q [1, H, D], k, v [S, Hkv, D] -> [1, H, D]."""
    _, H, D = q.shape
    if k.shape != v.shape or k.dim() != 3 or k.shape[2] != D or k.shape[0] == 0 or H % k.shape[1]:
        raise ValueError(f"one_query_cpu: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    out = np.empty((1, H, D), np.float32)
    _one_query(as_array(q).reshape(H, D), as_array(k), as_array(v), scale, out.reshape(H, D))
    return torch.from_numpy(out)


def warm_up() -> None:
    """Compile the kernel (or load numba's cache of it) now, not at the first decode step."""
    kv = torch.zeros(2, 1, 8)
    one_query_cpu(torch.zeros(1, 2, 8), kv, kv, 1.0)
