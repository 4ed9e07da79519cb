"""numba block readers for one GGUF weight row: exact integer block dots and the block scales.

row_ints gives the contract's I (sub-block scales applied) of every block of a row; row_scales the
blocks' (d, dmin, m): block b contributes float(I)*(d*ad) - float(m*s)*(dmin*ad) (the min term for Q4_K).
The integer dots come from the vector intrinsics in block_dots.py. numba has no float16 arrays, so
fp16 scales are decoded from their bits (exactly).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .block_dots import GROUP, dot1_q4_0, dot1_q8_0, dots_q4_0, dots_q4_k, dots_q6_k, dots_q8_0
from .contract import Q4_0, Q4_K, Q8_0

f32 = np.float32
_I32 = ir.IntType(32)


@intrinsic
def half_to_f32(typingctx, bits):
    """IEEE half from its 16 bits (an integer) -> f32, exact for finite values (subnormals included).
    Integer ops only (no F16C or libm needed), branch-free so that loops over blocks vectorise."""
    if not isinstance(bits, types.Integer):
        raise TypeError(f"half_to_f32 takes integer bits, got {bits}")

    def codegen(context, builder, sig, args):
        h = builder.trunc(args[0], _I32) if bits.bitwidth > 32 else builder.zext(args[0], _I32) \
            if bits.bitwidth < 32 else args[0]
        c = lambda k: ir.Constant(_I32, k)  # noqa: E731
        em = builder.and_(h, c(0x7FFF))
        normal = builder.bitcast(builder.add(builder.shl(em, c(13)), c(112 << 23)), ir.FloatType())
        subnormal = builder.fmul(builder.sitofp(em, ir.FloatType()), ir.Constant(ir.FloatType(), 2.0 ** -24))
        mag = builder.select(builder.icmp_signed(">=", em, c(0x400)), normal, subnormal)
        sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
        return builder.bitcast(builder.or_(builder.bitcast(mag, _I32), sign), ir.FloatType())

    return types.float32(bits), codegen


@njit(inline="always", nogil=True, cache=True)
def f16_to_f32(lo, hi):
    """IEEE half from two little-endian bytes -> f32, exact (finite values, subnormals included)."""
    return half_to_f32((np.int32(hi) << 8) | np.int32(lo))


@njit(inline="always", nogil=True, cache=True)
def s8(b):
    """uint8 -> signed int32."""
    return (np.int32(b) ^ 128) - 128


@njit(inline="always", nogil=True, cache=True)
def q4_k_scale(row, o, j):
    """6-bit scale sc_j of sub-block j of the Q4_K super-block at byte o."""
    if j < 4:
        return np.int32(row[o + 4 + j]) & 63
    return (np.int32(row[o + 8 + j]) & 0xF) | ((np.int32(row[o + j]) >> 6) << 4)


@njit(inline="always", nogil=True, cache=True)
def q4_k_min(row, o, j):
    """6-bit min m_j of sub-block j of the Q4_K super-block at byte o."""
    if j < 4:
        return np.int32(row[o + 8 + j]) & 63
    return (np.int32(row[o + 8 + j]) >> 4) | ((np.int32(row[o + 4 + j]) >> 6) << 4)


@njit(inline="always", nogil=True, cache=True)
def row_ints(row, ggml_type, aq, a_sums, out):
    """out int32 [nb] = the contract's exact I of every 32-block of a weight row with the activation
    codes aq int8 [nb*32] (a_sums int32 [nb]: their block sums, for Q4_0's -8 offset)."""
    nb = out.shape[0]
    n_groups = nb // GROUP
    if ggml_type == Q8_0:
        for g in range(n_groups):
            dots_q8_0(row, g * GROUP * 34, aq, g * GROUP * 32, out, g * GROUP)
        for b in range(n_groups * GROUP, nb):
            dot1_q8_0(row, b * 34, aq, b * 32, out, b)
    elif ggml_type == Q4_0:
        for g in range(n_groups):
            dots_q4_0(row, g * GROUP * 18, aq, g * GROUP * 32, out, g * GROUP)
        for b in range(n_groups * GROUP, nb):
            dot1_q4_0(row, b * 18, aq, b * 32, out, b)
        for b in range(nb):
            out[b] -= 8 * a_sums[b]
    elif ggml_type == Q4_K:
        for sb in range(n_groups):
            dots_q4_k(row, sb * 144, aq, sb * 256, out, sb * 8)
            for j in range(8):
                out[sb * 8 + j] *= q4_k_scale(row, sb * 144, j)
    else:  # Q6_K
        for sb in range(n_groups):
            dots_q6_k(row, sb * 210, aq, sb * 256, out, sb * 8)


@njit(inline="always", nogil=True, cache=True)
def row_scales(row, ggml_type, d, dmin, m):
    """Per 32-block of a weight row: d f32, and for Q4_K dmin f32 and m int32 (left as they are
    for other types: only Q4_K has the min term)."""
    nb = d.shape[0]
    if ggml_type == Q8_0:
        for b in range(nb):
            d[b] = f16_to_f32(row[b * 34], row[b * 34 + 1])
    elif ggml_type == Q4_0:
        for b in range(nb):
            d[b] = f16_to_f32(row[b * 18], row[b * 18 + 1])
    elif ggml_type == Q4_K:
        for sb in range(nb // 8):
            o = sb * 144
            sd, smin = f16_to_f32(row[o], row[o + 1]), f16_to_f32(row[o + 2], row[o + 3])
            for j in range(8):
                d[sb * 8 + j] = sd
                dmin[sb * 8 + j] = smin
                m[sb * 8 + j] = q4_k_min(row, o, j)
    else:
        for sb in range(nb // 8):
            o = sb * 210
            sd = f16_to_f32(row[o + 208], row[o + 209])
            for j in range(8):
                d[sb * 8 + j] = sd


@njit(nogil=True, cache=True)
def row_block_ints(row, ggml_type, aq, a_sums, out):
    """row_ints as a callable kernel (tests, tools)."""
    row_ints(row, ggml_type, aq, a_sums, out)
