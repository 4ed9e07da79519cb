"""Plain reference twins: the oracle for tolerance tests (dequantize, then float64 matmul).

`act_quant_ref` (the bitwise spec of activation quantization) lives in spec.py and is re-exported.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import dequantize

from .contract import FLOAT_TYPES, QK, ExpertLayer
from .spec import act_quant_ref, float_weights

__all__ = ["act_quant_ref", "dequantize_rows", "expert_ffn_ref"]


def dequantize_rows(w: np.ndarray, ggml_type: int) -> np.ndarray:
    """uint8 [..., RB] GGUF blocks -> float32 [..., n] through gguf-py (independent of our decoders)."""
    if ggml_type in FLOAT_TYPES:
        return float_weights(w, ggml_type)
    return dequantize(np.ascontiguousarray(w), ggml_type)


def _fake_quant(a: np.ndarray) -> np.ndarray:
    """What the activation quantizer keeps of a: q * d per block, as float64."""
    q, d, _ = act_quant_ref(a.astype(np.float32))
    blocks = q.reshape(len(a), -1, QK).astype(np.float64) * d[:, :, None].astype(np.float64)
    return blocks.reshape(a.shape)


def expert_ffn_ref(x: np.ndarray, tok: np.ndarray, exp: np.ndarray, layer: ExpertLayer,
                   quantize_acts: bool = False) -> np.ndarray:
    """rows f32 [M, E] = down(silu(gate(x)) * up(x)) per (token, expert) entry, in float64.

    quantize_acts=True rounds x and the hidden vector through the contract's activation quantizer
    first, which isolates the kernels' fp32 ordering error from the int8 quantization error.
    """
    layer.validate()
    use_q = quantize_acts and not layer.is_float
    rows = np.zeros((len(tok), layer.n_embd), np.float64)
    for e in np.unique(exp):
        sel = np.nonzero(exp == e)[0]
        xe = x[tok[sel]].astype(np.float64)
        if use_q:
            xe = _fake_quant(xe)
        g = xe @ dequantize_rows(layer.gate[e], layer.gate_type).astype(np.float64).T
        u = xe @ dequantize_rows(layer.up[e], layer.up_type).astype(np.float64).T
        h = g / (1.0 + np.exp(-g)) * u
        if use_q:
            h = _fake_quant(h)
        rows[sel] = h @ dequantize_rows(layer.down[e], layer.down_type).astype(np.float64).T
    return rows.astype(np.float32)
