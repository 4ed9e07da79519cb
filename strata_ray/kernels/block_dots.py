"""Exact integer dots of GGUF weight blocks with int8 activation codes, as numba intrinsics in LLVM
vector IR (portable: no target-specific intrinsics; LLVM picks the instructions).

Each intrinsic handles a group of 8 consecutive 32-blocks (one K-quant super-block; Q8_0/Q4_0 also
have one-block forms for a row's tail) and stores the 8 integer dots I (contract step 2) as one
<8 x i32>: load each block's bytes as a vector, unpack the codes in registers, multiply by the
activation codes, add adjacent product pairs (x86: vpmaddwd), then fold the 8 product vectors into
8 sums with a transposing shuffle tree. Integer sums are exact, so the order is free. Plain numba
loops do worse: with the constant 32-value trip count LLVM unrolls into scalar code, with a runtime
one it picks a 64-wide vector loop that a 32-block never enters, and a per-block horizontal sum
costs more than the dot itself.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
GROUP = 8  # blocks per call


def _vec(ty, n: int):
    return ir.VectorType(ty, n)


def _const(ty, n: int, values) -> ir.Constant:
    return ir.Constant(_vec(ty, n), list(values) if hasattr(values, "__iter__") else [values] * n)


def _shuffle(builder, x, y, idx):
    return builder.shuffle_vector(x, y, _const(_I32, len(idx), idx))


def _load(context, builder, aryty, ary, offset, n: int):
    """<n x i8> from a contiguous 1-D array's data at element offset (no alignment assumed)."""
    data = context.make_array(aryty)(context, builder, ary).data
    ptr = builder.bitcast(builder.gep(data, [offset]), _vec(_I8, n).as_pointer())
    return builder.load(ptr, align=1)


def _offset(builder, base, k: int):
    return builder.add(base, ir.Constant(base.type, k))


def _pair_sums(builder, w32, a):
    """<16 x i32>: products of the 32 weights (i32, |w| < 2^15) with 32 int8 codes, adjacent pairs added."""
    p = builder.mul(w32, builder.sext(a, _vec(_I32, 32)))
    return builder.add(_shuffle(builder, p, p, range(0, 32, 2)), _shuffle(builder, p, p, range(1, 32, 2)))


