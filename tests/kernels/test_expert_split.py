"""The split decode tile (expert_gpu: block terms, then ordered sums) under Triton's CPU interpreter: rows
bit-identical to the numba rows for every quant type, at 1 and 5 entries and ragged block counts (CI runs
this on CPU machines with triton; the GPU run is tests/kernels/test_expert_gpu.py, -m gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata_ray.kernels.contract import Q4_0, Q4_K, Q6_K, Q8_0, ExpertLayer
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.kernels.random_weights import random_layer
from tests.kernels.triton_interpret import interpret

N_EXPERT = 3
TYPES = {"Q8_0": (Q8_0,) * 3, "Q4_0": (Q4_0,) * 3, "Q4_K": (Q4_K,) * 3, "Q6_K": (Q6_K,) * 3,
         "Q4_K+Q6_K": (Q4_K, Q4_K, Q6_K)}


def _layer(name: str, n_embd: int, n_ff: int) -> ExpertLayer:
    types = TYPES[name]
    rng = np.random.default_rng(sum(map(ord, name)) + n_embd)
    layer = random_layer(rng, N_EXPERT, n_embd, n_ff, types, from_floats=types[0] in (Q8_0, Q4_0))
    return layer


def _check(layer: ExpertLayer, n_tok: int, n_ent: int, seed: int = 0) -> None:
    from strata_ray.kernels.expert_gpu import expert_ffn_gpu

    rng = np.random.default_rng(seed + n_ent)
    x = rng.standard_normal((n_tok, layer.n_embd)).astype(np.float32)
    tok = (np.arange(n_ent) % n_tok).astype(np.int32)
    exp = rng.integers(0, N_EXPERT, n_ent).astype(np.int32)
    want = expert_ffn_cpu(x, tok, exp, layer).view(np.int32)
    mats = (torch.from_numpy(np.ascontiguousarray(w)) for w in (layer.gate, layer.up, layer.down))
    slots = ExpertLayer(*mats, layer.gate_type, layer.up_type, layer.down_type)
    out = torch.full((n_ent, layer.n_embd), float("nan"))  # poisoned: every element must be written
    got = expert_ffn_gpu(torch.from_numpy(x), torch.from_numpy(tok), torch.from_numpy(exp), slots,
                         mode="decode", out=out, variant="split")
    assert np.array_equal(got.numpy().view(np.int32), want), (n_tok, n_ent)


@interpret
@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize(("n_tok", "n_ent"), [(1, 1), (5, 5)])
def test_split_rows_equal_cpu_rows(name, n_tok, n_ent):
    n_embd = 256 if name.startswith(("Q4_K", "Q6_K")) else 96  # K-quants: 256-value super-blocks
    _check(_layer(name, n_embd, 64 if n_embd == 96 else 256), n_tok, n_ent)


@interpret
def test_split_knobs_give_the_same_bits(monkeypatch):
    """Ragged programs: 3 and 5 blocks a row against 2 blocks a program; sums of 32 rows a program."""
    import strata_ray.kernels.expert_gpu as eg

    monkeypatch.setitem(eg.__dict__, "SPLIT", {**eg.SPLIT, "nb": 2, "sum_br": 32, "br": 64})
    _check(_layer("Q8_0", 96, 160), 5, 9)
    _check(_layer("Q4_0", 96, 160), 1, 2)
