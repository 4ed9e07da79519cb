"""GGML block formats the engine runs: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K.

Layouts follow ggml `ggml-common.h` / `ggml-quants.c` (reference notes: model-format.md §1.6).
Dequantization does the float32 arithmetic in the same order as ggml (`(d * scale) * q - dmin * m`), so it
equals gguf.quants.dequantize bit for bit. Blocks run along the last numpy axis (ggml ne[0]); a row of n
elements is n / elems consecutive blocks.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from strata_ray.model.hparams import ModelFormatError

T = GGMLQuantizationType
SUPPORTED = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K)
BLOCK: dict[int, tuple[int, int]] = {int(t): GGML_QUANT_SIZES[t] for t in SUPPORTED}  # type -> (elems, bytes)
QK_K = 256
_CHUNK_BLOCKS = 1 << 16  # bounds the temporaries of one vectorised step (~64k blocks)


def type_name(t: int) -> str:
    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"type{t}"


def row_bytes(n: int, t: int) -> int:
    """Bytes of a row of n elements of ggml type t (any type gguf knows)."""
    elems, size = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
    if n % elems:
        raise ModelFormatError(f"row of {n} elements is not a multiple of the {type_name(t)} block ({elems})")
    return n // elems * size


def _check_supported(t: int, what: str) -> None:
    if t not in BLOCK:
        names = ", ".join(x.name for x in SUPPORTED)
        raise ModelFormatError(f"{what} has unsupported type {type_name(t)} (supported: {names})")


# ---- dequantization: uint8 blocks [nb, bytes] -> float32 [nb, elems] ---------------------------------------


def _f16(b: np.ndarray) -> np.ndarray:  # [nb, 2] bytes -> float32 [nb, 1]
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, :2])  # [nb, 1]
    return b[:, 2:].view(np.int8).astype(np.float32) * d


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, :2])
    qs = b[:, 2:]  # [nb, 16]: low nibbles = elems 0..15, high nibbles = elems 16..31
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _q4_k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes -> 6-bit (scale, min) of the 8 sub-blocks, uint8 [nb, 8] each (get_scale_min_k4)."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def q4_k_parts(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K blocks uint8 [nb, 144] -> (codes uint8 [nb, 256] in 0..15, ds f32 [nb, 8], dm f32 [nb, 8]): value
    e of sub-block j is f32(ds[j] * code) - dm[j] (ds = f32(d * sc), dm = f32(dmin * m), as ggml)."""
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # [nb, 1]
    sc, mn = _q4_k_scale_min(b[:, 4:16])
    qs = b[:, 16:].reshape(nb, 4, 1, 32)  # 4 groups of 64 elems: low nibbles first 32, high nibbles next 32
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(nb, QK_K)
    return q, d * sc.astype(np.float32), dmin * mn.astype(np.float32)


def q6_k_parts(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks uint8 [nb, 210] -> (codes int8 [nb, 256] in -32..31, ds f32 [nb, 16]): value e of 16-value
    group j is f32(ds[j] * code) (ds = f32(d * sc), as ggml)."""
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 1, 64)  # per half h: ql[64h : 64h+64]
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)  # per half h: qh[32h : 32h+32]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # [nb, 16], one per 16 elems
    d = _f16(b[:, 208:210])  # d is the LAST field
    # quarter k of a half (32 elems): low nibbles of ql[0:32], ql[32:64], then high nibbles; qh bits 2k..2k+1
    low4 = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(nb, 2, 4, 32)
    high2 = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low4 | (high2 << 4)).astype(np.int8) - np.int8(32)
    return q.reshape(nb, QK_K), d * sc


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    q, ds, dm = q4_k_parts(b)
    nb = b.shape[0]
    return (ds[:, :, None] * q.reshape(nb, 8, 32).astype(np.float32) - dm[:, :, None]).reshape(nb, QK_K)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    q, ds = q6_k_parts(b)
    nb = b.shape[0]
    return (ds[:, :, None] * q.reshape(nb, 16, 16).astype(np.float32)).reshape(nb, QK_K)


def _deq_bf16(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


_DEQUANT_BLOCKS = {
    T.Q8_0: _deq_q8_0,
    T.Q4_0: _deq_q4_0,
    T.Q4_K: _deq_q4_k,
    T.Q6_K: _deq_q6_k,
    T.BF16: _deq_bf16,
}


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw GGUF data (uint8 blocks, or the typed F32/F16 view) -> float32 [shape].

    F32 input is returned as a view (no copy) when it already is float32.
    """
    _check_supported(ggml_type, "tensor")
    t = GGMLQuantizationType(ggml_type)
    data = np.asarray(data)
    if t == T.F32:
        return (data if data.dtype == np.float32 else data.view(np.float32)).reshape(shape)
    if t == T.F16:
        return data.view(np.float16).astype(np.float32).reshape(shape)
    elems, size = BLOCK[t]
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)  # [nb, bytes]
    out = np.empty((blocks.shape[0], elems), dtype=np.float32)
    fn = _DEQUANT_BLOCKS[t]
    for s in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[s : s + _CHUNK_BLOCKS] = fn(blocks[s : s + _CHUNK_BLOCKS])
    return out.reshape(shape)


