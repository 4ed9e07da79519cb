"""The words decode tile (strata_ray/kernels/expert_words.py) under Triton's CPU interpreter: one token's rows
bit-identical to the numba rows for Q4_0 and Q8_0, one and several chunks a row, 1 to 33 entries; shapes it
does not serve fall back to the simple tile, with the same bits (CI runs this on CPU machines with triton;
the GPU run is tests/kernels/test_expert_gpu.py, -m gpu)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from strata_ray.kernels.contract import Q4_0, Q4_K, Q8_0, ExpertLayer
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.kernels.random_weights import random_layer
from tests.kernels.triton_interpret import interpret

N_EXPERT = 37


@pytest.fixture(autouse=True)
def _q8_0_words(monkeypatch):
    """Q8_0 is opt-in for the tile (WORDS["types"]): these tests check its bits too."""
    import strata_ray.kernels.expert_words as ew

    monkeypatch.setitem(ew.WORDS, "types", (Q4_0, Q8_0))


@functools.cache
def _layer(types: tuple[int, int, int], n_embd: int, n_ff: int, n_expert: int = N_EXPERT) -> ExpertLayer:
    rng = np.random.default_rng(sum(types) + n_embd + n_ff)
    return random_layer(rng, n_expert, n_embd, n_ff, types, from_floats=types[0] in (Q8_0, Q4_0))


def _check(layer: ExpertLayer, n_tok: int, n_ent: int, seed: int = 0, device: str = "cpu") -> None:
    from strata_ray.kernels.expert_gpu import expert_ffn_gpu

    rng = np.random.default_rng(seed + n_ent)
    x = (rng.standard_normal((n_tok, layer.n_embd)) * 2).astype(np.float32)
    tok = (np.arange(n_ent) % n_tok).astype(np.int32)
    n_expert = layer.gate.shape[0]
    exp = rng.permutation(n_expert)[:n_ent].astype(np.int32) if n_ent <= n_expert else \
        rng.integers(0, n_expert, n_ent).astype(np.int32)
    want = expert_ffn_cpu(x, tok, exp, layer).view(np.int32)
    mats = (torch.from_numpy(np.ascontiguousarray(w)).to(device) for w in (layer.gate, layer.up, layer.down))
    slots = ExpertLayer(*mats, layer.gate_type, layer.up_type, layer.down_type)
    out = torch.full((n_ent, layer.n_embd), float("nan"), device=device)  # poisoned: every element written
    got = expert_ffn_gpu(*(torch.from_numpy(a).to(device) for a in (x, tok, exp)), slots,
                         mode="decode", out=out, variant="words")
    assert np.array_equal(got.cpu().numpy().view(np.int32), want), (n_tok, n_ent)


def test_words_supported_shapes(monkeypatch):
    import strata_ray.kernels.expert_words as ew
    from strata_ray.kernels.expert_words import words_supported

    assert words_supported(Q4_0, Q4_0, 2048, 1) and words_supported(Q8_0, Q8_0, 512, 1)
    assert not words_supported(Q4_0, Q4_0, 2048, 2)  # tiles of several entries
    assert not words_supported(Q4_0, Q8_0, 2048, 1)  # gate and up of two types
    assert not words_supported(Q4_K, Q4_K, 2048, 1)
    assert not words_supported(Q4_0, Q4_0, 96, 1)  # 3 blocks: not whole chunks
    w = torch.zeros((2, 4, 72), dtype=torch.uint8)  # [S, rows, row_bytes]: 2 slots of 4 Q4_0 rows of 128
    assert words_supported(Q4_0, Q4_0, 128, 1, (w, w))
    odd = torch.zeros(2 * 4 * 72 + 2, dtype=torch.uint8)[2:].view(2, 4, 72)  # starts 2 bytes into a word
    assert not words_supported(Q4_0, Q4_0, 128, 1, (w, odd))
    monkeypatch.setitem(ew.WORDS, "types", (Q4_0,))  # the default: Q8_0 takes the simple tile
    assert words_supported(Q4_0, Q4_0, 2048, 1) and not words_supported(Q8_0, Q8_0, 512, 1)


@interpret
@pytest.mark.parametrize(("wtype", "n_embd", "n_ff", "n_ent"), [
    (Q4_0, 256, 256, 1), (Q4_0, 512, 128, 10), (Q4_0, 256, 64, 33), (Q8_0, 256, 256, 1), (Q8_0, 512, 128, 5),
], ids=["Q4_0-1", "Q4_0-512-10", "Q4_0-33", "Q8_0-1", "Q8_0-512-5"])
def test_words_rows_equal_cpu_rows(wtype, n_embd, n_ff, n_ent):
    """256 values = 4 pairs a row, 512 = 8; 64 = one pair (a 64-wide down); 33 entries over 37 experts."""
    _check(_layer((wtype,) * 3, n_embd, n_ff), 1, n_ent)


@interpret
def test_words_mixed_down_type_and_fallbacks():
    """Q4_0 gate/up with a Q8_0 down (each launch its own type); a 3-block row and a 5-token launch take the
    simple tile."""
    _check(_layer((Q4_0, Q4_0, Q8_0), 256, 256), 1, 10)
    _check(_layer((Q8_0, Q8_0, Q8_0), 96, 64), 1, 3)
    _check(_layer((Q4_0, Q4_0, Q4_0), 256, 256), 5, 7)


@interpret
def test_words_split_gate_up_gives_the_same_bits(monkeypatch):
    """Gate and up rows in programs of their own (16 rows), then SwiGLU and the requantization in a launch of
    their own: the fused tile's bits."""
    import strata_ray.kernels.expert_words as ew

    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "split_gu": True, "gu_split_br": 16})
    _check(_layer((Q4_0,) * 3, 256, 128), 1, 5)
    _check(_layer((Q8_0,) * 3, 256, 64), 1, 3)


@interpret
def test_words_knobs_give_the_same_bits(monkeypatch):
    """Two pairs a chunk (2 chunks a row at 256 values), 64-row programs."""
    import strata_ray.kernels.expert_words as ew

    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "chunk_pairs": 2, "gu_br": 64, "down_br": 64})
    _check(_layer((Q4_0,) * 3, 256, 256), 1, 4)
    _check(_layer((Q8_0,) * 3, 256, 256), 1, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("wtype", [Q4_0, Q8_0], ids=["Q4_0", "Q8_0"])
def test_gpu_words_rows_equal_cpu_rows(wtype, monkeypatch):
    """The compiled tile at the 80b-a3b's widths (2048 / 512) and the test sizes, with its knob extremes (the
    Triton tile: the CUDA C form, on by default where cupy is, has tests/kernels/test_expert_rows_cuda.py)."""
    import strata_ray.kernels.expert_words as ew

    monkeypatch.setenv("STRATA_WORDS_CUDA", "0")

    wide = _layer((wtype,) * 3, 2048, 512, 12)  # the 80b-a3b's widths, 12 experts (quantized once)
    _check(wide, 1, 10, device="cuda")
    for n_embd, n_ff, n_ent in [(256, 256, 1), (512, 256, 33)]:
        _check(_layer((wtype,) * 3, n_embd, n_ff), 1, n_ent, device="cuda")
    _check(_layer((Q4_0, Q4_0, Q8_0), 256, 256), 1, 10, device="cuda")
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "chunk_pairs": 4, "gu_br": 64, "down_br": 16})
    _check(wide, 1, 10, device="cuda")
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "split_gu": True})
    _check(wide, 1, 10, device="cuda")

