"""Exact block dots of GGUF weight rows with int8 activation codes, as numba intrinsics in LLVM vector
IR: the integer dots I (contract step 2) of a row's 8-block group, and the tile form that also applies
the fp32 scale terms and adds them, in block order, into the running sums of 16 rows.

Every block's 32 products reduce to <8 x i32> sums of 4 adjacent products (`_dpbusd`: one vpdpbusd
on CPUs with AVX-512 VNNI or AVX-VNNI, else vpmaddubsw + vpmaddwd on AVX2, exact because activation
codes are within +-127 and unsigned weight codes <= 128; else widened multiplies), so the weight
codes stay in bytes: Q4_0/Q4_K nibbles, Q6_K 6-bit codes and Q8_0's w + 128 are unsigned (their
offsets come back through the activation sums; Q8_0 on the avx2 form uses |w| and sign(w) * a, as
w + 128 would overflow its i16 pairs). A group's 8 block vectors fold into one <8 x i32>
with a transposing shuffle tree. Integer sums are exact, so the order is free; the fp32 part follows
contract.py to the letter (separate fmul/fsub/fadd, no fast-math flags, so no FMA). A tile call
takes up to TOKENS activation rows: their code is straight line, so the row's weight codes and
scales are loaded and unpacked once for all of them (LLVM CSE).
"""

from __future__ import annotations

import os

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .contract import Q4_0, Q4_K, Q6_K, Q8_0

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
GROUP = 8  # blocks per group (one K-quant super-block)
ROWS = 16  # weight rows per tile
ROWS_PER_SUM = 8  # rows whose block terms are transposed and summed together (fewer live registers)
HALF_ROWS = ROWS_PER_SUM  # weight rows per half tile (half_dots)
TOKENS = 4  # activation rows per tile call at most (they share the unpacked weight codes)


def _target_features() -> dict[str, bool]:
    """The CPU features numba compiles for: NUMBA_CPU_FEATURES ("+avx2,-avx512f,...") when set (a cache
    built here for another machine, scripts/numba_cache_for.py), else this host's."""
    spec = os.environ.get("NUMBA_CPU_FEATURES", "")
    if not spec:
        return dict(llvm.get_host_cpu_features())
    return {f[1:]: f[0] == "+" for f in spec.split(",") if f[:1] in "+-" and len(f) > 1}


_FEATURES = _target_features()
HAS_VNNI = bool(_FEATURES.get("avx512vnni") and _FEATURES.get("avx512vl")) or bool(_FEATURES.get("avxvnni"))
HAS_AVX2 = bool(_FEATURES.get("avx2"))
DOT_FORM = "vnni" if HAS_VNNI else "avx2" if HAS_AVX2 else "generic"  # of the 4-product sums (_dpbusd)


# Shuffles of two <32 x i8>: both first halves, both second halves.
_FIRST_HALVES, _SECOND_HALVES = [*range(16), *range(32, 48)], [*range(16, 32), *range(48, 64)]


def _vec(ty, n: int):
    return ir.VectorType(ty, n)


_CONSTS: dict[tuple, ir.Constant] = {}


def _const(ty, n: int, values) -> ir.Constant:
    """A <n x ty> constant (values: n of them, or one for every lane). Kept and handed out again: a tile's IR
    asks for the same masks and shuffle indices tens of thousands of times, and llvmlite builds each element
    and renders its text in Python (a third of a cold compile before this cache); a Constant is immutable
    and caches its own text, so one object serves every function and module."""
    vals = tuple(values) if hasattr(values, "__iter__") else (values,) * n
    key = (str(ty), n, vals)
    c = _CONSTS.get(key)
    if c is None:
        c = _CONSTS[key] = ir.Constant(_vec(ty, n), list(vals))
    return c


def _shuffle(builder, x, y, idx):
    return builder.shuffle_vector(x, y, _const(_I32, len(idx), list(idx)))


def _splat(builder, v, n: int):
    """<n x T> copies of lane 0 of the vector v."""
    return _shuffle(builder, v, v, [0] * n)


def _load(builder, base, offset: int, ty):
    """A value of type ty at byte `offset` from the i8* base (no alignment assumed)."""
    ptr = builder.bitcast(builder.gep(base, [ir.Constant(_I64, offset)]), ty.as_pointer())
    return builder.load(ptr, align=1)


