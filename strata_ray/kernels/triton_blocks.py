"""Triton device functions of the arithmetic contract (see contract.py): fp16 decoding, rint,
the fixed exp, SwiGLU, activation block quantization and one weight block's contribution for each
weight type. Imported only where triton is installed (expert_gpu.py imports it lazily).

Every kernel that uses these must be launched with enable_fp_fusion=False (no FMA contraction).
Divisions use tl.math.div_rn (the plain `/` is an approximate division on NVIDIA GPUs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import contract as c

TINY = tl.constexpr(float(c.TINY))
RINT_MAGIC = tl.constexpr(float(c.RINT_MAGIC))
Q_MAX = tl.constexpr(float(c.Q_MAX))
F32_MAX = tl.constexpr(3.4028234663852886e38)  # the largest finite float32: |x| <= it is "finite"
NAN_BITS = tl.constexpr(0x7FC00000)  # a quiet NaN's bits (a poisoned block's scale)
EXP_LO = tl.constexpr(float(c.EXP_LO))
EXP_HI = tl.constexpr(float(c.EXP_HI))
LOG2E = tl.constexpr(float(c.LOG2E))
LN2_HI = tl.constexpr(float(c.LN2_HI))
LN2_LO = tl.constexpr(float(c.LN2_LO))
P0, P1, P2, P3, P4, P5, P6 = (tl.constexpr(float(p)) for p in c.EXP_POLY)
T_Q8_0 = tl.constexpr(c.Q8_0)
T_Q4_0 = tl.constexpr(c.Q4_0)
T_Q4_K = tl.constexpr(c.Q4_K)
T_Q6_K = tl.constexpr(c.Q6_K)


@triton.jit
def row_offsets(pid_r, slot0, stride1, stride2, RB1, RB2, BR: tl.constexpr):
    """Row tile pid_r of slot slot0: (rows [BR], byte offsets [BR] of those rows in W1 and in W2), the
    expert tiles' common prologue (R % BR == 0)."""
    rows = pid_r * BR + tl.arange(0, BR)
    slot = slot0.to(tl.int64)
    return rows, slot * stride1 + rows.to(tl.int64) * RB1, slot * stride2 + rows.to(tl.int64) * RB2


