"""numba block readers for GGUF weight rows: exact integer block dots, block scales, and the tile sums.

tile_sums gives the contract dots of 16 weight rows with several activation rows (the expert kernels' hot
path: block_dots.tile_dots, scale terms and ordered sums in vector form), tile_sums_half those of 8.
row_ints gives the contract's I (sub-block scales applied) of every block of one row; row_scales the
blocks' (d, dmin, m): block b contributes float(I)*(d*ad) - float(m*s)*(dmin*ad) (the min term for Q4_K);
these two serve tests and tools. numba has no float16 arrays, so fp16 scales are decoded from their bits
(exactly).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .block_dots import (
    GROUP,
    HALF_ROWS,
    ROWS,
    TOKENS,
    half_bits_to_f32,
    half_dot1,
    half_dots,
    row_dot1,
    row_dots,
    tile_dot1,
    tile_dots,
)
from .contract import Q4_0, Q4_K, Q6_K, Q8_0

f32 = np.float32
_I32 = ir.IntType(32)
# numba resolves globals, not dict lookups, inside jitted code.
_row_q8_0, _row_q4_0, _row_q4_k, _row_q6_k = (row_dots[t] for t in (Q8_0, Q4_0, Q4_K, Q6_K))
_row1_q8_0, _row1_q4_0 = row_dot1[Q8_0], row_dot1[Q4_0]
_tile_q8_0, _tile_q4_0, _tile_q4_k, _tile_q6_k = (tile_dots[t] for t in (Q8_0, Q4_0, Q4_K, Q6_K))
_tile1_q8_0, _tile1_q4_0 = tile_dot1[Q8_0], tile_dot1[Q4_0]
_half_q8_0, _half_q4_0, _half_q4_k, _half_q6_k = (half_dots[t] for t in (Q8_0, Q4_0, Q4_K, Q6_K))
_half1_q8_0, _half1_q4_0 = half_dot1[Q8_0], half_dot1[Q4_0]


@intrinsic
def half_to_f32(typingctx, bits):
    """IEEE half from its 16 bits (an integer) -> f32, exact for finite values (subnormals included)."""
    if not isinstance(bits, types.Integer):
        raise TypeError(f"half_to_f32 takes integer bits, got {bits}")

    def codegen(context, builder, sig, args):
        h = builder.trunc(args[0], _I32) if bits.bitwidth > 32 else builder.zext(args[0], _I32) \
            if bits.bitwidth < 32 else args[0]
        return half_bits_to_f32(builder, h)

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
            _row_q8_0(row, g, aq, a_sums, out)
        for b in range(n_groups * GROUP, nb):
            _row1_q8_0(row, b, aq, a_sums, out)
    elif ggml_type == Q4_0:
        for g in range(n_groups):
            _row_q4_0(row, g, aq, a_sums, out)
        for b in range(n_groups * GROUP, nb):
            _row1_q4_0(row, b, aq, a_sums, out)
    elif ggml_type == Q4_K:
        for g in range(n_groups):
            _row_q4_k(row, g, aq, a_sums, out)
    else:  # Q6_K
        for g in range(n_groups):
            _row_q6_k(row, g, aq, a_sums, out)


@njit(inline="always", nogil=True, cache=True)
def tile_sums(w, r0, ggml_type, aq, ad, asum, arow, acc):
    """acc[j, i] = the contract dot of weight row w[r0 + i] (uint8 [R, RB]), i < ROWS, with activation
    row arow[j] (aq int8 [N, n], ad f32 [N, nb], asum int32 [N, nb]), j < len(arow): acc[j] starts at
    +0.0 and takes the block terms t_b in increasing b. Each group of 8 blocks is met by up to TOKENS
    activation rows per tile call, which share the rows' unpacked weight codes and scales."""
    nb = ad.shape[1]
    n_groups = nb // GROUP
    n = arow.shape[0]
    for j in range(n):
        for i in range(ROWS):
            acc[j, i] = f32(0.0)
    for g in range(n_groups):
        for j0 in range(0, n, TOKENS):
            count = min(TOKENS, n - j0)
            if ggml_type == Q8_0:
                _tile_q8_0(w, r0, g, aq, ad, asum, arow, j0, count, acc)
            elif ggml_type == Q4_0:
                _tile_q4_0(w, r0, g, aq, ad, asum, arow, j0, count, acc)
            elif ggml_type == Q4_K:
                _tile_q4_k(w, r0, g, aq, ad, asum, arow, j0, count, acc)
            else:  # Q6_K
                _tile_q6_k(w, r0, g, aq, ad, asum, arow, j0, count, acc)
    for b in range(n_groups * GROUP, nb):  # Q8_0 / Q4_0 rows whose block count is not a multiple of 8
        for j0 in range(0, n, TOKENS):
            count = min(TOKENS, n - j0)
            if ggml_type == Q8_0:
                _tile1_q8_0(w, r0, b, aq, ad, asum, arow, j0, count, acc)
            else:
                _tile1_q4_0(w, r0, b, aq, ad, asum, arow, j0, count, acc)


@njit(inline="always", nogil=True, cache=True)
def tile_sums_half(w, r0, ggml_type, aq, ad, asum, arow, acc):
    """tile_sums over HALF_ROWS weight rows (acc f32 [M, HALF_ROWS]): each row's sums are the same
    operations as in a whole tile, so the same bits. The CPU team's gate/up units (a layer's one expert
    splits into 64 of them instead of 32, so no member holds more than half a whole tile above the rest)."""
    nb = ad.shape[1]
    n_groups = nb // GROUP
    n = arow.shape[0]
    for j in range(n):
        for i in range(HALF_ROWS):
            acc[j, i] = f32(0.0)
    for g in range(n_groups):
        for j0 in range(0, n, TOKENS):
            count = min(TOKENS, n - j0)
            if ggml_type == Q8_0:
                _half_q8_0(w, r0, g, aq, ad, asum, arow, j0, count, acc)
            elif ggml_type == Q4_0:
                _half_q4_0(w, r0, g, aq, ad, asum, arow, j0, count, acc)
            elif ggml_type == Q4_K:
                _half_q4_k(w, r0, g, aq, ad, asum, arow, j0, count, acc)
            else:  # Q6_K
                _half_q6_k(w, r0, g, aq, ad, asum, arow, j0, count, acc)
    for b in range(n_groups * GROUP, nb):
        for j0 in range(0, n, TOKENS):
            count = min(TOKENS, n - j0)
            if ggml_type == Q8_0:
                _half1_q8_0(w, r0, b, aq, ad, asum, arow, j0, count, acc)
            else:
                _half1_q4_0(w, r0, b, aq, ad, asum, arow, j0, count, acc)


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