def _dpbusd(builder, u, s, form: str, acc=None):
    """<32 x i8> unsigned u, signed s -> <8 x i32>: lane l = acc[l] + sum of u[4l+i] * s[4l+i], i < 4
    (exact; acc defaults to zeros). Forms: "vnni" one vpdpbusd; "avx2" vpmaddubsw (pairs in i16,
    exact here: u <= 128 and |s| <= 127, so |a pair| <= 32512) then vpmaddwd by ones; "generic"
    widened i32 multiplies and pair adds (any bytes)."""
    ty = _vec(_I32, 8)
    if form == "vnni":
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]),
                                            "llvm.x86.avx512.vpdpbusd.256")
        acc = ir.Constant(ty, None) if acc is None else acc
        return builder.call(fn, [acc, builder.bitcast(u, ty), builder.bitcast(s, ty)])
    if form == "avx2":
        b32, w16 = _vec(_I8, 32), _vec(_I16, 16)
        maddubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(w16, [b32, b32]),
                                                 "llvm.x86.avx2.pmadd.ub.sw")
        maddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [w16, w16]),
                                                "llvm.x86.avx2.pmadd.wd")
        p = builder.call(maddwd, [builder.call(maddubs, [u, s]), _const(_I16, 16, 1)])
        return p if acc is None else builder.add(acc, p)
    p = builder.mul(builder.zext(u, _vec(_I32, 32)), builder.sext(s, _vec(_I32, 32)))
    for n in (16, 8):
        even, odd = range(0, 2 * n, 2), range(1, 2 * n, 2)
        p = builder.add(_shuffle(builder, p, p, even), _shuffle(builder, p, p, odd))
    return p if acc is None else builder.add(acc, p)


def _fold(builder, vecs, width: int):
    """Vectors <n x i32> of n // width blocks each (width lanes per block, blocks in lane order) -> one
    <k x i32> of the k blocks' lane sums in order (k a power of two, k <= n)."""
    n = vecs[0].type.count
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


def _transpose(builder, rows):
    """R vectors <K x T> -> K vectors <R x T> (R a power of two): out[k][r] = rows[r][k]."""
    k_lanes, per = rows[0].type.count, 1  # `per` rows per k in the interleaved vectors
    while len(rows) > 1:
        n = k_lanes * per
        idx = [h * n + k * per + r for k in range(k_lanes) for h in range(2) for r in range(per)]
        rows = [_shuffle(builder, x, y, idx) for x, y in zip(rows[0::2], rows[1::2], strict=True)]
        per *= 2
    v = rows[0]
    return [_shuffle(builder, v, v, range(k * per, (k + 1) * per)) for k in range(k_lanes)]


def half_bits_to_f32(builder, h):
    """IEEE half bits in the low 16 bits of i32 (a scalar or a vector) -> f32, exact for finite
    values (subnormals included). Integer ops and one select, no F16C or libm."""
    vec = isinstance(h.type, ir.VectorType)
    n = h.type.count if vec else 0
    i32, f32 = (_vec(_I32, n), _vec(_F32, n)) if vec else (_I32, _F32)
    c = lambda k: ir.Constant(i32, [k] * n if vec else k)  # noqa: E731
    em = builder.and_(h, c(0x7FFF))
    normal = builder.bitcast(builder.add(builder.shl(em, c(13)), c(112 << 23)), f32)
    tiny = ir.Constant(f32, [2.0 ** -24] * n if vec else 2.0 ** -24)
    subnormal = builder.fmul(builder.sitofp(em, f32), tiny)
    mag = builder.select(builder.icmp_signed(">=", em, c(0x400)), normal, subnormal)
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    return builder.bitcast(builder.or_(builder.bitcast(mag, i32), sign), f32)


