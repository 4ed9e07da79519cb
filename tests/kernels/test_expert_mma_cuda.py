"""The int8 MMA prompt rows (strata_ray/kernels/expert_mma_cuda.py): its geometry and the launches it takes on
CPU, and on the GPU (-m gpu) its rows against the CPU rows bit for bit at awkward entry counts (1, 33 and 222
tokens; one expert holding 200 entries: tiles of 64, 64, 64 and 8), the 80b-a3b's widths, each type."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from strata_ray.kernels import expert_mma_cuda as emc
from strata_ray.kernels.contract import Q4_0, Q4_K, Q6_K, Q8_0, ExpertLayer, KernelError
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.kernels.random_weights import random_layer


@pytest.mark.parametrize("wtype,kb", [(Q8_0, 8), (Q8_0, 4), (Q4_0, 8), (Q4_0, 4), (Q4_K, 8), (Q6_K, 8)])
@pytest.mark.parametrize("k", [512, 2048, 4096])
def test_staged_rows_are_whole_copies_on_distinct_banks(wtype, kb, k):
    """Every stage is whole copies of CPB bytes from CPB-aligned offsets, and a staged row's stride is 4 words
    mod 8 (so the 8 rows x 4 words of a warp's fragment reads land on 32 banks); two stages fit the H200's
    227 KiB a CTA."""
    geo = emc._geometry(k, wtype, kb)
    nb, kb = geo.nb, geo.kb
    assert nb == k // 32 and nb % kb == 0
    assert geo.stage % geo.cpb == 0 and geo.ast % 16 == 0 and geo.wst % 16 == 0
    assert geo.ast >= 32 * kb and geo.wst >= geo.stage
    row_bytes = {Q8_0: 34, Q4_0: 18, Q4_K: 18, Q6_K: 210 / 8}[wtype] * nb
    assert row_bytes % geo.cpb == 0
    for s in range(nb // kb):
        first = (210 * s) & ~3 if wtype == Q6_K else s * kb * geo.bb  # the stage's first copied byte
        assert first % geo.cpb == 0 and first + geo.stage <= row_bytes  # never past the row
    for stride in (geo.ast, geo.wst):
        words = stride // 4
        assert len({(g * words + t) % 32 for g in range(8) for t in range(4)}) == 32
    assert emc.shared_bytes(geo) <= 227 << 10


def test_the_kernel_takes_only_what_it_stages_whole():
    assert emc.mma_serves(2048, 512, Q4_0, 64)
    assert emc.mma_serves(512, 2048, Q4_K, 64)
    assert emc.mma_serves(512, 2048, Q6_K, 64)  # 2 super-blocks a row
    assert not emc.mma_serves(256, 512, Q6_K, 64)  # one 210-byte super-block a row: not 4-byte aligned rows
    assert not emc.mma_serves(224, 512, Q8_0, 64)  # 7 blocks a row: not whole stages of 8
    assert not emc.mma_serves(2048, 96, Q8_0, 64)  # 96 rows: not whole CTAs of 64
    assert not emc.mma_serves(2048, 512, Q8_0, 128)  # tiles over 64 entries
    assert emc._geometry(2048, Q4_K, 4) is None  # Q4_K stages whole super-blocks
    assert emc._geometry(2048, Q8_0, 4).cpb == 8  # 136 bytes a row's stage


def test_a_kernel_that_cannot_be_built_leaves_the_launch_to_triton(refusing_nvrtc, caplog):
    tries = refusing_nvrtc(emc)
    with caplog.at_level("WARNING", logger="strata_ray.kernels.nvrtc"):
        assert emc.mma_kernel(2048, True, 0, Q4_0) is None
        assert emc.mma_kernel(2048, True, 0, Q4_0) is None
    assert len(tries) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "the CUDA C prompt expert rows could not be built (RuntimeError: nvrtc: error: invalid value for "
        "--gpu-architecture); the Triton prompt tile takes their launches (the same bits)"]


@functools.cache
def _layer(n_embd: int, n_ff: int, n_expert: int, gate_up: int, down: int) -> ExpertLayer:
    rng = np.random.default_rng(n_embd + n_ff + n_expert + 10 * gate_up + down)
    floats = gate_up in (Q8_0, Q4_0) and down in (Q8_0, Q4_0)  # K-quants: random valid blocks
    return random_layer(rng, n_expert, n_embd, n_ff, (gate_up, gate_up, down), from_floats=floats)


def _check(layer: ExpertLayer, n_tok: int, top_k: int, seed: int = 0, one_expert: int = 0) -> None:
    """n_tok tokens' top-k entries (or one_expert entries all routed to expert 0) through the prompt launch:
    every element written (poisoned first), equal to the CPU rows bit for bit."""
    from strata_ray.kernels.expert_gpu import expert_ffn_gpu

    rng = np.random.default_rng(seed + n_tok)
    n_expert = layer.gate.shape[0]
    if one_expert:
        tok = rng.integers(0, n_tok, one_expert).astype(np.int32)
        exp = np.zeros(one_expert, np.int32)
    else:
        tok = np.repeat(np.arange(n_tok), top_k).astype(np.int32)
        picks = [rng.choice(n_expert, top_k, replace=False) for _ in range(n_tok)]
        exp = np.concatenate(picks).astype(np.int32)
    x = (rng.standard_normal((n_tok, layer.n_embd)) * 2).astype(np.float32)
    want = expert_ffn_cpu(x, tok, exp, layer).view(np.int32)
    slots = ExpertLayer(*(torch.from_numpy(np.ascontiguousarray(w)).cuda() for w in (layer.gate, layer.up,
                                                                                       layer.down)),
                        layer.gate_type, layer.up_type, layer.down_type)
    out = torch.full((len(tok), layer.n_embd), float("nan"), device="cuda")
    got = expert_ffn_gpu(*(torch.from_numpy(a).cuda() for a in (x, tok, exp)), slots, mode="prompt", out=out,
                         variant="words")
    assert np.array_equal(got.cpu().numpy().view(np.int32), want), (n_tok, top_k, one_expert)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gate_up,down,kb", [(Q8_0, Q8_0, 8), (Q8_0, Q8_0, 4), (Q4_0, Q4_0, 8),
                                              (Q4_0, Q4_0, 4), (Q4_K, Q4_K, 8), (Q4_K, Q6_K, 8),
                                              (Q6_K, Q6_K, 8)])
@pytest.mark.parametrize("warp_entries,full", [(32, "0"), (64, "0"), (64, "1")])
def test_gpu_mma_rows_equal_cpu_rows(monkeypatch, gate_up, down, kb, warp_entries, full):
    """The 80b-a3b's widths (2048 / 512), stages of 8 and 4 blocks, both warp tiles, the full tiles' form;
    Q4_K + Q6_K: a Q4_K_M file's experts; the 256 x 768 layer's rows are not served (its launches take the
    Triton tile). One slot's 200 entries: three full tiles of 64 and a tile of 8 (partial)."""
    pytest.importorskip("cupy")
    monkeypatch.setenv("STRATA_PROMPT_MMA", "1")
    monkeypatch.setenv("STRATA_MMA_FULL_TILES", full)
    monkeypatch.setitem(emc.MMA, "stage_blocks", {**emc.MMA["stage_blocks"], gate_up: kb})
    monkeypatch.setitem(emc.MMA, "warp_entries", warp_entries)
    layer = _layer(2048, 512, 24, gate_up, down)
    for n_tok, top_k in [(1, 10), (33, 8), (222, 10)]:
        _check(layer, n_tok, top_k)
    _check(layer, 300, 0, one_expert=200)  # one slot's 200 entries: tiles of 64, 64, 64 and 8
    _check(_layer(256, 768, 5, gate_up, down), 33, 4)  # 8 blocks a gate row (one stage), 768 up rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mma_rows_equal_the_triton_prompt_tile(monkeypatch):
    """The launch with the MMA rows on and off (the Triton tl.dot tile): the same bits."""
    pytest.importorskip("cupy")
    from strata_ray.kernels.expert_gpu import expert_ffn_gpu

    layer = _layer(2048, 512, 24, Q4_0, Q4_0)
    rng = np.random.default_rng(3)
    x = torch.from_numpy((rng.standard_normal((97, 2048)) * 2).astype(np.float32)).cuda()
    tok = torch.from_numpy(np.repeat(np.arange(97), 10).astype(np.int32)).cuda()
    exp = torch.from_numpy(rng.integers(0, 24, 970).astype(np.int32)).cuda()
    slots = ExpertLayer(*(torch.from_numpy(np.ascontiguousarray(w)).cuda() for w in (layer.gate, layer.up,
                                                                                       layer.down)),
                        layer.gate_type, layer.up_type, layer.down_type)
    rows = {}
    for on in ("1", "0"):
        monkeypatch.setenv("STRATA_PROMPT_MMA", on)
        out = torch.full((970, 2048), float("nan"), device="cuda")  # poisoned: every row written
        rows[on] = expert_ffn_gpu(x, tok, exp, slots, mode="prompt", variant="words", out=out).cpu().numpy()
        assert not np.isnan(rows[on]).any()
    assert np.array_equal(rows["1"].view(np.int32), rows["0"].view(np.int32))


def test_the_warp_tile_is_one_of_two(monkeypatch):
    """MMA["warp_entries"] picks the warp tile's MI x NI MMA tiles (32: 2 x 4, 64: 4 x 2; four warps cover
    the CTA's 64 x 64 either way); another value is refused in one line, not compiled."""
    geo = emc.geometry(2048, Q4_0)
    assert emc.MMA["warp_entries"] == 64  # session 54's measure: 64 x 16 the faster for every type
    assert emc.defines(geo, True, Q4_0)[-2:] == ("-DMI=4", "-DNI=2")
    assert emc.defines(geo, True, Q4_0, 32)[-2:] == ("-DMI=2", "-DNI=4")
    monkeypatch.setitem(emc.MMA, "warp_entries", 32)
    assert emc.build_options(geo, True, Q4_0)[-2:] == ("-DMI=2", "-DNI=4")
    monkeypatch.setitem(emc.MMA, "warp_entries", 16)
    with pytest.raises(KernelError, match="warp_entries must be one of \\[32, 64\\], not 16"):
        emc.defines(geo, True, Q4_0)
    for mi, ni in emc.WARP_TILES.values():
        assert (emc.BT // (16 * mi)) * (emc.BN // (8 * ni)) == 4


def test_the_full_tiles_form_is_a_define_on_by_default(monkeypatch):
    """STRATA_MMA_FULL_TILES over MMA["full_tiles"] (on: faster in session 58's A/B) sets FULL_TILES, which
    the source's FULL takes for Q4_0 / Q8_0 only; the kernel's cache key carries it, so a switch compiles
    the other form."""
    geo = emc.geometry(2048, Q4_0)
    monkeypatch.delenv("STRATA_MMA_FULL_TILES", raising=False)
    assert emc.MMA["full_tiles"] is True and "-DFULL_TILES=1" in emc.defines(geo, True, Q4_0)
    monkeypatch.setitem(emc.MMA, "full_tiles", False)
    assert "-DFULL_TILES=0" in emc.defines(geo, True, Q4_0)
    monkeypatch.setenv("STRATA_MMA_FULL_TILES", "0")
    assert "-DFULL_TILES=0" in emc.build_options(geo, True, Q4_0)
    assert "#define FULL (FULL_TILES && !Q4K && !Q6K)" in emc._SOURCE


def test_the_engine_options_are_the_launched_forms(monkeypatch):
    """engine_options: what mma_kernel compiles for a shape (MMA's tile, min_ctas' cap), or with the cap or
    the tile given, as cuda_resources asks; a given cap reaches the K-quants only."""
    monkeypatch.delenv("STRATA_MMA_KQUANT_CTAS", raising=False)
    geo = emc.geometry(2048, Q4_K)
    assert emc.engine_options(2048, True, Q4_K) == emc.build_options(geo, True, Q4_K, emc.KQUANT_CTAS)
    assert emc.engine_options(2048, True, Q4_K, 1, 32) == emc.build_options(geo, True, Q4_K, 1, 32)
    g40 = emc.geometry(2048, Q4_0)
    assert emc.engine_options(2048, True, Q4_0, 3) == emc.build_options(g40, True, Q4_0, 1)


def test_the_kquant_register_cap_is_the_kquants_only(monkeypatch):
    """The K-quant forms are capped for KQUANT_CTAS (3) CTAs an SM unless STRATA_MMA_KQUANT_CTAS says
    otherwise; 1 is the compiler's choice (no MIN_CTAS option, the code as before the cap); Q4_0 / Q8_0 are
    never capped."""
    geo = emc.geometry(2048, Q4_K)
    monkeypatch.delenv("STRATA_MMA_KQUANT_CTAS", raising=False)
    assert [emc.min_ctas(t) for t in (Q4_0, Q8_0, Q4_K, Q6_K)] == [1, 1, 3, 3]
    assert emc.build_options(geo, True, Q4_K, emc.min_ctas(Q4_K))[-1] == "-DMIN_CTAS=3"
    monkeypatch.setenv("STRATA_MMA_KQUANT_CTAS", "1")
    assert [emc.min_ctas(t) for t in (Q4_0, Q8_0, Q4_K, Q6_K)] == [1, 1, 1, 1]
    assert not any(o.startswith("-DMIN_CTAS") for o in emc.build_options(geo, True, Q4_K, emc.min_ctas(Q4_K)))
    monkeypatch.setenv("STRATA_MMA_KQUANT_CTAS", "2")
    assert [emc.min_ctas(t) for t in (Q4_0, Q8_0, Q4_K, Q6_K)] == [1, 1, 2, 2]
    assert "#ifdef MIN_CTAS" in emc._SOURCE and "__launch_bounds__(128, MIN_CTAS)" in emc._SOURCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gate_up,down", [(Q4_K, Q4_K), (Q4_K, Q6_K), (Q6_K, Q6_K)])
def test_gpu_mma_rows_with_the_compilers_registers_equal_cpu_rows(monkeypatch, gate_up, down):
    """The K-quant forms as the compiler chooses (STRATA_MMA_KQUANT_CTAS=1: 244-255 registers, 2 CTAs an SM;
    the default caps them for 3, which the other tests run): the same bits."""
    pytest.importorskip("cupy")
    monkeypatch.setenv("STRATA_PROMPT_MMA", "1")
    monkeypatch.setenv("STRATA_MMA_KQUANT_CTAS", "1")
    layer = _layer(2048, 512, 24, gate_up, down)
    for n_tok, top_k in [(1, 10), (33, 8), (222, 10)]:
        _check(layer, n_tok, top_k)
    _check(layer, 300, 0, one_expert=200)
