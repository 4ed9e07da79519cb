"""Random expert weights in valid GGUF block bytes (tests, kernel benchmarks).

Every bit pattern of the quant blocks is valid except non-finite fp16 scales, so blocks are random
bytes with the scale fields overwritten by finite fp16 values of a chosen magnitude. Q8_0/Q4_0 can
instead come from gguf.quants.quantize of Gaussian values (`from_floats=True`).
"""

from __future__ import annotations

import numpy as np

from .contract import BF16, BLOCK, F16, F32, Q4_0, Q4_K, Q6_K, Q8_0, ExpertLayer, KernelError, type_name

# Typical |value| of a weight for each type's block codes, so random blocks give unit-scale rows.
_CODE_RMS = {Q8_0: 73.0, Q4_0: 4.6, Q4_K: 8.0 * 31.0, Q6_K: 18.0 * 64.0}


def _f16_field(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    v = (scale * rng.uniform(0.5, 1.5, size=shape)).astype(np.float16)
    return v.view(np.uint8).reshape(*shape, 2)


def random_blocks(rng: np.random.Generator, ggml_type: int, shape: tuple[int, ...], std: float = 1.0,
                  from_floats: bool = False) -> np.ndarray:
    """uint8 [*shape[:-1], row_bytes] of weights with elements of about `std`; shape[-1] = n values."""
    *lead, n = shape
    if ggml_type in (F32, F16, BF16) or from_floats:
        vals = (rng.standard_normal(shape) * std).astype(np.float32)
        if ggml_type == F32:
            return vals.view(np.uint8)
        if ggml_type == F16:
            return vals.astype(np.float16).view(np.uint8)
        if ggml_type == BF16:
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        from gguf.quants import quantize  # only this path needs gguf

        return quantize(vals, ggml_type)
    elems, size = BLOCK[ggml_type]
    nblk = n // elems
    raw = rng.integers(0, 256, size=(*lead, nblk, size), dtype=np.uint8)
    scale = std / _CODE_RMS[ggml_type]
    if ggml_type in (Q8_0, Q4_0):
        raw[..., 0:2] = _f16_field(rng, (*lead, nblk), scale)
    elif ggml_type == Q4_K:
        raw[..., 0:2] = _f16_field(rng, (*lead, nblk), scale)
        raw[..., 2:4] = _f16_field(rng, (*lead, nblk), scale * 7.5)  # min term cancels the mean
    elif ggml_type == Q6_K:
        raw[..., 208:210] = _f16_field(rng, (*lead, nblk), scale)
    else:
        raise KernelError(f"no random blocks for {type_name(ggml_type)}")
    return raw.reshape(*lead, nblk * size)


def random_layer(rng: np.random.Generator, n_expert: int, n_embd: int, n_ff: int,
                 types: tuple[int, int, int] = (Q8_0, Q8_0, Q8_0), from_floats: bool = False) -> ExpertLayer:
    """A random ExpertLayer (host numpy) with gate/up rows of ~1/sqrt(E) and down of ~1/sqrt(n_ff)."""
    g_t, u_t, d_t = types
    gate = random_blocks(rng, g_t, (n_expert, n_ff, n_embd), n_embd ** -0.5, from_floats)
    up = random_blocks(rng, u_t, (n_expert, n_ff, n_embd), n_embd ** -0.5, from_floats)
    down = random_blocks(rng, d_t, (n_expert, n_embd, n_ff), n_ff ** -0.5, from_floats)
    layer = ExpertLayer(gate, up, down, g_t, u_t, d_t)
    layer.validate()
    return layer


Q_TYPES_FOR_TESTS = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_K": Q4_K, "Q6_K": Q6_K}