class _Group:
    """One group of n activation blocks (codes, sums, scales) shared by the rows that meet it."""

    def __init__(self, builder, aq_ptr, n: int, form: str, asum=None, ad=None):
        self.builder, self.n, self.form, self.asum, self.ad = builder, n, form, asum, ad
        self.a = [_load(builder, aq_ptr, 32 * k, _vec(_I8, 32)) for k in range(n)]
        self._neg, self._off32 = None, None

    def halves(self, k):
        """Blocks k, k+1's codes 0..15 side by side, then their codes 16..31: two <32 x i8>."""
        x, y = self.a[k], self.a[k + 1]
        return _shuffle(self.builder, x, y, _FIRST_HALVES), _shuffle(self.builder, x, y, _SECOND_HALVES)

    def neg(self, k):
        if self._neg is None:
            self._neg = [self.builder.neg(a) for a in self.a]
        return self._neg[k]

    def offsets32(self, k):
        """-32 * the sums of 4 adjacent activation codes of halves(k): two <8 x i32>."""
        if self._off32 is None:
            b, ones = self.builder, _const(_I8, 32, 1)
            self._off32 = {j: tuple(b.neg(b.shl(_dpbusd(b, ones, s, self.form), _const(_I32, 8, 5)))
                                    for s in self.halves(j)) for j in range(0, self.n, 2)}
        return self._off32[k]


def _half_at(builder, row, offsets):
    """<len(offsets) x f32> of the fp16 scales at those byte offsets of a row."""
    bits = ir.Constant(_vec(_I16, len(offsets)), None)
    for k, o in enumerate(offsets):
        bits = builder.insert_element(bits, _load(builder, row, o, _I16), ir.Constant(_I32, k))
    return half_bits_to_f32(builder, builder.zext(bits, _vec(_I32, len(offsets))))


# Per weight type: products(b, grp, row) -> (<8 x i32> vectors of lane sums, lanes per block);
# ints(b, grp, row, I) -> (contract I, Q4_K's M or None); scales(b, grp, row) -> (d, dmin or None) as
# <n x f32>. row: i8* at the group's bytes.

def _q8_0_offset(grp) -> bool:
    """Q8_0 codes as w + 128 (unsigned, the 128 * activation sum subtracted in _q8_0_ints), except on
    the avx2 form, whose i16 pair sums would overflow: there |w| meets sign(w) * a."""
    return grp.form != "avx2"


def _q8_0_products(b, grp, row):
    def codes(k):
        return _load(b, row, 34 * k + 2, _vec(_I8, 32))

    if _q8_0_offset(grp):  # w + 128 = w ^ 0x80 as an unsigned byte
        if grp.n == 1:
            return [_dpbusd(b, b.xor(codes(0), _const(_I8, 32, -128)), grp.a[0], grp.form)], 8

        def lo_hi(k):
            x, y = (b.xor(codes(i), _const(_I8, 32, -128)) for i in (k, k + 1))
            return _shuffle(b, x, y, _FIRST_HALVES), _shuffle(b, x, y, _SECOND_HALVES)

        return _pairs(b, grp, lo_hi)

    def signed(k):
        w = codes(k)
        neg = b.icmp_signed("<", w, _const(_I8, 32, 0))
        return _dpbusd(b, b.select(neg, b.neg(w), w), b.select(neg, grp.neg(k), grp.a[k]), grp.form)

    return [signed(k) for k in range(grp.n)], 8


def _q8_0_ints(b, grp, row, isum):
    if not _q8_0_offset(grp):
        return isum, None
    return b.sub(isum, b.shl(grp.asum, _const(_I32, grp.n, 7))), None


def _pairs(b, grp, lo_hi):
    """Blocks taken two at a time: lo_hi(k) -> (codes 0..15 of blocks k and k+1 side by side, codes
    16..31 of both) as <32 x i8> each; one <8 x i32> per pair, 4 lanes per block (the first vpdpbusd's
    sums feed the second, which saves a fold level)."""
    out = []
    for k in range(0, grp.n, 2):
        (u1, u2), (s1, s2) = lo_hi(k), grp.halves(k)
        out.append(_dpbusd(b, u2, s2, grp.form, acc=_dpbusd(b, u1, s1, grp.form)))
    return out, 4


def _q4_0_products(b, grp, row):
    """Codes 0..15 (Q4_0's -8 comes back as -8 * the activation block sum in _q4_0_ints): the low
    nibbles of a block's 16 bytes are its codes 0..15, the high nibbles its codes 16..31."""
    if grp.n == 1:
        v = _load(b, row, 2, _vec(_I8, 16))
        lo, hi = b.and_(v, _const(_I8, 16, 15)), b.lshr(v, _const(_I8, 16, 4))
        return [_dpbusd(b, _shuffle(b, lo, hi, range(32)), grp.a[0], grp.form)], 8

    def lo_hi(k):
        x, y = _load(b, row, 18 * k + 2, _vec(_I8, 16)), _load(b, row, 18 * k + 20, _vec(_I8, 16))
        v = _shuffle(b, x, y, range(32))
        return b.and_(v, _const(_I8, 32, 15)), b.lshr(v, _const(_I8, 32, 4))

    return _pairs(b, grp, lo_hi)


