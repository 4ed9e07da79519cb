"""numba block readers for one GGUF weight row: integer weights, exact block dots, scales.

numba has no float16 arrays, so fp16 scales are decoded from their bits (exactly). unpack_row +
block_isums give each block's I (the contract's integer dot, sub-block scales applied, held
exactly in f32) and row_scales its (d, dmin, m): block b contributes
I * (d*ad) - float(m*s) * (dmin*ad) (the min term for Q4_K only).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .contract import Q4_0, Q4_K, Q6_K, Q8_0

f32 = np.float32
_POW2 = np.array([math.ldexp(1.0, e - 25) for e in range(32)], np.float64)  # exact powers of two


@njit(inline="always", nogil=True, cache=True)
def f16_to_f32(lo, hi):
    """IEEE half from two little-endian bytes -> f32, exact (finite values, subnormals included)."""
    h = (np.int32(hi) << 8) | np.int32(lo)
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    if exp == 0:
        v = np.float64(man) * _POW2[1]
    else:
        v = np.float64(man + 1024) * _POW2[exp]
    if h & 0x8000:
        v = -v
    return f32(v)


@njit(inline="always", nogil=True, cache=True)
def s8(b):
    """uint8 -> signed int32."""
    return (np.int32(b) ^ 128) - 128


@njit(nogil=True, cache=True)
def unpack_row(row, ggml_type, w, n):
    """w f32 [K] = the row's integer weights with sub-block scales applied (exact small integers).
    n = 32 from runtime data (lets LLVM vectorise the inner loops, see block_isums)."""
    nb = w.shape[0] // n
    half = n // 2
    if ggml_type == Q8_0:
        for b in range(nb):
            o = b * 34 + 2
            for i in range(n):
                w[b * 32 + i] = f32((np.int32(row[o + i]) ^ 128) - 128)
    elif ggml_type == Q4_0:
        for b in range(nb):
            o = b * 18 + 2
            for i in range(half):
                w[b * 32 + i] = f32((np.int32(row[o + i]) & 0xF) - 8)
            for i in range(half):
                w[b * 32 + half + i] = f32((np.int32(row[o + i]) >> 4) - 8)
    elif ggml_type == Q4_K:
        for sb in range(nb // 8):
            o = sb * 144
            for j in range(8):
                if j < 4:
                    sc = np.int32(row[o + 4 + j]) & 63
                else:
                    sc = (np.int32(row[o + 8 + j]) & 0xF) | ((np.int32(row[o + j]) >> 6) << 4)
                q_o = o + 16 + 32 * (j // 2)
                shift = 4 * (j % 2)
                base = sb * 256 + j * 32
                for i in range(n):
                    w[base + i] = f32(((np.int32(row[q_o + i]) >> shift) & 0xF) * sc)
    elif ggml_type == Q6_K:
        for sb in range(nb // 8):
            o = sb * 210
            for h in range(2):
                for r in range(4):
                    ql_o, qh_o = o + 64 * h + 32 * (r % 2), o + 128 + 32 * h
                    lo_shift, hi_shift = 4 * (r // 2), 2 * r
                    sc0 = s8(row[o + 192 + 8 * h + 2 * r])
                    sc1 = s8(row[o + 193 + 8 * h + 2 * r])
                    base = sb * 256 + 128 * h + 32 * r
                    for k in range(2):
                        sc = sc0 if k == 0 else sc1
                        for i in range(k * half, k * half + half):
                            q = ((np.int32(row[ql_o + i]) >> lo_shift) & 0xF) | (
                                ((np.int32(row[qh_o + i]) >> hi_shift) & 3) << 4)
                            w[base + i] = f32((q - 32) * sc)


@njit(nogil=True, fastmath=True, cache=True)
def block_isums_q8_0(row, a, out, n):
    """block_isums straight from Q8_0 bytes (no unpack pass: faster for this type)."""
    for b in range(out.shape[0]):
        o, p = b * 34 + 2, b * n
        s = f32(0.0)
        for i in range(n):
            s += f32((np.int32(row[o + i]) ^ 128) - 128) * a[p + i]
        out[b] = s


@njit(nogil=True, fastmath=True, cache=True)
def block_isums(w, a, out, n):
    """out[b] = sum_i w[b*n + i] * a[b*n + i]: exact integer dots of unpacked weights and f32 codes.

    fastmath (reassociation) is safe here: every product and partial sum is an integer below 2^24,
    exact in f32 in any order. n (= 32) must arrive as a runtime value: with a constant, LLVM
    unrolls the loop into scalar code before the loop vectoriser sees it (measured 10x slower)."""
    for b in range(out.shape[0]):
        p = b * n
        s = f32(0.0)
        for i in range(n):
            s += w[p + i] * a[p + i]
        out[b] = s


@njit(inline="always", nogil=True, cache=True)
def row_scales(row, ggml_type, d, dmin, m):
    """Per 32-block of a weight row: d f32, dmin f32 (Q4_K, else 0), m int32 (Q4_K, else 0)."""
    for b in range(d.shape[0]):
        dmin[b] = f32(0.0)
        m[b] = 0
        if ggml_type == Q8_0:
            o = b * 34
            d[b] = f16_to_f32(row[o], row[o + 1])
        elif ggml_type == Q4_0:
            o = b * 18
            d[b] = f16_to_f32(row[o], row[o + 1])
        elif ggml_type == Q4_K:
            o = (b // 8) * 144
            j = b % 8
            d[b] = f16_to_f32(row[o], row[o + 1])
            dmin[b] = f16_to_f32(row[o + 2], row[o + 3])
            sc_o = o + 4
            if j < 4:
                m[b] = np.int32(row[sc_o + j + 4]) & 63
            else:
                m[b] = (np.int32(row[sc_o + j + 4]) >> 4) | ((np.int32(row[sc_o + j]) >> 6) << 4)
        elif ggml_type == Q6_K:
            o = (b // 8) * 210
            d[b] = f16_to_f32(row[o + 208], row[o + 209])