def _fold(builder, vecs):
    """k vectors <n x i32> -> one <k x i32> of their lane sums (k a power of two, k <= n)."""
    n, width = vecs[0].type.count, vecs[0].type.count  # lanes per block inside each vector
    while len(vecs) > 1:
        half = width // 2
        lo = [g * width + i for g in range(n // width) for i in range(half)]
        hi = [g * width + half + i for g in range(n // width) for i in range(half)]
        vecs = [builder.add(_shuffle(builder, x, y, lo + [n + i for i in lo]),
                            _shuffle(builder, x, y, hi + [n + i for i in hi]))
                for x, y in zip(vecs[0::2], vecs[1::2], strict=True)]
        width = half
    v = vecs[0]
    while width > 1:  # now n // width blocks of `width` lanes in one vector
        half, m = width // 2, v.type.count
        lo = [g * width + i for g in range(m // width) for i in range(half)]
        hi = [g * width + half + i for g in range(m // width) for i in range(half)]
        v = builder.add(_shuffle(builder, v, v, lo), _shuffle(builder, v, v, hi))
        width = half
    return v


def _check(row, aq, out) -> None:
    for a, bits in ((row, 8), (aq, 8), (out, 32)):
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype.bitwidth == bits):
            raise TypeError(f"block dots take contiguous 1-D arrays (row/aq 8-bit, out 32-bit), got {a}")


def _group_intrinsic(weights, n_blocks: int = GROUP):
    """An intrinsic f(row, w_off, aq, a_off, out, o_off): out[o_off + k] = sum_i w_k[i] * aq[a_off + 32k + i]
    for k < n_blocks, where weights(builder, load, w_off, k) builds block k's 32 weights as <32 x i32>."""

    def typer(typingctx, row, w_off, aq, a_off, out, o_off):
        _check(row, aq, out)

        def codegen(context, builder, sig, args):
            row_v, w_off_v, aq_v, a_off_v, out_v, o_off_v = args

            def load(offset, n):
                return _load(context, builder, sig.args[0], row_v, offset, n)

            sums = []
            for k in range(n_blocks):
                a = _load(context, builder, sig.args[2], aq_v, _offset(builder, a_off_v, 32 * k), 32)
                sums.append(_pair_sums(builder, weights(builder, load, w_off_v, k), a))
            data = context.make_array(sig.args[4])(context, builder, out_v).data
            ptr = builder.bitcast(builder.gep(data, [o_off_v]), _vec(_I32, n_blocks).as_pointer())
            builder.store(_fold(builder, sums), ptr, align=4)
            return context.get_dummy_value()

        return types.none(row, w_off, aq, a_off, out, o_off), codegen

    return intrinsic(typer)


def _q8_0(builder, load, w_off, k):
    return builder.sext(load(_offset(builder, w_off, 34 * k + 2), 32), _vec(_I32, 32))


def _q4_0(builder, load, w_off, k):
    """Codes 0..15 without Q4_0's -8 (the caller subtracts 8 * sum of the activation codes)."""
    v = load(_offset(builder, w_off, 18 * k + 2), 16)
    lo = builder.and_(v, _const(_I8, 16, 15))
    hi = builder.lshr(v, _const(_I8, 16, 4))
    return builder.zext(_shuffle(builder, lo, hi, range(32)), _vec(_I32, 32))


def _q4_k(builder, load, w_off, k):
    """Sub-block k's codes 0..15 (the caller applies the 6-bit scale): low nibbles of the 32 bytes
    at 16 + 32 * (k // 2) for even k, high nibbles for odd k."""
    v = load(_offset(builder, w_off, 16 + 32 * (k // 2)), 32)
    nib = builder.lshr(v, _const(_I8, 32, 4)) if k % 2 else builder.and_(v, _const(_I8, 32, 15))
    return builder.zext(nib, _vec(_I32, 32))


def _q6_k(builder, load, w_off, k):
    """Block k = 4h + r of a Q6_K super-block: codes q - 32 times the int8 scales of its two 16-value
    sub-blocks 8h + 2r and 8h + 2r + 1 (|w| <= 4096)."""
    h, r = k // 4, k % 4
    ql = load(_offset(builder, w_off, 64 * h + 32 * (r % 2)), 32)
    qh = load(_offset(builder, w_off, 128 + 32 * h), 32)
    lo = builder.and_(builder.lshr(ql, _const(_I8, 32, 4 * (r // 2))), _const(_I8, 32, 15))
    hi = builder.and_(builder.lshr(qh, _const(_I8, 32, 2 * r)), _const(_I8, 32, 3))
    hi = builder.shl(hi, _const(_I8, 32, 4))
    q = builder.sub(builder.or_(lo, hi), _const(_I8, 32, 32))  # -32..31 as signed i8
    sc = builder.sext(load(_offset(builder, w_off, 192 + 8 * h + 2 * r), 2), _vec(_I32, 2))
    sc32 = _shuffle(builder, sc, sc, [0] * 16 + [1] * 16)
    return builder.mul(builder.sext(q, _vec(_I32, 32)), sc32)


dots_q8_0 = _group_intrinsic(_q8_0)
dots_q4_0 = _group_intrinsic(_q4_0)
dots_q4_k = _group_intrinsic(_q4_k)
dots_q6_k = _group_intrinsic(_q6_k)
# One block, for rows whose block count is not a multiple of 8 (Q8_0 / Q4_0 only).
dot1_q8_0 = _group_intrinsic(_q8_0, 1)
dot1_q4_0 = _group_intrinsic(_q4_0, 1)