def dequantize_tensor(info) -> np.ndarray:
    """A TensorInfo's data -> float32 [info.shape]; ModelFormatError naming the tensor if unsupported."""
    _check_supported(info.ggml_type, f"tensor {info.name}")
    return dequantize(info.data, info.ggml_type, info.shape)


# ---- quantization: float32 [..., n] -> uint8 [..., row_bytes] ----------------------------------------------


def _round(x: np.ndarray) -> np.ndarray:
    return np.floor(x + 0.5)  # half up: the encoders only need valid blocks, not ggml's exact choice


def _scale_f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale -> (fp16 bytes [nb, 2], the float32 value the decoder will see [nb])."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def _quant_q4_k(x: np.ndarray) -> np.ndarray:
    """Asymmetric 4-bit: per sub-block of 32, y = (d*sc) * q - dmin*m with q in 0..15, 6-bit sc/m."""
    nb = x.shape[0]
    sub = x.reshape(nb, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)  # [nb, 8]; keep 0 representable
    scale = (sub.max(axis=2) - lo) / 15
    d_bytes, d = _scale_f16(scale.max(axis=1) / 63)
    dmin_bytes, dmin = _scale_f16(-lo.min(axis=1) / 63)
    sc = np.clip(_round(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(_round(_safe_div(-lo, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc.astype(np.float32)  # what the decoder multiplies by
    offset = dmin[:, None] * mn.astype(np.float32)
    q = np.clip(_round(_safe_div(sub + offset[:, :, None], step[:, :, None])), 0, 15).astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )
    q = q.reshape(nb, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([d_bytes, dmin_bytes, scales, qs], axis=1)


def _quant_q6_k(x: np.ndarray) -> np.ndarray:
    """Symmetric 6-bit: per sub-block of 16, y = (d*sc) * q with q in -32..31 and int8 sc."""
    nb = x.shape[0]
    sub = x.reshape(nb, 16, 16)
    idx = np.abs(sub).argmax(axis=2)[:, :, None]
    scale = np.take_along_axis(sub, idx, axis=2)[:, :, 0] / -32  # signed: the extreme element maps to q = -32
    d_bytes, d = _scale_f16(np.abs(scale).max(axis=1) / 127)
    sc = np.clip(_round(_safe_div(scale, d[:, None])), -127, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = np.clip(_round(_safe_div(sub, step[:, :, None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(nb, 2, 4, 32)  # half h, quarter k (32 elems each)
    lo, hi = q & 0x0F, q >> 4
    ql = np.concatenate(
        [lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2
    )  # [nb, 2, 64]
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [nb, 2, 32]
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), d_bytes], axis=1)


_QUANT_BLOCKS = {T.Q4_K: _quant_q4_k, T.Q6_K: _quant_q6_k}


def quantize(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., row_bytes(n)] blocks of ggml_type (n a multiple of the block)."""
    _check_supported(ggml_type, "quantize target")
    t = GGMLQuantizationType(ggml_type)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[-1] if x.ndim else 1
    out_shape = (*x.shape[:-1], row_bytes(n, t))
    if t == T.F32:
        return x.view(np.uint8).reshape(out_shape)
    if t not in _QUANT_BLOCKS:  # F16, BF16, Q8_0, Q4_0: gguf's numpy encoders (Q8_0 is bit-exact with ggml)
        return np.ascontiguousarray(gguf_quants.quantize(x, t)).view(np.uint8).reshape(out_shape)
    elems = BLOCK[t][0]
    blocks = x.reshape(-1, elems)
    out = np.empty((blocks.shape[0], BLOCK[t][1]), dtype=np.uint8)
    for s in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[s : s + _CHUNK_BLOCKS] = _QUANT_BLOCKS[t](blocks[s : s + _CHUNK_BLOCKS])
    return out.reshape(out_shape)
