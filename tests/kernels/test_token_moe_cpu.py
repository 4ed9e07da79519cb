"""kernels/token_moe_cpu: one token's expert rows and their combine with no Python between the kernels, the
bits of its twin (the rows of expert_ffn_cpu_token, then moe.combine_rows) and its kernels' signatures; its
one-line refusals; when the CPU backend takes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata_ray.kernels.contract import Q4_0, Q8_0, KernelError
from strata_ray.kernels.expert_cpu import expert_ffn_cpu_token, token_layer
from strata_ray.kernels.random_weights import random_layer
from strata_ray.kernels.token_moe_cpu import TokenMoe, token_moe_cpu_serves
from strata_ray.model.moe import combine_rows_numpy
from tests.kernels.layers import N_EMBD, TYPE_SETS, layer_for

# (n_embd, n_ff) a type set: widths that are not powers of two (the K-quants' 256-value superblocks)
AWKWARD = {"Q8_0": (96, 160), "Q4_0": (160, 96), "Q8_0+Q4_0": (224, 288), "Q4_K": (512, 768),
           "Q6_K": (768, 512), "Q4_K+Q6_K": (512, 256)}


def _twin(x, exp, weights, tl):
    """The two calls TokenMoe replaces: the rows [K, E], then their weighted sum in k order."""
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
    moe = TokenMoe(tl)
    exp = np.array(ids, np.int64)
    outs = []
    for _ in range(2):  # the work arrays reused: each call's own bits, a new output each
        x = (rng.standard_normal((1, n_embd)) * 3).astype(np.float32)
        weights = rng.random((1, len(ids))).astype(np.float32)
        weights[0, -1] = 0.0
        out = moe(x, exp, weights)
        assert out.shape == (1, n_embd) and out.dtype == np.float32
        assert out.tobytes() == _twin(x, exp, weights, tl).tobytes()
        outs.append(out)
    assert outs[0].tobytes() != outs[1].tobytes()
    assert moe(x, exp[:1], weights[:, :1]).tobytes() == _twin(x, exp[:1], weights[:, :1], tl).tobytes()


def test_a_nan_token_gives_what_the_twin_gives(rng):
    tl = token_layer(layer_for("Q8_0"))
    x = rng.standard_normal((1, N_EMBD)).astype(np.float32)
    x[0, 7] = np.nan
    exp, weights = np.array([1, 2], np.int64), np.array([[0.25, 0.75]], np.float32)
    out = TokenMoe(tl)(x, exp, weights)
    assert np.isnan(out).any() and out.tobytes() == _twin(x, exp, weights, tl).tobytes()


def test_refusals_are_one_line():
    moe = TokenMoe(token_layer(layer_for("Q8_0")))
    x, w2 = np.zeros((1, N_EMBD), np.float32), np.full((1, 2), 0.5, np.float32)
    for exp in (np.array([37, 0]), np.array([-1, 0]), np.array([np.nan, 0])):
        with pytest.raises(KernelError, match=r"expert ids must be in \[0, 37\), got \[-?\d+, 0\]"), \
                np.errstate(invalid="ignore"):  # a NaN id casts to INT64_MIN (numpy warns)
            moe(x, exp, w2)
    bad = ((np.zeros((2, N_EMBD), np.float32), np.array([0, 1]), w2),  # two tokens
           (x, np.array([], np.int64), np.zeros((1, 0), np.float32)),  # no expert
           (x, np.array([[0, 1]]), w2),  # ids of two dims
           (x, np.array([0, 1]), np.ones((1, 3), np.float32)))  # weights that are not [1, K]
    for xs, exp, w in bad:
        with pytest.raises(KernelError, match=r"one token \[1, 256\], expert ids \[K\] and weights \[1, K\]"):
            moe(xs, exp, w)


def test_it_serves_untracked_weights_outside_grad_and_the_ab_switch(monkeypatch):
    w = torch.rand(1, 2)
    assert token_moe_cpu_serves(w)
    assert not token_moe_cpu_serves(w.requires_grad_())
    with torch.no_grad():
        assert token_moe_cpu_serves(w)
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert not token_moe_cpu_serves(torch.rand(1, 2))


def test_it_adds_no_numba_signature():
    """TokenMoe calls the kernels with the argument types of expert_ffn_cpu_token and combine_rows_cpu: in a
    fresh process, after those two, it compiles nothing (another signature would be a cold compile of a
    minute or more on a new machine); read-only or strided ids and weights are copied to those types."""
    import subprocess
    import sys

    code = """
import numpy as np, torch
from strata_ray.kernels.act_quant import quantize_rows_into
from strata_ray.kernels.contract import Q4_0
from strata_ray.kernels.expert_cpu import expert_ffn_cpu_token, token_layer
from strata_ray.kernels.expert_cpu_kernels import down_share, gate_up_share
from strata_ray.kernels.fused_small_cpu import _combine_rows, combine_rows_cpu
from strata_ray.kernels.random_weights import random_layer
from strata_ray.kernels.token_moe_cpu import TokenMoe
tl = token_layer(random_layer(np.random.default_rng(0), 8, 256, 256, (Q4_0,) * 3, from_floats=True))
x = np.ones((1, 256), np.float32)
rows = expert_ffn_cpu_token(x, np.array([1, 3]), tl)
combine_rows_cpu(torch.from_numpy(rows)[None], torch.ones(1, 2))
kernels = (quantize_rows_into, gate_up_share, down_share, _combine_rows)
before = [len(k.signatures) for k in kernels]
ids = np.array([[1, 3, 5, 7]])[0, ::2]
ids.flags.writeable = False
w = np.ones((2, 1), np.float32).T
w.flags.writeable = False
TokenMoe(tl)(x, ids, w)
print(before, [len(k.signatures) for k in kernels])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[1,", "1,", "1,", "1]"] * 2, out.stdout
