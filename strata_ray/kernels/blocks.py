"""numba block readers for one GGUF weight row: exact integer block dots and the block scales.

The integer dot of a 32-block is written as LLVM vector IR (numba intrinsics below): load the
block's bytes as one vector, unpack the codes in-register, multiply by the int8 activation codes,
and add the products with `llvm.vector.reduce.add` (x86: vpmovsxbw + vpmaddwd + a shuffle tree).
Integer sums are exact, so the reduction order is free (contract step 2). A plain numba loop
over the 32 values does not vectorise this well: with a constant trip count LLVM unrolls it into
scalar code, and with a runtime one it picks a 64-wide vector loop that a 32-block never enters.

row_ints gives the contract's I (sub-block scales applied) of every block of a row; row_scales the
blocks' (d, dmin, m): block b contributes float(I)*(d*ad) - float(m*s)*(dmin*ad) (the min term for Q4_K).
numba has no float16 arrays, so fp16 scales are decoded from their bits (exactly).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .contract import Q4_0, Q4_K, Q8_0

f32 = np.float32
_I8, _I32 = ir.IntType(8), ir.IntType(32)


def _load_bytes(context, builder, aryty, ary, offset, n: int):
    """<n x i8> from a contiguous 1-D array's data at element offset (no alignment assumed)."""
    data = context.make_array(aryty)(context, builder, ary).data
    ptr = builder.bitcast(builder.gep(data, [offset]), ir.VectorType(_I8, n).as_pointer())
    return builder.load(ptr, align=1)


def _splat(builder, value, n: int):
    """<n x i8> with every lane = the integer scalar value (truncated to 8 bits)."""
    undef = ir.Constant(ir.VectorType(_I8, n), ir.Undefined)
    one = builder.insert_element(undef, builder.trunc(value, _I8), ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _dot(builder, w, w_signed: bool, a):
    """sum_i w[i] * a[i] as i32 for <n x i8> vectors (a signed); exact for n <= 32."""
    n = w.type.count
    wide = ir.VectorType(_I32, n)
    w32 = builder.sext(w, wide) if w_signed else builder.zext(w, wide)
    prod = builder.mul(w32, builder.sext(a, wide))
    reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [wide]),
                                            f"llvm.vector.reduce.add.v{n}i32")
    return builder.call(reduce, [prod])


def _check_arrays(*arys) -> None:
    for a in arys:
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype.bitwidth == 8):
            raise TypeError(f"block dots take contiguous 1-D 8-bit arrays, got {a}")


@intrinsic
def dot_q8_0(typingctx, row, w_off, aq, a_off):
    """sum_{i<32} int8 row[w_off+i] * aq[a_off+i] (Q8_0 codes; row uint8 or int8, aq int8)."""
    _check_arrays(row, aq)

    def codegen(context, builder, sig, args):
        w = _load_bytes(context, builder, sig.args[0], args[0], args[1], 32)
        a = _load_bytes(context, builder, sig.args[2], args[2], args[3], 32)
        return _dot(builder, w, True, a)

    return types.int32(row, w_off, aq, a_off), codegen


@intrinsic
def dot_q4_0(typingctx, row, w_off, aq, a_off):
    """sum_{i<16} (row[w_off+i] & 15) * aq[a_off+i] + (row[w_off+i] >> 4) * aq[a_off+16+i]
    (Q4_0 codes without the -8 offset)."""
    _check_arrays(row, aq)

    def codegen(context, builder, sig, args):
        v = _load_bytes(context, builder, sig.args[0], args[0], args[1], 16)
        lo = builder.and_(v, ir.Constant(v.type, [15] * 16))
        hi = builder.lshr(v, ir.Constant(v.type, [4] * 16))
        w = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        a = _load_bytes(context, builder, sig.args[2], args[2], args[3], 32)
        return _dot(builder, w, False, a)

    return types.int32(row, w_off, aq, a_off), codegen


@intrinsic
def dot_u4(typingctx, row, w_off, shift, aq, a_off):
    """sum_{i<32} ((row[w_off+i] >> shift) & 15) * aq[a_off+i] (one Q4_K sub-block)."""
    _check_arrays(row, aq)

    def codegen(context, builder, sig, args):
        v = _load_bytes(context, builder, sig.args[0], args[0], args[1], 32)
        nib = builder.and_(builder.lshr(v, _splat(builder, args[2], 32)), ir.Constant(v.type, [15] * 32))
        a = _load_bytes(context, builder, sig.args[3], args[3], args[4], 32)
        return _dot(builder, nib, False, a)

    return types.int32(row, w_off, shift, aq, a_off), codegen


@intrinsic
def dot_q6(typingctx, row, ql_off, qh_off, lo_shift, hi_shift, aq, a_off):
    """sum_{i<16} (q[i] - 32) * aq[a_off+i] with the Q6_K code
    q[i] = ((row[ql_off+i] >> lo_shift) & 15) | (((row[qh_off+i] >> hi_shift) & 3) << 4)."""
    _check_arrays(row, aq)

    def codegen(context, builder, sig, args):
        ql = _load_bytes(context, builder, sig.args[0], args[0], args[1], 16)
        qh = _load_bytes(context, builder, sig.args[0], args[0], args[2], 16)
        c = lambda k: ir.Constant(ql.type, [k] * 16)  # noqa: E731
        lo = builder.and_(builder.lshr(ql, _splat(builder, args[3], 16)), c(15))
        hi = builder.shl(builder.and_(builder.lshr(qh, _splat(builder, args[4], 16)), c(3)), c(4))
        w = builder.sub(builder.or_(lo, hi), c(32))  # -32..31 as signed i8
        a = _load_bytes(context, builder, sig.args[5], args[5], args[6], 16)
        return _dot(builder, w, True, a)

    return types.int32(row, ql_off, qh_off, lo_shift, hi_shift, aq, a_off), codegen


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
    if ggml_type == Q8_0:
        for b in range(nb):
            out[b] = dot_q8_0(row, b * 34 + 2, aq, b * 32)
    elif ggml_type == Q4_0:
        for b in range(nb):
            out[b] = dot_q4_0(row, b * 18 + 2, aq, b * 32) - 8 * a_sums[b]
    elif ggml_type == Q4_K:
        for sb in range(nb // 8):
            o = sb * 144
            for p in range(4):  # sub-blocks 2p (low nibbles) and 2p+1 (high) share 32 bytes
                b = sb * 8 + 2 * p
                q_o = o + 16 + 32 * p
                out[b] = q4_k_scale(row, o, 2 * p) * dot_u4(row, q_o, 0, aq, b * 32)
                out[b + 1] = q4_k_scale(row, o, 2 * p + 1) * dot_u4(row, q_o, 4, aq, b * 32 + 32)
    else:  # Q6_K: block 4h + r of a super-block covers sub-blocks 8h + 2r and 8h + 2r + 1
        for sb in range(nb // 8):
            o = sb * 210
            for k in range(8):
                h, r = k // 4, k % 4
                ql_o, qh_o = o + 64 * h + 32 * (r % 2), o + 128 + 32 * h
                lo_shift, hi_shift = 4 * (r // 2), 2 * r
                sc_o = o + 192 + 8 * h + 2 * r
                a_o = (sb * 8 + k) * 32
                out[sb * 8 + k] = (
                    s8(row[sc_o]) * dot_q6(row, ql_o, qh_o, lo_shift, hi_shift, aq, a_o)
                    + s8(row[sc_o + 1]) * dot_q6(row, ql_o + 16, qh_o + 16, lo_shift, hi_shift, aq, a_o + 16))


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
