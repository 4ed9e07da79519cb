"""GQA attention of a few query tokens over the KV cache, without copying the cache (decode, verify).

The reference (ops.attention) repeats each kv head for its H / Hkv query heads (`repeat_interleave`): at 8K
tokens that copies the whole cache of the layer, ~2.2 ms a decode token over the 80b-a3b's 12 attention
layers on the H200 (session 5 trace). Here, split-K "flash decoding" with a fixed split:

- `_attn_partial_body`: one program per (token, kv head, split of SPLIT keys). It scores the kv head's rep
  query heads against its split's keys (one [REP, D] x [D, BK] product a key tile) and keeps an online
  softmax: the split's running max m, sum l and unnormalised output acc [REP, D].
- `_attn_combine_body`: one program per (token, query head), its splits 16 at a time in increasing order:
  o = sum_s acc_s exp(m_s - M) / sum_s l_s exp(m_s - M), M the max of the m_s.

Splits sit at fixed absolute key positions [s SPLIT, (s+1) SPLIT), and a query reads only the keys it
may see (causal: key j <= its position) and combines only its own splits. So a token's output does not
depend on how many tokens share the call (a decode step gives the bits of the same token in a verify
window), and the result is deterministic. Its sums run in other orders than the reference's: the two
agree to rounding.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .lazy_triton import jit_bodies
from .tile_plan import next_pow2

# keys a partial program covers; fixed, because it decides the bits. 256 gave 64 programs at 8K keys
# (2 kv heads), 90 us a call on the H200 (latency-bound, 360 GB/s); 64 gives 256 programs
SPLIT = 64
BK = 32  # keys a program step scores

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


def _attn_partial_body(Q, K, V, M, L, ACC, q_offset, n_keys, scale, H, Hkv, NS,
                  REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, SPLIT_: tl.constexpr,
                  BK_: tl.constexpr):
    # Q f32 [T, H, D]; K, V f32 [S, Hkv, D]; M, L f32 [T, H, NS]; ACC f32 [T, H, NS, D].
    pid = tl.program_id(0)
    t = pid // Hkv
    g = pid % Hkv
    s = tl.program_id(1)
    heads = g * REP + tl.arange(0, REP_P)  # [REP_P] query heads of kv head g (padded rows: masked)
    live_h = tl.arange(0, REP_P) < REP
    d = tl.arange(0, D)
    q = tl.load(Q + (t * H + heads)[:, None].to(tl.int64) * D + d[None, :], mask=live_h[:, None], other=0.0)
    visible = tl.minimum(q_offset + t + 1, n_keys)  # keys 0 .. visible-1 (causal)
    k0 = s * SPLIT_
    m_i = tl.full((REP_P,), float("-inf"), tl.float32)
    l_i = tl.zeros((REP_P,), tl.float32)
    acc = tl.zeros((REP_P, D), tl.float32)
    for kt in range(k0, tl.minimum(k0 + SPLIT_, visible), BK_):  # none when the split is past the query
        j = kt + tl.arange(0, BK_)  # [BK]
        live_k = j < tl.minimum(k0 + SPLIT_, visible)
        kv_off = (j[:, None].to(tl.int64) * Hkv + g) * D + d[None, :]  # [BK, D]
        kb = tl.load(K + kv_off, mask=live_k[:, None], other=0.0)
        vb = tl.load(V + kv_off, mask=live_k[:, None], other=0.0)  # with k: one memory wait a tile
        sc = tl.dot(q, tl.trans(kb), input_precision="ieee") * scale  # [REP_P, BK]
        sc = tl.where(live_k[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))  # finite: every tile has a live key
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision="ieee")
        m_i = m_new
    row = (t * H + heads).to(tl.int64) * NS + s  # [REP_P]
    tl.store(M + row, m_i, mask=live_h)
    tl.store(L + row, l_i, mask=live_h)
    tl.store(ACC + row[:, None] * D + d[None, :], acc, mask=live_h[:, None])


def _attn_combine_body(M, L, ACC, O, q_offset, n_keys, H, NS, D: tl.constexpr, SPLIT_: tl.constexpr,
                       SC: tl.constexpr):
    # One program per (token, query head): its own splits, SC at a time in increasing order, each chunk
    # added lane by lane to [SC] / [SC, D] accumulators reduced once at the end; splits past the query's
    # keys are masked to exact zeros, so a decode step and a verify window give the same bits.
    pid = tl.program_id(0)
    t = pid // H
    visible = tl.minimum(q_offset + t + 1, n_keys)
    n_split = (visible + SPLIT_ - 1) // SPLIT_
    base = pid.to(tl.int64) * NS
    d = tl.arange(0, D)
    sc = tl.arange(0, SC)
    m_lane = tl.full((SC,), float("-inf"), tl.float32)
    for s0 in range(0, n_split, SC):
        m_lane = tl.maximum(m_lane, tl.load(M + base + s0 + sc, mask=s0 + sc < n_split, other=float("-inf")))
    m = tl.max(m_lane, axis=0)
    l_lane = tl.zeros((SC,), tl.float32)
    o_lane = tl.zeros((SC, D), tl.float32)
    for s0 in range(0, n_split, SC):
        live = s0 + sc < n_split
        w = tl.exp(tl.load(M + base + s0 + sc, mask=live, other=float("-inf")) - m)  # [SC], 0 past the end
        l_lane += tl.load(L + base + s0 + sc, mask=live, other=0.0) * w
        o_lane += tl.load(ACC + (base + s0 + sc)[:, None] * D + d[None, :], mask=live[:, None], other=0.0) \
            * w[:, None]
    tl.store(O + pid.to(tl.int64) * D + d, tl.sum(o_lane, axis=0) / tl.sum(l_lane, axis=0))


@functools.cache
def _kernels():
    # the runtime sizes unspecialized: a new cache length never compiles a new binary
    return jit_bodies(_attn_partial_body, _attn_combine_body, do_not_specialize=["q_offset", "n_keys", "NS"])


def attention_decode_supports(q: Tensor, k: Tensor) -> bool:
    """Shapes the kernels take: query heads a multiple of kv heads, head size a power of two >= 16."""
    D = q.shape[-1]
    return q.shape[1] % k.shape[1] == 0 and D >= 16 and D & (D - 1) == 0


def attention_decode(q: Tensor, k: Tensor, v: Tensor, q_offset: int, scale: float) -> Tensor:
    """ops.attention for a few queries: q [T, H, D] at positions q_offset.., k, v [S, Hkv, D] (S >= q_offset
    + T: the cache including these tokens) -> [T, H, D] float32."""
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        raise ValueError(f"attention_decode needs float32 q, k, v, got {q.dtype} {k.dtype} {v.dtype}")
    if not attention_decode_supports(q, k) or S < q_offset + T or v.shape != k.shape:
        raise ValueError(f"attention_decode: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} at "
                         f"offset {q_offset} (H a multiple of Hkv, D a power of two >= 16, S >= offset + T)")
    out = torch.empty((T, H, D), dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    rep = H // Hkv
    ns = -(-S // SPLIT)
    m = torch.empty((T, H, ns), dtype=torch.float32, device=q.device)
    ell = torch.empty_like(m)
    acc = torch.empty((T, H, ns, D), dtype=torch.float32, device=q.device)
    partial, combine = _kernels()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    partial[(T * Hkv, ns)](q, k, v, m, ell, acc, q_offset, S, scale, H, Hkv, ns, REP=rep,
                           REP_P=max(16, next_pow2(rep)), D=D, SPLIT_=SPLIT, BK_=BK, num_warps=8)
    combine[(T * H,)](m, ell, acc, out, q_offset, S, H, ns, D=D, SPLIT_=SPLIT, SC=16, num_warps=4)
    return out