def _q4_0_ints(b, grp, row, isum):
    return b.sub(isum, b.shl(grp.asum, _const(_I32, grp.n, 3))), None


def _q4_k_products(b, grp, row):
    """Sub-block codes 0..15: the 32 bytes at 16 + 32 * (k // 2) hold sub-block k (even k) in their low
    nibbles and sub-block k + 1 in their high nibbles."""
    def lo_hi(k):
        v = _load(b, row, 16 + 16 * k, _vec(_I8, 32))
        lo, hi = b.and_(v, _const(_I8, 32, 15)), b.lshr(v, _const(_I8, 32, 4))
        return _shuffle(b, lo, hi, _FIRST_HALVES), _shuffle(b, lo, hi, _SECOND_HALVES)

    return _pairs(b, grp, lo_hi)


def _q4_k_scales_mins(b, row):
    """(sc, m) <8 x i32>: the 6-bit sub-block scales and mins from the 12 bytes at 4."""
    s = b.zext(_load(b, row, 4, _vec(_I8, 16)), _vec(_I32, 16))
    z = ir.Constant(_vec(_I32, 16), None)
    zero = 16  # a lane of z
    top2 = lambda idx: b.shl(b.lshr(_shuffle(b, s, z, idx), _const(_I32, 8, 6)), _const(_I32, 8, 4))  # noqa: E731
    x = _shuffle(b, s, z, [0, 1, 2, 3, 8, 9, 10, 11])
    sc = b.or_(b.and_(x, _const(_I32, 8, [63] * 4 + [15] * 4)), top2([zero] * 4 + [0, 1, 2, 3]))
    y = b.lshr(_shuffle(b, s, z, [4, 5, 6, 7, 8, 9, 10, 11]), _const(_I32, 8, [0] * 4 + [4] * 4))
    m = b.or_(b.and_(y, _const(_I32, 8, 63)), top2([zero] * 4 + [4, 5, 6, 7]))
    return sc, m


def _q4_k_ints(b, grp, row, isum):
    sc, m = _q4_k_scales_mins(b, row)
    return b.mul(isum, sc), b.mul(m, grp.asum) if grp.asum is not None else None


