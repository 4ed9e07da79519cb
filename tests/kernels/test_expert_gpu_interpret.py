"""The Triton expert kernels run by Triton's CPU interpreter: rows bit-identical to the numba rows
for every quant type, 1/5/33 entries, decode and prompt tiles, tile knobs and kernel variants.

Opt-in (slow, needs triton; not run in CI):
    STRATA_TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_expert_gpu_interpret.py
The interpreter rounds every fp32 op like the GPU does with enable_fp_fusion=False (no FMA), so
these bits are the GPU's bits; the GPU run (test_expert_gpu.py, -m gpu) remains the final word.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("STRATA_TRITON_INTERPRET") != "1":
    pytest.skip("set STRATA_TRITON_INTERPRET=1 (slow, needs triton)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from strata_ray.kernels.contract import Q4_0, Q4_K, Q6_K, Q8_0, ExpertLayer  # noqa: E402
from strata_ray.kernels.expert_cpu import expert_ffn_cpu  # noqa: E402
from strata_ray.kernels.random_weights import random_layer  # noqa: E402
from strata_ray.kernels.triton_blocks import quant_blocks, tl, triton  # noqa: E402


@triton.jit
def _quant_kernel(X, Q, D, S, B: tl.constexpr):
    """quant_blocks over B blocks of X (f32 [B, 32]) -> Q int8 [B, 32], D f32 [B], S int32 [B]."""
    rows, cols = tl.arange(0, B), tl.arange(0, 32)
    offs = rows[:, None] * 32 + cols[None, :]
    q, d, s = quant_blocks(tl.load(X + offs))
    tl.store(Q + offs, q)
    tl.store(D + rows, d)
    tl.store(S + rows, s)


N_EXPERT = 3
TYPES = {"Q8_0": (Q8_0,) * 3, "Q4_0": (Q4_0,) * 3, "Q4_K": (Q4_K,) * 3, "Q6_K": (Q6_K,) * 3,
         "Q4_K+Q6_K": (Q4_K, Q4_K, Q6_K)}
# (tokens, entries): one decode token, a 5-entry window, 33 random (token, expert) pairs (duplicates
# included) that need several decode tiles per expert.
CASES = [(1, 1), (5, 5), (8, 33)]


def _layer(name: str, n_embd: int = 256, n_ff: int = 256) -> ExpertLayer:
    types = TYPES[name]
    rng = np.random.default_rng(sum(map(ord, name)) + n_embd)
    return random_layer(rng, N_EXPERT, n_embd, n_ff, types, from_floats=types[0] in (Q8_0, Q4_0))


def _torch_layer(layer: ExpertLayer) -> ExpertLayer:
    mats = (torch.from_numpy(np.ascontiguousarray(w)) for w in (layer.gate, layer.up, layer.down))
    return ExpertLayer(*mats, layer.gate_type, layer.up_type, layer.down_type)


def _check(layer: ExpertLayer, n_tok: int, n_ent: int, modes=("decode", "prompt"), variant="wide", seed=0):
    from strata_ray.kernels.expert_gpu import expert_ffn_gpu

    rng = np.random.default_rng(seed + n_ent)
    x = rng.standard_normal((n_tok, layer.n_embd)).astype(np.float32)
    tok = (np.arange(n_ent) % n_tok).astype(np.int32)
    exp = rng.integers(0, N_EXPERT, n_ent).astype(np.int32)
    want = expert_ffn_cpu(x, tok, exp, layer).view(np.int32)
    slots = _torch_layer(layer)
    for mode in modes:
        out = torch.full((n_ent, layer.n_embd), float("nan"))  # poisoned: every element must be written
        got = expert_ffn_gpu(torch.from_numpy(x), torch.from_numpy(tok), torch.from_numpy(exp), slots,
                             mode=mode, out=out, variant=variant)
        assert np.array_equal(got.numpy().view(np.int32), want), (mode, variant, n_tok, n_ent)


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("n_tok,n_ent", CASES)
def test_wide_rows_equal_cpu_rows(name, n_tok, n_ent):
    _check(_layer(name), n_tok, n_ent)


def test_ragged_chunks_equal_cpu_rows():
    """5 and 3 blocks per row: the last decode chunk is partly past the row (masked blocks)."""
    _check(_layer("Q8_0", n_embd=96, n_ff=160), 5, 9)
    _check(_layer("Q4_0", n_embd=96, n_ff=160), 1, 2)


def test_tile_knobs_and_simple_variant_same_bits(monkeypatch):
    import strata_ray.kernels.expert_gpu as eg

    layer = _layer("Q4_K+Q6_K")
    for knobs in ({"gu_nb": 2, "down_nb": 4, "down_br": 32}, {"gu_nb": 16, "down_nb": 16, "gu_br": 64},
                  {"prompt_bt": 16, "prompt_br": 32}):
        monkeypatch.setitem(eg.__dict__, "WIDE", {**eg.WIDE, **knobs})
        _check(layer, 3, 5, seed=1)
    _check(layer, 3, 5, variant="simple", seed=1)


def test_unknown_variant_is_one_line_error():
    from strata_ray.kernels.contract import KernelError
    from strata_ray.kernels.expert_gpu import expert_ffn_gpu

    layer = _torch_layer(_layer("Q8_0"))
    with pytest.raises(KernelError, match="unknown expert kernel variant 'fast'"):
        expert_ffn_gpu(torch.zeros(1, 256), torch.zeros(1, dtype=torch.int32),
                       torch.zeros(1, dtype=torch.int32), layer, variant="fast")


def test_quant_blocks_equals_the_spec_with_poisoned_blocks():
    """triton_blocks.quant_blocks (every GPU quantization: x in publish, h in the rows' tails) against the
    spec on finite blocks and on blocks holding a NaN or an infinity (q = 0, d = NaN, s = 0), including a
    NaN among zeros, which the block's max alone does not see."""
    from strata_ray.kernels.spec import act_quant_ref

    x = np.random.default_rng(3).standard_normal((8, 32)).astype(np.float32)
    x[1, 7], x[2, 0], x[3, 31] = np.nan, np.inf, -np.inf
    x[4] = 0.0
    x[4, 9] = np.nan  # a NaN among zeros
    x[5] = 0.0  # a zero block
    want = act_quant_ref(x.reshape(1, -1))
    q, d, s = torch.empty(8, 32, dtype=torch.int8), torch.empty(8), torch.empty(8, dtype=torch.int32)
    _quant_kernel[(1,)](torch.from_numpy(x), q, d, s, B=8)
    assert np.array_equal(q.numpy().reshape(1, -1), want[0])
    assert np.array_equal(d.numpy().view(np.int32), want[1].reshape(-1).view(np.int32))
    assert np.array_equal(s.numpy(), want[2].reshape(-1))
    assert np.isnan(want[1][0, 1:5]).all() and want[1][0, 5] == 0 and (want[2][0, 1:6] == 0).all()
