"""numba block decoders: one 32-value block of a GGUF weight row -> scaled integer weights.

numba has no float16 arrays, so fp16 scales are decoded from their bits (exactly). Each decoder
fills wi[0:32] (int32, sub-block scale already multiplied in) and returns (d, dmin, m) so that the
block contributes float(sum wi*q) * (d*ad) - float(m*s) * (dmin*ad) (the min term for Q4_K only).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .contract import Q4_0, Q4_K, Q6_K, Q8_0

f32 = np.float32


@njit(inline="always", nogil=True, cache=True)
def f16_to_f32(lo, hi):
    """IEEE half from two little-endian bytes -> f32, exact (finite values, subnormals included)."""
    h = (np.int32(hi) << 8) | np.int32(lo)
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    if exp == 0:
        v = math.ldexp(np.float64(man), -24)
    else:
        v = math.ldexp(np.float64(man + 1024), exp - 25)
    if h & 0x8000:
        v = -v
    return f32(v)


@njit(inline="always", nogil=True, cache=True)
def s8(b):
    """uint8 -> signed int32."""
    return (np.int32(b) ^ 128) - 128


@njit(inline="always", nogil=True, cache=True)
def decode_block(row, b, ggml_type, wi):
    """row uint8 [RB]; b = 32-block index; fills wi int32 [32]; returns (d f32, dmin f32, m int32)."""
    zero = f32(0.0)
    if ggml_type == Q8_0:
        o = b * 34
        for i in range(32):
            wi[i] = s8(row[o + 2 + i])
        return f16_to_f32(row[o], row[o + 1]), zero, np.int32(0)
    if ggml_type == Q4_0:
        o = b * 18
        for i in range(16):
            v = np.int32(row[o + 2 + i])
            wi[i] = (v & 0xF) - 8
            wi[i + 16] = (v >> 4) - 8
        return f16_to_f32(row[o], row[o + 1]), zero, np.int32(0)
    if ggml_type == Q4_K:
        o = (b // 8) * 144
        j = b % 8
        sc_o = o + 4
        if j < 4:
            sc = np.int32(row[sc_o + j]) & 63
            m = np.int32(row[sc_o + j + 4]) & 63
        else:
            sc = (np.int32(row[sc_o + j + 4]) & 0xF) | ((np.int32(row[sc_o + j - 4]) >> 6) << 4)
            m = (np.int32(row[sc_o + j + 4]) >> 4) | ((np.int32(row[sc_o + j]) >> 6) << 4)
        q_o = o + 16 + 32 * (j // 2)
        shift = 4 * (j % 2)
        for i in range(32):
            wi[i] = sc * ((np.int32(row[q_o + i]) >> shift) & 0xF)
        return f16_to_f32(row[o], row[o + 1]), f16_to_f32(row[o + 2], row[o + 3]), m
    if ggml_type == Q6_K:
        o = (b // 8) * 210
        j = b % 8
        h = j // 4
        r = j % 4
        ql_o = o + 64 * h + 32 * (r % 2)
        qh_o = o + 128 + 32 * h
        lo_shift = 4 * (r // 2)
        hi_shift = 2 * r
        sc0 = s8(row[o + 192 + 8 * h + 2 * r])
        sc1 = s8(row[o + 192 + 8 * h + 2 * r + 1])
        for i in range(32):
            lo = (np.int32(row[ql_o + i]) >> lo_shift) & 0xF
            q = lo | (((np.int32(row[qh_o + i]) >> hi_shift) & 3) << 4)
            wi[i] = (q - 32) * (sc0 if i < 16 else sc1)
        return f16_to_f32(row[o + 208], row[o + 209]), zero, np.int32(0)
    return zero, zero, np.int32(0)  # unreachable: callers validate types