def _q6_k_codes(b, row, k):
    """Block k = 4h + r of a Q6_K super-block: its 32 unsigned codes q = 0..63, 4 low bits from ql and
    2 high bits from qh."""
    h, r = k // 4, k % 4
    ql = _load(b, row, 64 * h + 32 * (r % 2), _vec(_I8, 32))
    qh = _load(b, row, 128 + 32 * h, _vec(_I8, 32))
    lo = b.and_(b.lshr(ql, _const(_I8, 32, 4 * (r // 2))), _const(_I8, 32, 15))
    hi = b.shl(b.and_(b.lshr(qh, _const(_I8, 32, 2 * r)), _const(_I8, 32, 3)), _const(_I8, 32, 4))
    return b.or_(lo, hi)


def _pack_i16(b, p1, p2, form: str):
    """Two <8 x i32> whose lanes fit in i16 -> <16 x i16> [p1 0..3, p2 0..3, p1 4..7, p2 4..7] (exact):
    one vpackssdw (its 128-bit lanes give that order) on AVX2, else truncations and a shuffle."""
    if form in ("vnni", "avx2"):
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(_vec(_I16, 16), [_vec(_I32, 8)] * 2),
                                            "llvm.x86.avx2.packssdw")
        return b.call(fn, [p1, p2])
    t1, t2 = b.trunc(p1, _vec(_I16, 8)), b.trunc(p2, _vec(_I16, 8))
    return _shuffle(b, t1, t2, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


def _madd_i16(b, x, y, form: str):
    """<16 x i16> x, y -> <8 x i32>: lane l = x[2l] y[2l] + x[2l+1] y[2l+1] (exact for |x|, |y| < 2^15
    short of both -2^15): one vpmaddwd on AVX2, else widened multiplies and pair adds."""
    if form in ("vnni", "avx2"):
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(_vec(_I32, 8), [_vec(_I16, 16)] * 2),
                                            "llvm.x86.avx2.pmadd.wd")
        return b.call(fn, [x, y])
    p = b.mul(b.sext(x, _vec(_I32, 16)), b.sext(y, _vec(_I32, 16)))
    return b.add(_shuffle(b, p, p, range(0, 16, 2)), _shuffle(b, p, p, range(1, 16, 2)))


def _q6_k_products(b, grp, row):
    """Blocks in pairs (k, k + 1), 4 lanes per block as in _pairs: (q - 32) * the int8 scale of each
    16-value half; the -32 enters as the dpbusd accumulator -32 * (sums of 4 activation codes). A lane's
    sum of 4 (q - 32) a is within +-16256, so the two halves' lanes pack into i16 and one vpmaddwd applies
    the scales (the products stay exact below 2^31): 3 multiply operations a pair instead of 2 vpdpbusd
    and 2 vpmulld (session 11, 2-core VM, the tile hot in L2: 19.2 -> 20.3 GB/s a core, the same sums)."""
    out = []
    for k in range(0, grp.n, 2):
        x, y = _q6_k_codes(b, row, k), _q6_k_codes(b, row, k + 1)
        (s1, s2), (o1, o2) = grp.halves(k), grp.offsets32(k)
        h, r = k // 4, k % 4
        sc = b.sext(_load(b, row, 192 + 8 * h + 2 * r, _vec(_I8, 4)), _vec(_I16, 4))  # k: 0, 1; k + 1: 2, 3
        p1 = _dpbusd(b, _shuffle(b, x, y, _FIRST_HALVES), s1, grp.form, acc=o1)  # halves 0 of k, k + 1
        p2 = _dpbusd(b, _shuffle(b, x, y, _SECOND_HALVES), s2, grp.form, acc=o2)  # halves 1
        scales = _shuffle(b, sc, sc, [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4)  # the packed lanes' halves
        out.append(_madd_i16(b, _pack_i16(b, p1, p2, grp.form), scales, grp.form))
    return out, 4


def _plain_ints(b, grp, row, isum):
    return isum, None


def _block_scales(size):
    return lambda b, grp, row: (_half_at(b, row, [size * k for k in range(grp.n)]), None)


def _super_scales(d_off, with_min):
    def scales(b, grp, row):
        if not with_min:
            return _splat(b, _half_at(b, row, [d_off]), grp.n), None
        both = _half_at(b, row, [d_off, d_off + 2])  # one vector decode for d and dmin
        return _shuffle(b, both, both, [0] * grp.n), _shuffle(b, both, both, [1] * grp.n)
    return scales


# type -> (products, ints, scales, bytes per group of 8 blocks)
_TYPES = {
    Q8_0: (_q8_0_products, _q8_0_ints, _block_scales(34), 8 * 34),
    Q4_0: (_q4_0_products, _q4_0_ints, _block_scales(18), 8 * 18),
    Q4_K: (_q4_k_products, _q4_k_ints, _super_scales(0, True), 144),
    Q6_K: (_q6_k_products, _plain_ints, _super_scales(208, False), 210),
}


def _byte_ptr(context, builder, aryty, ary, inds):
    ary = context.make_array(aryty)(context, builder, ary)
    ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds)
    return builder.bitcast(ptr, _I8.as_pointer())


def _row_ints(builder, grp, spec, row):
    products, ints, _, _ = spec
    isum = _fold(builder, *products(builder, grp, row))
    return ints(builder, grp, row, isum)


def _prefetch(builder, base, offset, n_bytes: int) -> None:
    """Prefetch (to L2) the cache lines of n_bytes at base + offset."""
    ptr_ty = _I8.as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [ptr_ty, _I32, _I32, _I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    start = builder.gep(base, [offset])
    for k in [*range(0, n_bytes, 64), n_bytes - 1]:
        args = [builder.gep(start, [ir.Constant(_I64, k)]), ir.Constant(_I32, 0), ir.Constant(_I32, 2),
                ir.Constant(_I32, 1)]
        builder.call(fn, args)


def _as_i64(builder, v):
    """Integer arguments widened to i64 (array arguments pass through)."""
    return builder.sext(v, _I64) if isinstance(v.type, ir.IntType) and v.type.width < 64 else v


def _check(arrays, ndims) -> None:
    for a, nd in zip(arrays, ndims, strict=True):
        if not (isinstance(a, types.Array) and a.ndim == nd and a.layout == "C"):
            raise TypeError(f"block dots take C-contiguous {nd}-D arrays, got {a}")


def row_dots_intrinsic(wtype: int, n: int = GROUP, form: str = DOT_FORM):
    """f(row, g, aq, asum, out): out[g*n + k] = the contract's I of block g*n + k of a weight row
    (uint8 [RB]) with activation codes aq int8 [nb*32] (asum int32 [nb]: their block sums), k < n."""
    spec = _TYPES[wtype]
    gbytes = spec[3] // (GROUP // n)

    def typer(typingctx, row, g, aq, asum, out):
        _check((row, aq, asum, out), (1, 1, 1, 1))

        def codegen(context, builder, sig, args):
            row_v, g_v, aq_v, asum_v, out_v = args
            g_v = _as_i64(builder, g_v)
            b0 = builder.mul(g_v, ir.Constant(_I64, n))
            ptr = lambda i, v, idx: _byte_ptr(context, builder, sig.args[i], v, [idx])  # noqa: E731
            asum_vec = _load(builder, ptr(3, asum_v, b0), 0, _vec(_I32, n))
            aq_ptr = ptr(2, aq_v, builder.mul(b0, ir.Constant(_I64, 32)))
            grp = _Group(builder, aq_ptr, n, form, asum=asum_vec)
            row = ptr(0, row_v, builder.mul(g_v, ir.Constant(_I64, gbytes)))
            isum, _ = _row_ints(builder, grp, spec, row)
            dst = builder.bitcast(ptr(4, out_v, b0), isum.type.as_pointer())
            builder.store(isum, dst, align=4)
            return context.get_dummy_value()

        return types.none(row, g, aq, asum, out), codegen

    return intrinsic(typer)


def _tile_terms(builder, spec, grps, row, ad_vecs):
    """One weight row's <n x f32> block terms with each token's group. The tokens' code is straight
    line in one basic block, so LLVM's CSE loads, unpacks and decodes the row's weight codes and fp16
    scales once for all of them; each token's term is the same operation sequence as alone."""
    n = grps[0].n
    d, dmin = spec[2](builder, grps[0], row)
    terms = []
    for grp, ad_vec in zip(grps, ad_vecs, strict=True):
        isum, msum = _row_ints(builder, grp, spec, row)
        t = builder.fmul(builder.sitofp(isum, _vec(_F32, n)), builder.fmul(d, ad_vec))
        if msum is not None:
            m_term = builder.fmul(builder.sitofp(msum, _vec(_F32, n)), builder.fmul(dmin, ad_vec))
            t = builder.fsub(t, m_term)
        terms.append(t)
    return terms


def tile_dots_intrinsic(wtype: int, n: int = GROUP, form: str = DOT_FORM, rows: int = ROWS):
    """f(w, r0, g, aq, ad, asum, arow, j0, count): for the `rows` (ROWS, or HALF_ROWS) weight rows w[r0 + i]
    (w uint8 [R, RB]) and the count (1..TOKENS) activation rows arow[j0 + t] (aq int8 [N, nb*32], ad f32
    [N, nb], asum int32 [N, nb]), add the contract's terms t_b of blocks b = g*n .. g*n + n - 1, in that
    order, into acc[j0 + t, i] (acc f32 [M, rows]). The tokens share the row's weight codes and scales. A
    row's terms are the same operations in either width: the same bits."""
    if rows % ROWS_PER_SUM or not 0 < rows <= ROWS:
        raise ValueError(f"a tile is a multiple of {ROWS_PER_SUM} rows up to {ROWS}, not {rows}")
    spec = _TYPES[wtype]
    gbytes = spec[3] // (GROUP // n)

    def typer(typingctx, w, r0, g, aq, ad, asum, arow, j0, count, acc):
        _check((w, aq, ad, asum, acc), (2, 2, 2, 2, 2))
        if not (isinstance(arow, types.Array) and arow.ndim == 1 and isinstance(arow.dtype, types.Integer)):
            raise TypeError(f"tile dots take a 1-D integer array of activation rows, got {arow}")

        def codegen(context, builder, sig, args):
            w_v, r0_v, g_v, aq_v, ad_v, asum_v, arow_v, j0_v, count_v, acc_v = (
                _as_i64(builder, v) for v in args)
            b0 = builder.mul(g_v, ir.Constant(_I64, n))
            ptr = lambda i, v, idx: _byte_ptr(context, builder, sig.args[i], v, idx)  # noqa: E731
            row0 = ptr(0, w_v, [r0_v, builder.mul(g_v, ir.Constant(_I64, gbytes))])
            w_ary = context.make_array(sig.args[0])(context, builder, w_v)
            stride = cgutils.unpack_tuple(builder, w_ary.strides, 2)[0]
            if n == GROUP:  # the same share of the next tile's bytes (rows r0 + rows.., contiguous) to L2
                # (unconditionally: a branch on the first token chunk cost Q4_K 1-token calls ~8%)
                _prefetch(builder, builder.gep(row0, [builder.mul(stride, ir.Constant(_I64, rows))]),
                          builder.mul(g_v, ir.Constant(_I64, (rows - 1) * gbytes)), rows * gbytes)
            arow_ary = context.make_array(sig.args[6])(context, builder, arow_v)
            done = builder.append_basic_block("tile_done")
            switch = builder.switch(count_v, done)
            for nt in range(1, TOKENS + 1):
                block = builder.append_basic_block(f"tile_{nt}_tokens")
                switch.add_case(ir.Constant(_I64, nt), block)
                builder.position_at_end(block)
                js, grps, ad_vecs = [], [], []
                for t in range(nt):
                    j = builder.add(j0_v, ir.Constant(_I64, t))
                    a_v = _as_i64(builder, builder.load(cgutils.get_item_pointer(
                        context, builder, sig.args[6], arow_ary, [j])))
                    ad_vec = _load(builder, ptr(4, ad_v, [a_v, b0]), 0, _vec(_F32, n))
                    asum_vec = _load(builder, ptr(5, asum_v, [a_v, b0]), 0, _vec(_I32, n))
                    aq_ptr = ptr(3, aq_v, [a_v, builder.mul(b0, ir.Constant(_I64, 32))])
                    grps.append(_Group(builder, aq_ptr, n, form, asum=asum_vec, ad=ad_vec))
                    js.append(j)
                    ad_vecs.append(ad_vec)
                for half in range(0, rows, ROWS_PER_SUM):
                    ptrs = [builder.gep(row0, [builder.mul(stride, ir.Constant(_I64, i))])
                            for i in range(half, half + ROWS_PER_SUM)]
                    terms = [_tile_terms(builder, spec, grps, row, ad_vecs) for row in ptrs]  # [row][token]
                    for t, j in enumerate(js):
                        dst = ptr(9, acc_v, [j, ir.Constant(_I64, half)])
                        dst = builder.bitcast(dst, _vec(_F32, ROWS_PER_SUM).as_pointer())
                        s = builder.load(dst, align=4)
                        for t_b in _transpose(builder, [r[t] for r in terms]):  # block order
                            s = builder.fadd(s, t_b)
                        builder.store(s, dst, align=4)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.none(w, r0, g, aq, ad, asum, arow, j0, count, acc), codegen

    return intrinsic(typer)


row_dots = {t: row_dots_intrinsic(t) for t in _TYPES}
tile_dots = {t: tile_dots_intrinsic(t) for t in _TYPES}
# One block, for rows whose block count is not a multiple of 8 (Q8_0 / Q4_0 only).
row_dot1 = {t: row_dots_intrinsic(t, 1) for t in (Q8_0, Q4_0)}
tile_dot1 = {t: tile_dots_intrinsic(t, 1) for t in (Q8_0, Q4_0)}
# Half tiles: the CPU team's gate/up units (blocks.tile_sums_half), so a layer's few experts split more evenly
half_dots = {t: tile_dots_intrinsic(t, rows=HALF_ROWS) for t in _TYPES}
half_dot1 = {t: tile_dots_intrinsic(t, 1, rows=HALF_ROWS) for t in (Q8_0, Q4_0)}
