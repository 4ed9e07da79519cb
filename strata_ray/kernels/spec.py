"""The arithmetic contract written as plain vectorised numpy: the bit-exact spec the numba and
Triton kernels are tested against (see contract.py for the operation sequence).

Slow (it materialises every block's integer dot), meant for tests and small shapes.
"""

from __future__ import annotations

import numpy as np

from .contract import (
    BF16,
    EXP_HI,
    EXP_LO,
    EXP_POLY,
    F16,
    F32,
    LN2_HI,
    LN2_LO,
    LOG2E,
    Q4_0,
    Q4_K,
    Q6_K,
    Q8_0,
    Q_MAX,
    QK,
    RINT_MAGIC,
    TINY,
    ExpertLayer,
    KernelError,
    type_name,
)

f32 = np.float32


def rint_ref(v: np.ndarray) -> np.ndarray:
    """Round half to even via the magic constant (valid for |v| < 2^22)."""
    return (v.astype(f32) + RINT_MAGIC) - RINT_MAGIC


def act_quant_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x f32 [N, n] -> (q int8 [N, n], d f32 [N, n/32], s int32 [N, n/32]), contract step 1."""
    x = np.ascontiguousarray(x, dtype=f32)
    n_rows, n = x.shape
    if n % QK:
        raise KernelError(f"activation width {n} is not a multiple of {QK}")
    xb = x.reshape(n_rows, n // QK, QK)  # [N, nb, 32]
    finite = np.isfinite(xb).all(axis=2)  # [N, nb]; a block with a NaN or an infinity is poisoned
    amax = np.where(finite, np.abs(np.where(np.isfinite(xb), xb, f32(0))).max(axis=2), f32(0))  # [N, nb]
    live = amax >= TINY
    d = np.where(finite, np.where(live, amax / Q_MAX, f32(0)), f32(np.nan)).astype(f32)
    safe_d = np.where(live, d, f32(1))
    q = rint_ref(xb / safe_d[:, :, None])
    q = np.where(live[:, :, None], q, f32(0)).astype(np.int8)
    s = q.astype(np.int32).sum(axis=2, dtype=np.int32)
    return q.reshape(n_rows, n), d, s


def fexp_ref(x: np.ndarray) -> np.ndarray:
    """The contract's fixed exp (step 4), elementwise on f32."""
    x = np.minimum(np.maximum(np.asarray(x, dtype=f32), EXP_LO), EXP_HI)
    n = rint_ref(x * LOG2E)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = EXP_POLY[6]
    for c in EXP_POLY[5::-1]:
        p = p * r
        p = p + c
    # 2^n from exponent bits: n in [-124, 127] here, so the result stays normal (a NaN input's n casts to
    # some integer: its p is NaN, and so is the result)
    with np.errstate(invalid="ignore"):
        two_n = ((n.astype(np.int32) + 127) << 23).astype(np.int32).view(f32)
    return (p * two_n).astype(f32)