@triton.jit
def f16_at(p):
    """IEEE half stored little-endian at byte pointer(s) p -> f32 (exact)."""
    bits = tl.load(p).to(tl.int32) | (tl.load(p + 1).to(tl.int32) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def rint_small(v):
    return (v + RINT_MAGIC) - RINT_MAGIC


@triton.jit
def fexp(x):
    x = tl.minimum(tl.maximum(x, EXP_LO), EXP_HI)
    n = rint_small(x * LOG2E)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = r * P6 + P5
    p = p * r + P4
    p = p * r + P3
    p = p * r + P2
    p = p * r + P1
    p = p * r + P0
    two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return p * two_n


@triton.jit
def swiglu(g, u):
    return tl.math.div_rn(g, 1.0 + fexp(-g)) * u


@triton.jit
def quant_blocks(x):
    """x f32 [B, 32] -> (q int8 [B, 32], d f32 [B], s int32 [B]) per contract step 1 (a block holding a NaN
    or an infinity: q = 0, d = NaN, s = 0)."""
    ax = tl.abs(x)
    finite = tl.min((ax <= F32_MAX).to(tl.int32), axis=1) == 1  # [B]; False for NaN and infinities
    amax = tl.max(tl.where(ax <= F32_MAX, ax, 0.0), axis=1)
    live = (amax >= TINY) & finite
    d = tl.where(live, tl.math.div_rn(amax, tl.full(amax.shape, Q_MAX, tl.float32)), 0.0)
    d = tl.where(finite, d, tl.full(d.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True))
    safe = tl.where(live, d, 1.0)
    v = rint_small(tl.math.div_rn(x, safe[:, None] + tl.zeros_like(x)))
    qi = tl.where(live[:, None], v, 0.0).to(tl.int32)
    return qi.to(tl.int8), d, tl.sum(qi, axis=1)


F32_MAGIC_BITS = tl.constexpr(0x4B400000)  # bits of 1.5 * 2^23
F32_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def i2f_small(i):
    """Exact float(i) for |i| < 2^22 without the quarter-rate int->float conversion instruction:
    1.5 * 2^23 + i is formed in the mantissa bits, then 1.5 * 2^23 is subtracted (exact)."""
    return (i + F32_MAGIC_BITS).to(tl.float32, bitcast=True) - F32_MAGIC


@triton.jit
def to_f32(i, FAST: tl.constexpr):
    """float(i), exact for every block dot of the contract (|i| < 2^24); FAST only where |i| < 2^22."""
    if FAST:
        return i2f_small(i)
    else:
        return i.to(tl.float32)


@triton.jit
def idot(a, w, USE_DOT: tl.constexpr):
    """a int8 [BT, 32], w int8 [BR, 32] -> exact int32 [BT, BR]."""
    if USE_DOT:
        return tl.dot(a, tl.trans(w), out_dtype=tl.int32)
    else:
        return tl.sum(a.to(tl.int32)[:, None, :] * w.to(tl.int32)[None, :, :], axis=2)


@triton.jit
def block_step(acc, w, b, a, ad, asum, T: tl.constexpr, USE_DOT: tl.constexpr, FAST_I2F: tl.constexpr):
    """acc [BT, BR] += contribution of 32-block b of weight rows starting at byte pointers w [BR],
    for activation blocks a int8 [BT, 32] with scales ad f32 [BT] and sums asum int32 [BT].
    FAST_I2F: int->float by the exact magic-number trick (Q8_0/Q4_0/Q4_K dots stay below 2^22)."""
    return acc + block_term(w, b, a, ad, asum, T, USE_DOT, FAST_I2F)


@triton.jit
def block_term(w, b, a, ad, asum, T: tl.constexpr, USE_DOT: tl.constexpr, FAST_I2F: tl.constexpr):
    """The fp32 term [BT, BR] that block_step adds for 32-block b (contract step 2: one rounded value a
    block, added to the row's sum in block order by whoever holds the sum)."""
    k = tl.arange(0, 32)[None, :]
    if T == T_Q8_0:
        blk = w + b * 34
        wq = tl.load(blk[:, None] + 2 + k).to(tl.int8, bitcast=True)
        s = f16_at(blk)[None, :] * ad[:, None]
        t = to_f32(idot(a, wq, USE_DOT), FAST_I2F) * s
    elif T == T_Q4_0:
        blk = w + b * 18
        byte = tl.load(blk[:, None] + 2 + (k % 16)).to(tl.int32)
        wq = (tl.where(k < 16, byte & 0xF, byte >> 4) - 8).to(tl.int8)
        s = f16_at(blk)[None, :] * ad[:, None]
        t = to_f32(idot(a, wq, USE_DOT), FAST_I2F) * s
    elif T == T_Q4_K:
        j = b % 8
        sb = w + (b // 8) * 144
        bj = tl.load(sb + 4 + j).to(tl.int32)
        bj4 = tl.load(sb + 8 + j).to(tl.int32)
        bjm4 = tl.load(sb + j).to(tl.int32)  # scales[j - 4] when j >= 4 (unused otherwise)
        low = j < 4
        sc = tl.where(low, bj & 63, (bj4 & 0xF) | ((bjm4 >> 6) << 4))
        m = tl.where(low, bj4 & 63, (bj4 >> 4) | ((bj >> 6) << 4))
        qb = tl.load(sb[:, None] + 16 + 32 * (j // 2) + k).to(tl.int32)
        wq = ((qb >> (4 * (j % 2))) & 0xF).to(tl.int8)
        big = idot(a, wq, USE_DOT) * sc[None, :]
        msum = m[None, :] * asum[:, None]
        t1 = to_f32(big, FAST_I2F) * (f16_at(sb)[None, :] * ad[:, None])
        t2 = to_f32(msum, FAST_I2F) * (f16_at(sb + 2)[None, :] * ad[:, None])
        t = t1 - t2
    else:  # Q6_K
        j = b % 8
        h = j // 4
        r = j % 4
        sb = w + (b // 8) * 210
        ql = tl.load(sb[:, None] + 64 * h + 32 * (r % 2) + k).to(tl.int32)
        qh = tl.load(sb[:, None] + 128 + 32 * h + k).to(tl.int32)
        q = (((ql >> (4 * (r // 2))) & 0xF) | (((qh >> (2 * r)) & 3) << 4)) - 32
        sc0 = tl.load(sb + 192 + 8 * h + 2 * r).to(tl.int8, bitcast=True).to(tl.int32)
        sc1 = tl.load(sb + 193 + 8 * h + 2 * r).to(tl.int8, bitcast=True).to(tl.int32)
        lo = idot(a, tl.where(k < 16, q, 0).to(tl.int8), USE_DOT)
        hi = idot(a, tl.where(k >= 16, q, 0).to(tl.int8), USE_DOT)
        big = lo * sc0[None, :] + hi * sc1[None, :]
        t = big.to(tl.float32) * (f16_at(sb + 208)[None, :] * ad[:, None])
    return t


@triton.jit
def float_block_step(acc, w, b, af_row, valid, K):
    """Float weights: acc [BT, BR] += in-order sum of the 32 products of block b.
    w: typed pointers [BR] to row starts; af_row: f32 pointers [BT] to activation row starts."""
    t = tl.zeros(acc.shape, tl.float32)
    for i in tl.static_range(32):
        a_i = tl.load(af_row + b * 32 + i, mask=valid, other=0.0)
        w_i = tl.load(w + b * 32 + i).to(tl.float32)
        t = t + a_i[:, None] * w_i[None, :]
    return acc + t
