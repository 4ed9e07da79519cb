"""numba activation math of the contract: int8 block quantization, the fixed exp, SwiGLU.

Bit-identical to spec.py (numpy) and expert_gpu.py (Triton); see contract.py. numba without
fastmath never contracts a*b+c into an FMA, and every constant here is an fp32 value, so each
operation is one rounded fp32 operation.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .contract import (
    EXP_HI,
    EXP_LO,
    EXP_POLY,
    LN2_HI,
    LN2_LO,
    LOG2E,
    Q_MAX,
    QK,
    RINT_MAGIC,
    TINY,
    KernelError,
)

f32 = np.float32
P0, P1, P2, P3, P4, P5, P6 = EXP_POLY


@njit(inline="always", nogil=True, cache=True)
def rint_small(v):
    """Round half to even for |v| < 2^22 (two rounded fp32 ops)."""
    return (v + RINT_MAGIC) - RINT_MAGIC


@njit(inline="always", nogil=True, cache=True)
def _amax8(x, o, c):
    """The largest |x[o + c + 8 j]| for j < 4 (0 when none is above 0): one of block_amax's 8 chains."""
    m = f32(0.0)
    for j in range(QK // 8):
        a = abs(x[o + c + 8 * j])
        if a > m:
            m = a
    return m


@njit(inline="always", nogil=True, cache=True)
def block_amax(x, o):
    """max |x[o:o+32]| (0 for a block of zeros): 8 independent chains of 4 compares, then 3 rounds of pairs,
    instead of one chain of 32 (a maxss's latency each: ~4 us of an H200 host's 2048-value quantization).
    The same value as one chain: the maximum of exact values is exact in any order (and a NaN, which
    `a > m` never takes, never enters either form: quantize_block finds it another way)."""
    m0, m1, m2, m3 = _amax8(x, o, 0), _amax8(x, o, 1), _amax8(x, o, 2), _amax8(x, o, 3)
    m4, m5, m6, m7 = _amax8(x, o, 4), _amax8(x, o, 5), _amax8(x, o, 6), _amax8(x, o, 7)
    m0 = m4 if m4 > m0 else m0
    m1 = m5 if m5 > m1 else m1
    m2 = m6 if m6 > m2 else m2
    m3 = m7 if m7 > m3 else m3
    m0 = m2 if m2 > m0 else m0
    m1 = m3 if m3 > m1 else m1
    return m1 if m1 > m0 else m0


@njit(inline="always", nogil=True, cache=True)
def _blank_block(q, o, d_out, s_out, b, d):
    """q = 0, s = 0 and scale d: a zero block (d = 0) or a poisoned one (d = NaN), contract step 1."""
    for i in range(QK):
        q[o + i] = 0
    d_out[b] = d
    s_out[b] = 0


@njit(inline="always", nogil=True, cache=True)
def quantize_block(x, o, q, d_out, s_out, b):
    """Quantize x[o:o+32] (f32) into q[o:o+32] (int8), d_out[b], s_out[b].

    Non-finite values are found in the loop that quantizes: an infinity makes amax infinite, so d too, and
    its own x / d is NaN; a NaN's x / d is NaN. Either shows as a NaN quotient (selected to 0 before the int
    conversion, whose NaN result is undefined). The compare and select cost ~0.1 ns a value: the loop no
    longer vectorises as it did (BENCHMARKS, session 32). Only a zero block (amax < TINY: block_amax skips
    NaN) scans for a NaN."""
    amax = block_amax(x, o)
    if amax < TINY:
        poisoned = False
        for i in range(QK):
            poisoned |= x[o + i] != x[o + i]
        _blank_block(q, o, d_out, s_out, b, np.float32(np.nan) if poisoned else f32(0.0))
        return
    d = amax / Q_MAX
    s = np.int32(0)
    poisoned = False
    for i in range(QK):
        r = rint_small(x[o + i] / d)
        nan = r != r
        poisoned |= nan
        v = np.int32(f32(0.0) if nan else r)
        q[o + i] = v
        s += v
    if poisoned:
        _blank_block(q, o, d_out, s_out, b, np.float32(np.nan))
        return
    d_out[b] = d
    s_out[b] = s


@njit(nogil=True, cache=True)
def quantize_rows_into(x, q, d, s):
    """x f32 [N, n] -> q int8 [N, n], d f32 [N, n/32], s int32 [N, n/32] (preallocated)."""
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // QK):
            quantize_block(x[r], b * QK, q[r], d[r], s[r], b)


def quantize_act_sums(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x f32 [N, n] -> (q int8 [N, n], d f32 [N, n/32], s int32 [N, n/32])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % QK:
        raise KernelError(f"activations must be [N, n] with n a multiple of {QK}, got {x.shape}")
    nb = x.shape[1] // QK
    q = np.empty(x.shape, np.int8)
    d = np.empty((x.shape[0], nb), np.float32)
    s = np.empty((x.shape[0], nb), np.int32)
    quantize_rows_into(x, q, d, s)
    return q, d, s


def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x f32 [N, n] -> (q int8 [N, n], d f32 [N, n/32]), contract step 1."""
    q, d, _ = quantize_act_sums(x)
    return q, d


@njit(inline="always", nogil=True, cache=True)
def fexp(x):
    """The contract's fixed exp on one f32 (contract step 4)."""
    x = min(max(x, EXP_LO), EXP_HI)
    n = rint_small(x * LOG2E)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = P6
    p = p * r
    p = p + P5
    p = p * r
    p = p + P4
    p = p * r
    p = p + P3
    p = p * r
    p = p + P2
    p = p * r
    p = p + P1
    p = p * r
    p = p + P0
    two_n = f32(math.ldexp(1.0, np.int32(n)))  # exact: n in [-124, 127], a normal power of two
    return p * two_n


@njit(inline="always", nogil=True, cache=True)
def swiglu(g, u):
    """(g / (1 + fexp(-g))) * u on f32 scalars."""
    return (g / (f32(1.0) + fexp(-g))) * u


@njit(nogil=True, cache=True)
def fexp_array(x):
    """Elementwise fexp over f32 [n] (for tests and tools)."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = fexp(x[i])
    return out