def swiglu_ref(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """h = (g / (1 + fexp(-g))) * u, contract step 3."""
    g = g.astype(f32)
    return ((g / (f32(1) + fexp_ref(-g))) * u).astype(f32)


def _f16(lo_hi: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(lo_hi).view(np.float16)[..., 0].astype(f32)


def decode_int_blocks(w: np.ndarray, ggml_type: int):
    """uint8 [R, RB] -> (wi int32 [R, nb, 32] scaled integer weights, d f32 [R, nb],
    dmin f32 [R, nb], m int32 [R, nb]): block b contributes float(sum wi*q)*(d*ad) - float(m*s)*(dmin*ad)."""
    rows = w.shape[0]
    if ggml_type in (Q8_0, Q4_0):
        size = 34 if ggml_type == Q8_0 else 18
        blk = w.reshape(rows, -1, size)
        d = _f16(blk[:, :, 0:2])
        if ggml_type == Q8_0:
            wi = blk[:, :, 2:].view(np.int8).astype(np.int32)
        else:
            qs = blk[:, :, 2:].astype(np.int32)
            wi = np.concatenate([qs & 0xF, qs >> 4], axis=2) - 8
        zeros = np.zeros(d.shape, np.int32)
        return wi, d, d * 0, zeros
    if ggml_type == Q4_K:
        blk = w.reshape(rows, -1, 144)
        nsb = blk.shape[1]
        d, dmin = _f16(blk[:, :, 0:2]), _f16(blk[:, :, 2:4])
        sc_b = blk[:, :, 4:16].astype(np.int32)  # [R, nsb, 12]
        sc = np.empty((rows, nsb, 8), np.int32)
        m = np.empty((rows, nsb, 8), np.int32)
        for j in range(8):
            if j < 4:
                sc[:, :, j] = sc_b[:, :, j] & 63
                m[:, :, j] = sc_b[:, :, j + 4] & 63
            else:
                sc[:, :, j] = (sc_b[:, :, j + 4] & 0xF) | ((sc_b[:, :, j - 4] >> 6) << 4)
                m[:, :, j] = (sc_b[:, :, j + 4] >> 4) | ((sc_b[:, :, j] >> 6) << 4)
        qs = blk[:, :, 16:].astype(np.int32).reshape(rows, nsb, 4, 32)
        nib = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(rows, nsb, 8, 32)  # sub-block 2g, 2g+1
        wi = (nib * sc[:, :, :, None]).reshape(rows, nsb * 8, 32)
        rep = lambda a: np.repeat(a, 8, axis=1)
        return wi, rep(d), rep(dmin), m.reshape(rows, nsb * 8)
    if ggml_type == Q6_K:
        blk = w.reshape(rows, -1, 210)
        nsb = blk.shape[1]
        ql = blk[:, :, 0:128].astype(np.int32)
        qh = blk[:, :, 128:192].astype(np.int32)
        sc = blk[:, :, 192:208].view(np.int8).astype(np.int32)  # [R, nsb, 16]
        d = _f16(blk[:, :, 208:210])
        q = np.empty((rows, nsb, 256), np.int32)
        for h in range(2):
            l_lo, l_hi = ql[:, :, 64 * h:64 * h + 32], ql[:, :, 64 * h + 32:64 * h + 64]
            hb = qh[:, :, 32 * h:32 * h + 32]
            base = 128 * h
            q[:, :, base:base + 32] = (l_lo & 0xF) | (((hb >> 0) & 3) << 4)
            q[:, :, base + 32:base + 64] = (l_hi & 0xF) | (((hb >> 2) & 3) << 4)
            q[:, :, base + 64:base + 96] = (l_lo >> 4) | (((hb >> 4) & 3) << 4)
            q[:, :, base + 96:base + 128] = (l_hi >> 4) | (((hb >> 6) & 3) << 4)
        wi = (q - 32).reshape(rows, nsb, 16, 16) * sc[:, :, :, None]
        zeros = np.zeros((rows, nsb * 8), np.int32)
        return wi.reshape(rows, nsb * 8, 32), np.repeat(d, 8, axis=1), zeros.astype(f32), zeros
    raise KernelError(f"no integer block decoding for {type_name(ggml_type)}")


def float_weights(w: np.ndarray, ggml_type: int) -> np.ndarray:
    """uint8 [..., RB] of F32/F16/BF16 -> f32 [..., n] (exact)."""
    w = np.ascontiguousarray(w)
    if ggml_type == F32:
        return w.view(f32)
    if ggml_type == F16:
        return w.view(np.float16).astype(f32)
    if ggml_type == BF16:
        return (w.view(np.uint16).astype(np.uint32) << 16).view(f32)
    raise KernelError(f"{type_name(ggml_type)} is not a float weight type")


def matmul_spec(w: np.ndarray, ggml_type: int, act: np.ndarray) -> np.ndarray:
    """Contract step 2 for weight rows uint8 [R, RB] and activations f32 [M, n] -> f32 [M, R]."""
    if ggml_type in (F32, F16, BF16):
        wf = float_weights(w, ggml_type).reshape(w.shape[0], -1, QK)  # [R, nb, 32]
        a = act.astype(f32).reshape(act.shape[0], -1, QK)  # [M, nb, 32]
        acc = np.zeros((act.shape[0], w.shape[0]), f32)
        for b in range(wf.shape[1]):
            t = np.zeros_like(acc)
            for i in range(QK):
                t = t + a[:, None, b, i] * wf[None, :, b, i]
            acc = acc + t
        return acc
    q, ad, s = act_quant_ref(act)
    wi, d, dmin, m = decode_int_blocks(w, ggml_type)
    q = q.reshape(q.shape[0], -1, QK).astype(np.int64)
    isum = np.einsum("mbi,rbi->mrb", q, wi.astype(np.int64)).astype(f32)  # exact: |I| < 2^24
    acc = np.zeros((act.shape[0], w.shape[0]), f32)
    for b in range(wi.shape[1]):
        t = isum[:, :, b] * (d[None, :, b] * ad[:, b, None])
        if ggml_type == Q4_K:
            msum = (m[None, :, b] * s[:, b, None]).astype(f32)
            t = t - msum * (dmin[None, :, b] * ad[:, b, None])
        acc = acc + t
    return acc


def expert_ffn_spec(x: np.ndarray, tok: np.ndarray, exp: np.ndarray, layer: ExpertLayer) -> np.ndarray:
    """Contract step 3 for every entry: rows f32 [M, E] (bit-exact twin of expert_ffn_cpu)."""
    layer.validate()
    rows = np.zeros((len(tok), layer.n_embd), f32)
    for e in np.unique(exp):
        sel = np.nonzero(exp == e)[0]
        xe = x[tok[sel]].astype(f32)
        g = matmul_spec(layer.gate[e], layer.gate_type, xe)
        u = matmul_spec(layer.up[e], layer.up_type, xe)
        rows[sel] = matmul_spec(layer.down[e], layer.down_type, swiglu_ref(g, u))
    return rows
