"""numba block readers for one GGUF weight row: per-32-block exact integer dots and scales.

numba has no float16 arrays, so fp16 scales are decoded from their bits (exactly). row_isums gives
each block's I (the contract's integer dot, sub-block scales applied, held exactly in f32) and
row_scales its (d, dmin, m): block b contributes I * (d*ad) - float(m*s) * (dmin*ad) (min: Q4_K).
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


# The _isums_* functions may reassociate freely (fastmath): every product and partial sum is an
# integer below 2^24 held exactly in f32, so any order gives the same exact integer. Their inner
# trip count n (= 32) arrives as a runtime value: with a constant, LLVM fully unrolls the loop into
# scalar code before the loop vectoriser sees it (measured 10x slower).


@njit(nogil=True, fastmath=True, cache=True)
def _isums_q8_0(row, a, out, n):
    for b in range(out.shape[0]):
        o, p = b * 34 + 2, b * n
        s = f32(0.0)
        for i in range(n):
            s += f32((np.int32(row[o + i]) ^ 128) - 128) * a[p + i]
        out[b] = s


@njit(nogil=True, fastmath=True, cache=True)
def _isums_q4_0(row, a, out, n):
    half = n // 2
    for b in range(out.shape[0]):
        o, p = b * 18 + 2, b * n
        s = f32(0.0)
        for i in range(half):
            s += f32((np.int32(row[o + i]) & 0xF) - 8) * a[p + i]
        for i in range(half):
            s += f32((np.int32(row[o + i]) >> 4) - 8) * a[p + half + i]
        out[b] = s


@njit(nogil=True, fastmath=True, cache=True)
def _isums_q4_k(row, a, out, n):
    """Per 32-block: sum of nibble * activation (sub-block scale applied by the caller)."""
    for b in range(out.shape[0]):
        j = b % 8
        o, p = (b // 8) * 144 + 16 + 32 * (j // 2), b * n
        s = f32(0.0)
        if j % 2 == 0:
            for i in range(n):
                s += f32(np.int32(row[o + i]) & 0xF) * a[p + i]
        else:
            for i in range(n):
                s += f32(np.int32(row[o + i]) >> 4) * a[p + i]
        out[b] = s


@njit(nogil=True, fastmath=True, cache=True)
def _isums_q6_k(row, a, out, n):
    """Per 16-sub-block: sum of (q - 32) * activation; out has 2 entries per 32-block."""
    half = n // 2
    for b in range(out.shape[0] // 2):
        j = b % 8
        h, r = j // 4, j % 4
        o = (b // 8) * 210
        ql_o, qh_o, p = o + 64 * h + 32 * (r % 2), o + 128 + 32 * h, b * n
        lo_shift, hi_shift = 4 * (r // 2), 2 * r
        for k in range(2):
            s = f32(0.0)
            for i in range(k * half, k * half + half):
                q = ((np.int32(row[ql_o + i]) >> lo_shift) & 0xF) | (
                    ((np.int32(row[qh_o + i]) >> hi_shift) & 3) << 4)
                s += f32(q - 32) * a[p + i]
            out[2 * b + k] = s


@njit(inline="always", nogil=True, cache=True)
def row_isums(row, ggml_type, a, out, n):
    """out[b] = exact integer dot I of 32-block b of a weight row with int-valued f32 activations a,
    sub-block scales applied, held in f32. out: f32 [2 * nb] scratch (Q6_K needs two per block)."""
    nb = a.shape[0] // n
    if ggml_type == Q8_0:
        _isums_q8_0(row, a, out[:nb], n)
    elif ggml_type == Q4_0:
        _isums_q4_0(row, a, out[:nb], n)
    elif ggml_type == Q4_K:
        _isums_q4_k(row, a, out[:nb], n)
        for b in range(nb):
            j = b % 8
            sc_o = (b // 8) * 144 + 4
            if j < 4:
                sc = np.int32(row[sc_o + j]) & 63
            else:
                sc = (np.int32(row[sc_o + j + 4]) & 0xF) | ((np.int32(row[sc_o + j - 4]) >> 6) << 4)
            out[b] = out[b] * f32(sc)  # exact: < 2^24
    elif ggml_type == Q6_K:
        _isums_q6_k(row, a, out[:2 * nb], n)
        for b in range(nb):
            j = b % 8
            sc_o = (b // 8) * 210 + 192 + 8 * (j // 4) + 2 * (j % 4)
            out[b] = out[2 * b] * f32(s8(row[sc_o])) + out[2 * b + 1] * f32(s8(row[sc_o + 1]))  # exact


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
