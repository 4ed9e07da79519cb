"""kernels/token_moe_cpu: one token's expert rows and their combine in one call, the bits of its twin (the
rows of expert_ffn_cpu_token, then moe.combine_rows); its one-line refusals; when the CPU backend takes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata_ray.kernels.contract import Q4_0, Q8_0, KernelError
from strata_ray.kernels.expert_cpu import expert_ffn_cpu_token, token_layer
from strata_ray.kernels.random_weights import random_layer
from strata_ray.kernels.token_moe_cpu import token_moe_cpu, token_moe_cpu_serves
from strata_ray.model.moe import combine_rows_numpy
from tests.kernels.layers import N_EMBD, TYPE_SETS, layer_for

# (n_embd, n_ff) a type set: widths that are not powers of two (the K-quants' 256-value superblocks)
AWKWARD = {"Q8_0": (96, 160), "Q4_0": (160, 96), "Q8_0+Q4_0": (224, 288), "Q4_K": (512, 768),
           "Q6_K": (768, 512), "Q4_K+Q6_K": (512, 256)}


def _twin(x, exp, weights, tl):
    """The two calls token_moe_cpu replaces: the rows [K, E], then their weighted sum in k order."""
    rows = expert_ffn_cpu_token(x, exp, tl)  # [K, E]
    out = combine_rows_numpy(torch.from_numpy(rows)[None], torch.from_numpy(weights))
    return out.numpy()


@pytest.mark.parametrize("name", list(AWKWARD))
@pytest.mark.parametrize("ids", [[5], [3, 30], [36, 0, 17, 9, 21, 2, 11, 28, 33, 1], [4, 4, 19]])
def test_the_twins_bits_at_awkward_widths(name, ids, rng):
    """1, 2 and 10 experts, a repeated one (never a top-k's, but allowed); weights that do not sum to 1 and
    a zero weight (its row still adds: r * 0 may be -0 or NaN, as the twin's)."""
    n_embd, n_ff = AWKWARD[name]
    types = TYPE_SETS[name]
    layer = random_layer(np.random.default_rng(n_embd + n_ff), 37, n_embd, n_ff, types,
                         from_floats=types[0] in (Q8_0, Q4_0))
    tl = token_layer(layer)
    x = (rng.standard_normal((1, n_embd)) * 3).astype(np.float32)
    exp = np.array(ids, np.int64)
    weights = rng.random((1, len(ids))).astype(np.float32)
    weights[0, -1] = 0.0
    out = token_moe_cpu(x, exp, weights, tl)
    assert out.shape == (1, n_embd) and out.dtype == np.float32
    assert out.tobytes() == _twin(x, exp, weights, tl).tobytes()


def test_a_nan_token_gives_what_the_twin_gives(rng):
    tl = token_layer(layer_for("Q8_0"))
    x = rng.standard_normal((1, N_EMBD)).astype(np.float32)
    x[0, 7] = np.nan
    exp, weights = np.array([1, 2], np.int64), np.array([[0.25, 0.75]], np.float32)
    out = token_moe_cpu(x, exp, weights, tl)
    assert np.isnan(out).any() and out.tobytes() == _twin(x, exp, weights, tl).tobytes()


def test_refusals_are_one_line():
    tl = token_layer(layer_for("Q8_0"))
    x, w2 = np.zeros((1, N_EMBD), np.float32), np.full((1, 2), 0.5, np.float32)
    for exp in (np.array([37, 0]), np.array([-1, 0])):
        with pytest.raises(KernelError, match=r"expert ids must be in \[0, 37\), got \[-?\d+, 0\]"):
            token_moe_cpu(x, exp, w2, tl)
    bad = ((np.zeros((2, N_EMBD), np.float32), np.array([0, 1]), w2),  # two tokens
           (x, np.array([], np.int64), np.zeros((1, 0), np.float32)),  # no expert
           (x, np.array([[0, 1]]), w2),  # ids of two dims
           (x, np.array([0, 1]), np.ones((1, 3), np.float32)))  # weights that are not [1, K]
    for xs, exp, w in bad:
        with pytest.raises(KernelError, match=r"one token \[1, 256\], expert ids \[K\] and weights \[1, K\]"):
            token_moe_cpu(xs, exp, w, tl)


def test_it_serves_untracked_weights_outside_grad_and_the_ab_switch(monkeypatch):
    w = torch.rand(1, 2)
    assert token_moe_cpu_serves(w)
    assert not token_moe_cpu_serves(w.requires_grad_())
    with torch.no_grad():
        assert token_moe_cpu_serves(w)
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert not token_moe_cpu_serves(torch.rand(1, 2))
