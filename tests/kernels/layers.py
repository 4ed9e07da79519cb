"""Random expert layers in real GGUF block bytes, shared by the kernel tests. Imported as
tests.kernels.layers: a module named conftest collides with the other test folders' conftests when one
pytest run holds them all."""

from __future__ import annotations

import functools
import zlib

import numpy as np

from strata_ray.kernels.contract import BF16, F16, F32, Q4_0, Q4_K, Q6_K, Q8_0
from strata_ray.kernels.random_weights import random_layer

N_EMBD = 256
N_FF = 256
# (gate, up, down) type combinations: every quant type as gate/up and as down, plus float layers.
TYPE_SETS = {
    "Q8_0": (Q8_0, Q8_0, Q8_0),
    "Q4_0": (Q4_0, Q4_0, Q4_0),
    "Q4_K": (Q4_K, Q4_K, Q4_K),
    "Q6_K": (Q6_K, Q6_K, Q6_K),
    "Q4_K+Q6_K": (Q4_K, Q4_K, Q6_K),
    "Q8_0+Q4_0": (Q8_0, Q4_0, Q8_0),
}
FLOAT_SETS = {"F32": (F32, F32, F32), "F16": (F16, F16, F16), "BF16+F32": (BF16, BF16, F32)}


@functools.cache
def layer_for(name: str, n_expert: int = 37):
    types = {**TYPE_SETS, **FLOAT_SETS}[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{n_expert}".encode()))
    # Q8_0/Q4_0 weights come from gguf-py's own quantizer; K-quants from random valid blocks.
    from_floats = types[0] in (Q8_0, Q4_0)
    return random_layer(rng, n_expert, N_EMBD, N_FF, types, from_floats=from_floats)


def entries(rng: np.random.Generator, n_tokens: int, n_entries: int, n_expert: int, k: int = 0):
    """(tok, exp) int32 [M]: token-major top-k picks (distinct experts per token) when k > 0,
    else n_entries independent random (token, expert) pairs."""
    if k:
        tok = np.repeat(np.arange(n_tokens), k)
        exp = np.concatenate([rng.choice(n_expert, k, replace=False) for _ in range(n_tokens)])
        return tok.astype(np.int32), exp.astype(np.int32)
    return (rng.integers(0, n_tokens, n_entries).astype(np.int32),
            rng.integers(0, n_expert, n_entries).astype(np.int32))
