"""The CUDA C expert rows (strata_ray/kernels/expert_rows_cuda.py): its numpy twin against the contract's
plain row arithmetic on CPU (lanes a row 1, 4 and 32; 9 to 27 words a lane), and on the GPU (-m gpu) the
kernel's rows against the CPU rows at awkward entry counts, both widths of the 80b-a3b and its knobs."""

from __future__ import annotations

import functools
import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from strata_ray.kernels.act_quant import quantize_act_sums
from strata_ray.kernels.contract import Q4_0, Q4_K, Q6_K, Q8_0, ExpertLayer, KernelError
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.kernels.expert_rows_cuda import (
    STATIC_SHARED,
    build_options,
    cuda_rows_serves,
    cuda_rows_tile_cap,
    geometry,
    row_block_ctas,
    row_reference,
    row_reference_q4k,
    row_reference_q6k,
    row_reference_q8,
    rows_early,
    rows_iters,
    shared_bytes,
    stage_pitch,
    staged_pitch,
)
from strata_ray.kernels.random_weights import random_layer


def _contract_row(row: np.ndarray, aq: np.ndarray, ad: np.ndarray) -> np.float32:
    """A Q4_0 row's dot with the codes as the contract writes it: block b's exact integer sum of (q - 8) a,
    its term float(I) * (d * ad), added to 0.0 in block order."""
    blocks = row.reshape(-1, 18)
    d = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
    q = np.concatenate([blocks[:, 2:] & 15, blocks[:, 2:] >> 4], axis=1).astype(np.int64) - 8  # [nb, 32]
    ints = (q * aq.reshape(-1, 32).astype(np.int64)).sum(axis=1)
    acc = np.float32(0.0)
    for b in range(len(d)):
        acc = np.float32(acc + np.float32(np.float32(ints[b]) * np.float32(d[b] * ad[b])))
    return acc


@functools.cache
def _layer(n_embd: int, n_ff: int, n_expert: int = 4, down=Q4_0, gate_up=Q4_0) -> ExpertLayer:
    rng = np.random.default_rng(n_embd + n_ff + n_expert)
    # gguf quantizes Q4_0 from floats but not Q4_K: Q4_K layers are random blocks with sane scales
    floats = Q4_K not in (gate_up, down) and Q6_K not in (gate_up, down)
    return random_layer(rng, n_expert, n_embd, n_ff, (gate_up, gate_up, down), from_floats=floats)


@pytest.mark.parametrize("n_embd", [64, 256, 768, 2048])
def test_row_reference_is_the_contract_row(n_embd):
    """64 values: one pair, one lane a row; 256: 4 lanes; 768: 12 pairs, 4 lanes of 27 words; 2048: 32."""
    layer = _layer(n_embd, 64)
    rng = np.random.default_rng(n_embd)
    x = (rng.standard_normal((1, n_embd)) * 3).astype(np.float32)
    aq, ad, asum = (a[0] for a in quantize_act_sums(x))
    gate = layer.gate[1]  # [n_ff rows, row bytes]
    for r in range(0, gate.shape[0], 7):
        want = _contract_row(gate[r], aq, ad)
        assert row_reference(gate[r], aq, ad, asum).view(np.int32) == want.view(np.int32), r


@pytest.mark.parametrize("wtype,n_embd,row_step", [
    (Q4_K, 256, 5), (Q4_K, 512, 5), (Q4_K, 2048, 5),  # one to eight super-blocks a row
    (Q8_0, 64, 3), (Q8_0, 512, 3), (Q8_0, 2048, 3),  # one to 16 block pairs
    (Q6_K, 512, 9), (Q6_K, 1024, 9), (Q6_K, 4096, 9),  # 2, 4 and 16 super-blocks (odd ones 2-byte aligned)
])
def test_k_and_q8_row_references_are_the_contract_row(wtype, n_embd, row_step):
    """Each type's twin (its terms and fold) against matmul_spec's rows, bit for bit."""
    from strata_ray.kernels.spec import matmul_spec

    layer = _layer(n_embd, 256 if wtype != Q8_0 else 64, gate_up=wtype, down=wtype)
    rng = np.random.default_rng(n_embd + wtype)
    x = (rng.standard_normal((1, n_embd)) * 3).astype(np.float32)
    aq, ad, asum = (a[0] for a in quantize_act_sums(x))
    gate = layer.gate[1]  # [n_ff rows, row bytes]
    want = matmul_spec(gate, wtype, x)[0]
    twin = {Q4_K: lambda row: row_reference_q4k(row, aq, ad, asum),
            Q8_0: lambda row: row_reference_q8(row, aq, ad),
            Q6_K: lambda row: row_reference_q6k(row, aq, ad)}[wtype]
    for r in range(0, gate.shape[0], row_step):
        assert twin(gate[r]).view(np.int32) == want[r].view(np.int32), r


def test_cuda_rows_serve_whole_pairs_within_the_registers():
    assert cuda_rows_serves(2048) and cuda_rows_serves(512) and cuda_rows_serves(64) and cuda_rows_serves(768)
    assert not cuda_rows_serves(96)  # 3 blocks: not whole pairs
    assert not cuda_rows_serves(64 * 9)  # 9 pairs: one lane a row, 81 words
    assert cuda_rows_serves(4096)  # 64 pairs: 32 lanes of 18 words
    assert cuda_rows_serves(2048, 8) and cuda_rows_serves(512, 8)  # the 80b-a3b's verify windows
    assert cuda_rows_serves(4096, 4) and not cuda_rows_serves(4096, 8)  # 8 entries' codes: over 48 KiB
    # Q4_K: a quarter super-block a lane (2 sub-blocks, 9 words), the Q4_0 pairs' geometry
    assert cuda_rows_serves(2048, 8, Q4_K) and cuda_rows_serves(512, 8, Q4_K)
    assert cuda_rows_serves(256, 1, Q4_K)
    assert cuda_rows_serves(768, 4, Q4_K) and not cuda_rows_serves(768, 8, Q4_K)  # 3 quarters a lane
    assert not cuda_rows_serves(96, 1, Q4_K) and not cuda_rows_serves(8192, 2, Q4_K)
    assert cuda_rows_serves(2048, 8, Q8_0) and cuda_rows_serves(4096, 1, Q8_0)  # 17 and 34 words a lane
    assert not cuda_rows_serves(4096, 8, Q8_0) and not cuda_rows_serves(96, 1, Q8_0)
    # Q6_K: an even count of 210-byte super-blocks (whole words), a quarter (2 blocks) a lane
    assert cuda_rows_serves(512, 8, Q6_K) and cuda_rows_serves(2048, 8, Q6_K)
    assert cuda_rows_serves(4096, 1, Q6_K)
    assert not cuda_rows_serves(256, 1, Q6_K) and not cuda_rows_serves(768, 1, Q6_K)


def test_tile_cap_is_the_most_entries_every_served_kind_takes():
    assert cuda_rows_tile_cap([(2048, Q4_0), (512, Q4_0)], 8) == 8
    assert cuda_rows_tile_cap([(2048, Q4_K), (2048, Q4_K), (512, Q6_K)], 8) == 8  # a Q4_K_M layer
    assert cuda_rows_tile_cap([(4096, Q4_0)], 8) == 4
    assert cuda_rows_tile_cap([(8192, Q4_K), (512, Q4_K)], 8) == 1
    assert cuda_rows_tile_cap([(2048, Q4_K)], 1) == 1
    assert cuda_rows_tile_cap([(96, Q4_0), (256, Q6_K)], 8) == 8  # never served: the simple tile, no cap


@pytest.mark.parametrize("unit_words", [9, 17])  # a Q4_0 / Q8_0 block pair
@pytest.mark.parametrize("g", [4, 8, 16, 32])
def test_staged_rows_of_a_warps_groups_hit_distinct_banks(unit_words, g):
    """A warp's 32 / g row groups stage their rows stage_pitch words apart: each store (lane l of group grp
    writes word l + g j) and each unit read (word i of unit l) of the warp's 32 lanes hits 32 banks."""
    wpr = unit_words * g  # one unit a lane
    pitch = stage_pitch(wpr, g)
    assert pitch >= wpr + 1
    lanes = [(grp, lane) for grp in range(32 // g) for lane in range(g)]
    for i in range(unit_words):
        assert len({(grp * pitch + unit_words * lane + i) % 32 for grp, lane in lanes}) == 32
        assert len({(grp * pitch + lane + g * i) % 32 for grp, lane in lanes}) == 32
    if g == 8 and unit_words == 9:  # WPR + 1, the pitch before: 4-way conflicts on a 512-value down row
        banks = Counter((grp * (wpr + 1) + unit_words * lane) % 32 for grp, lane in lanes)
        assert max(banks.values()) == 4


def test_the_kernel_pitch_pads_only_where_its_shared_memory_fits():
    down = geometry(512, Q4_0)
    assert staged_pitch(down, 8, 2, 4) == stage_pitch(down[0], down[2]) > down[0] + 1
    q4k = geometry(768, Q4_K)  # 8 row groups a warp: padded, tiles of 4 would pass 48 KiB
    padded = shared_bytes(q4k, 4, 2, 4, stage_pitch(q4k[0], q4k[2]))
    assert padded > STATIC_SHARED >= shared_bytes(q4k, 4, 2, 4)
    assert staged_pitch(q4k, 4, 2, 4) == q4k[0] + 1 and staged_pitch(q4k, 1, 2, 4) > q4k[0] + 1


def test_ctas_walk_every_row_block_once():
    """CTA c of a tile walks row blocks c, c + CTAs, ...: every block once, each CTA about iters of them."""
    for n_blocks, iters in [(128, 1), (128, 2), (128, 3), (64, 64), (64, 100), (1, 4), (5, 4)]:
        ctas = row_block_ctas(n_blocks, iters)
        walks = [list(range(c, n_blocks, ctas)) for c in range(ctas)]
        assert sorted(b for walk in walks for b in walk) == list(range(n_blocks))
        assert all(walks) and max(map(len, walks)) == -(-n_blocks // ctas) <= max(1, iters)
    assert row_block_ctas(128, 1) == 128 and row_block_ctas(128, 3) == 43 and row_block_ctas(64, 64) == 1


def test_rows_iters_is_the_switch_over_the_default(monkeypatch):
    import strata_ray.kernels.expert_words as ew

    monkeypatch.delenv("STRATA_ROWS_ITERS", raising=False)
    # the defaults: the down launch walks at tiles of 8 and more only (session 51's sweep)
    assert [rows_iters(bt, two=False) for bt in (1, 2, 4, 8, 16)] == [1, 1, 1, 4, 4]
    by_tile = {1: 1, 2: 2, 8: 4}
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_iters": by_tile, "cuda_down_iters": 1})
    # a tile size between two listed takes the one below
    assert [rows_iters(bt) for bt in (1, 2, 4, 8, 16)] == [1, 2, 2, 4, 4]
    assert [rows_iters(bt, two=False) for bt in (1, 8)] == [1, 1]  # the down launch's own
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_iters": 3})  # one number: every tile size
    assert rows_iters(1) == rows_iters(8) == 3
    monkeypatch.setenv("STRATA_ROWS_ITERS", "8")  # both launches
    assert rows_iters(1) == rows_iters(4) == rows_iters(8, two=False) == 8


def test_rows_early_is_the_switch_over_the_default(monkeypatch):
    import strata_ray.kernels.expert_words as ew

    monkeypatch.delenv("STRATA_ROWS_EARLY", raising=False)
    for default in (False, True):
        monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_early": default})
        assert rows_early() is default
        monkeypatch.setenv("STRATA_ROWS_EARLY", "0" if default else "1")
        assert rows_early() is not default
        monkeypatch.delenv("STRATA_ROWS_EARLY")
    # cuda_early_down: the down launches' EARLY only where EARLY is on at all, the gate / up launch's always
    for early, down in itertools.product((False, True), repeat=2):
        monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_early": early, "cuda_early_down": down})
        assert (rows_early(), rows_early(two=True), rows_early(two=False)) == (early, early, early and down)
    monkeypatch.setenv("STRATA_ROWS_EARLY", "1")
    assert (rows_early(), rows_early(two=False)) == (True, True)  # the last WORDS: cuda_early_down on


def test_decode_tiles_of_the_words_variant_fit_the_cuda_rows(monkeypatch):
    """A verify window over a layer of 4096-value Q4_0 rows gets tiles of 4 (the CUDA form's most there) where
    the CUDA form is on; the other variants, prompt tiles and machines without it keep next_pow2(tokens)."""
    import strata_ray.kernels.expert_gpu as eg

    wide_rows = _layer(4096, 256, 2)
    q40 = _layer(2048, 512, 2)
    monkeypatch.setattr(eg, "cuda_rows_on", lambda: False)
    assert eg.tile_entries(8, "decode", "words", wide_rows) == 8
    monkeypatch.setattr(eg, "cuda_rows_on", lambda: True)
    assert eg.tile_entries(8, "decode", "words", wide_rows) == 4
    assert eg.tile_entries(8, "decode", "words", q40) == 8 and eg.tile_entries(3, "decode", "words", q40) == 4
    assert eg.tile_entries(1, "decode", "words", wide_rows) == 1
    assert eg.tile_entries(8, "decode", "simple", wide_rows) == 8
    assert eg.tile_entries(8, "decode", "words", None) == 8
    assert eg.tile_entries(300, "prompt", "words", wide_rows) == 64
    import strata_ray.kernels.expert_words as ew

    # the bench's cut: decode tiles of the words variant only
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_bt": 2})
    assert eg.tile_entries(8, "decode", "words", q40) == 2 and eg.tile_entries(1, "decode", "words", q40) == 1
    assert eg.tile_entries(8, "decode", "simple", q40) == 8
    assert eg.tile_entries(300, "prompt", "words", q40) == 64


def _check(layer: ExpertLayer, n_ent: int, seed: int = 0, n_tok: int = 1, act_offset: int = 0,
           tiles_reversed: bool = False) -> None:
    """n_ent entries of n_tok tokens (tiles of up to next_pow2(n_tok) entries of one expert) over the layer's
    experts: the GPU rows, every element written, equal the CPU rows bit for bit. act_offset: the activation
    codes handed in at that many bytes past a 16-byte boundary (the kernel's 4-byte staging path);
    tiles_reversed: a host plan of one-entry tiles in reverse order (tile y then starts at M - 1 - y, not at
    y as the engine's plans do)."""
    from strata_ray.kernels.expert_gpu import expert_ffn_gpu, quantize_act_gpu

    rng = np.random.default_rng(seed + n_ent)
    x = (rng.standard_normal((n_tok, layer.n_embd)) * 2).astype(np.float32)
    tok = rng.integers(0, n_tok, n_ent).astype(np.int32)
    n_expert = layer.gate.shape[0]
    exp = rng.integers(0, n_expert, n_ent).astype(np.int32)
    want = expert_ffn_cpu(x, tok, exp, layer).view(np.int32)
    slots = ExpertLayer(*(torch.from_numpy(np.ascontiguousarray(w)).cuda() for w in (layer.gate, layer.up,
                                                                                       layer.down)),
                        layer.gate_type, layer.up_type, layer.down_type)
    out = torch.full((n_ent, layer.n_embd), float("nan"), device="cuda")  # poisoned: every element written
    x_gpu = torch.from_numpy(x).cuda()
    act = None
    if act_offset:
        xq, xd, xs = quantize_act_gpu(x_gpu)
        buf = torch.empty(xq.numel() + 16, dtype=torch.int8, device="cuda")
        moved = buf[act_offset:act_offset + xq.numel()].view(xq.shape)
        moved.copy_(xq)
        assert moved.data_ptr() % 16 == act_offset
        act = (moved, xd, xs)
    tok_gpu, exp_gpu = (torch.from_numpy(a).cuda() for a in (tok, exp))
    plan = None
    if tiles_reversed:
        from strata_ray.kernels.tile_plan import plan_tiles_host

        order, sorted_slot, tile_start = plan_tiles_host(exp, 1)
        # copies: a reversed view of one element counts as contiguous to numpy and keeps its negative
        # stride, which torch.from_numpy refuses
        plan = [torch.from_numpy(a.copy()).cuda() for a in (order, sorted_slot, tile_start[::-1])]
    got = expert_ffn_gpu(x_gpu, tok_gpu, exp_gpu, slots, mode="decode", out=out, variant="words", act=act,
                         plan=plan)
    assert np.array_equal(got.cpu().numpy().view(np.int32), want), n_ent


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("swiglu", [8, 0])  # the SwiGLU in the down launch at every tile size, or its own
def test_gpu_cuda_rows_equal_cpu_rows(monkeypatch, swiglu):
    pytest.importorskip("cupy")
    import strata_ray.kernels.expert_gpu as eg
    import strata_ray.kernels.expert_words as ew

    monkeypatch.setenv("STRATA_WORDS_CUDA", "1")
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_swiglu": swiglu})
    folded = Counter()

    def recorded(*args):  # which launches the fold took: it must take some with the cap, none without
        took = ew.launch_words_swiglu(*args)
        folded[took] += 1
        return took

    monkeypatch.setattr(eg, "launch_words_swiglu", recorded)
    wide = _layer(2048, 512, 12)  # the 80b-a3b's widths
    _check(wide, 10)
    _check(wide, 40, n_tok=4, act_offset=4)  # codes off a 16-byte boundary: staged a word at a time
    _check(_layer(256, 768, 5), 33)  # 4 lanes a gate row, 12 pairs (27 words a lane) a down row
    _check(_layer(256, 192, 4), 9)  # a 192-value down row: 6 blocks, the fold's last 16-byte load half used
    _check(_layer(512, 128, 5, down=Q8_0), 1)  # a Q8_0 down takes the Triton tile
    # verify windows: tiles of several entries of one expert share its weight words
    for n_tok, n_ent in [(2, 20), (3, 33), (8, 80), (8, 222)]:
        _check(wide, n_ent, n_tok=n_tok)
    _check(_layer(256, 768, 5), 33, n_tok=5)  # 8 entries a tile, 4 lanes a gate row
    _check(_layer(4096, 256, 3), 17, n_tok=8)  # a 4096-value gate row: 8 entries are over the shared memory,
    # so tiles of 4
    _check(_layer(4096, 256, 3), 17, n_tok=3)  # 4 entries a tile, 2 pairs a lane
    # Q4_K layers: a quarter super-block a lane, tiles of up to 8 entries
    q4k = _layer(2048, 512, 12, down=Q4_K, gate_up=Q4_K)
    for n_tok, n_ent in [(1, 10), (2, 20), (5, 40)]:
        _check(q4k, n_ent, n_tok=n_tok)
    _check(_layer(512, 256, 5, down=Q4_0, gate_up=Q4_K), 33)  # Q4_K gate / up, Q4_0 down
    q4km = _layer(2048, 512, 12, down=Q6_K, gate_up=Q4_K)  # a Q4_K_M file's experts
    for n_tok, n_ent in [(1, 10), (2, 20), (8, 80)]:
        _check(q4km, n_ent, n_tok=n_tok)
    _check(_layer(1024, 512, 5, down=Q6_K, gate_up=Q6_K), 17, n_tok=3)  # Q6_K gate / up too
    q8 = _layer(2048, 512, 12, down=Q8_0, gate_up=Q8_0)  # Q8_0 block pairs
    for n_tok, n_ent in [(1, 10), (3, 33), (8, 80)]:
        _check(q8, n_ent, n_tok=n_tok)
    for rpw, warps in [(1, 2), (4, 8)]:
        monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_rpw": rpw, "cuda_warps": warps})
        _check(wide, 10)
        _check(_layer(256, 768, 5), 3)
        _check(wide, 40, n_tok=4)
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_rpw": 2, "cuda_warps": 4})
    # CTAs walking several row blocks, each block's successor loaded ahead: 2 blocks a CTA, an uneven walk
    # (3: 128 gate/up blocks over 43 CTAs), and one CTA a tile walking them all
    for iters in ("2", "3", "64"):
        monkeypatch.setenv("STRATA_ROWS_ITERS", iters)
        _check(wide, 10)
        _check(wide, 40, n_tok=4, act_offset=4)
        _check(_layer(256, 192, 4), 9)
        _check(q4km, 80, n_tok=8)
        _check(q8, 33, n_tok=3)
        _check(_layer(1024, 512, 5, down=Q6_K, gate_up=Q6_K), 17, n_tok=3)
        # a partial last row block, loaded ahead: 384 gate / up rows over blocks of 256 (a lane a 64-value
        # row, 32 row groups a warp, rpw 2, 4 warps), and one partial down block of 64 rows
        _check(_layer(64, 192, 4), 9)
        _check(_layer(64, 192, 4), 9, n_tok=3)
    assert (folded[True] > 0) == (swiglu > 0), folded  # with the cap every launch it serves is folded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("iters", ["", "3"])  # the engine's walks, and an uneven walk of every tile size
def test_gpu_the_other_fold_form_gives_the_cpu_rows(monkeypatch, iters):
    """The fold form the default does not take (WORDS["cuda_cta_fold"]: the CTA's chains by its first threads
    after one barrier, or each warp's by its own lanes) gives the CPU's rows too: one- and several-entry
    tiles, 4-32 lanes a row, partial row blocks, every weight type, other row groups and warps."""
    pytest.importorskip("cupy")
    import strata_ray.kernels.expert_words as ew

    monkeypatch.setenv("STRATA_WORDS_CUDA", "1")
    monkeypatch.setenv("STRATA_ROWS_ITERS", iters)
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_cta_fold": not ew.WORDS["cuda_cta_fold"]})
    wide = _layer(2048, 512, 12)
    for n_tok, n_ent in [(1, 1), (1, 10), (4, 40), (8, 222)]:
        _check(wide, n_ent, n_tok=n_tok)
    _check(_layer(256, 768, 5), 33, n_tok=5)  # 4 lanes a gate row: 8 row groups a warp
    _check(_layer(256, 192, 4), 9)
    _check(_layer(64, 192, 4), 9, n_tok=3)  # partial last row blocks
    for gate_up, down in [(Q4_K, Q6_K), (Q6_K, Q6_K), (Q8_0, Q8_0)]:
        layer = _layer(1024, 512, 5, down=down, gate_up=gate_up)
        _check(layer, 10)
        _check(layer, 33, n_tok=3)
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_rpw": 4, "cuda_warps": 8})
    _check(wide, 10)
    _check(wide, 40, n_tok=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("early", [True, False])
def test_gpu_the_early_prologue_gives_the_cpu_rows(monkeypatch, early):
    """EARLY (WORDS["cuda_early"]): one-entry tiles whose slot and order were loaded beside TILE_START, one
    activation row read with no lookup, and a tile that does not start at its own index (the fallback) give
    the CPU's rows; tiles of several entries take the lookups as before. Both settings, so either default is
    tested."""
    pytest.importorskip("cupy")
    import strata_ray.kernels.expert_words as ew

    monkeypatch.setenv("STRATA_WORDS_CUDA", "1")
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_early": early})
    wide = _layer(2048, 512, 12)
    for n_ent in (1, 10, 33):  # one token: one activation row
        _check(wide, n_ent)
        _check(wide, n_ent, tiles_reversed=True)
    _check(wide, 10, act_offset=4)
    _check(_layer(256, 192, 4), 9)  # 4 lanes a gate row, 8 a down row
    _check(wide, 40, n_tok=4)  # tiles of up to 4 entries: no EARLY there
    for gate_up, down in [(Q4_K, Q6_K), (Q6_K, Q6_K), (Q8_0, Q8_0)]:
        _check(_layer(1024, 512, 5, down=down, gate_up=gate_up), 10)
    # several activation rows in one-entry tiles: the tile cut to one entry (a bench knob)
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_early": early, "cuda_bt": 1})
    _check(wide, 40, n_tok=4)
    _check(wide, 40, n_tok=4, tiles_reversed=True)
    _check(wide, 40, n_tok=4, act_offset=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("iters", ["", "3"])  # the engine's walks, and an uneven walk of every tile size
def test_gpu_the_biased_terms_give_the_cpu_rows(monkeypatch, iters):
    """BIAS (WORDS["cuda_bias"]): the block integers carried with the int-to-float bias, float() one
    subtraction, for every type that takes it (Q4_0, Q8_0, Q4_K; Q6_K's forms are the plain ones), in
    one-entry tiles, tiles of several entries and the walking forms, with the SwiGLU in the down launch and
    between."""
    pytest.importorskip("cupy")
    import strata_ray.kernels.expert_words as ew

    monkeypatch.setenv("STRATA_WORDS_CUDA", "1")
    if iters:
        monkeypatch.setenv("STRATA_ROWS_ITERS", iters)
    wide = _layer(2048, 512, 12)
    for swiglu in (1, 0):
        monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_bias": True, "cuda_swiglu": swiglu})
        _check(wide, 10)
        _check(wide, 40, n_tok=4, act_offset=4)
        _check(wide, 80, n_tok=8)
        _check(_layer(256, 192, 4), 9)
        for gate_up, down in [(Q8_0, Q8_0), (Q4_K, Q4_K), (Q4_K, Q6_K)]:
            layer = _layer(2048, 512, 12, down=down, gate_up=gate_up)
            for n_tok, n_ent in [(1, 10), (3, 33), (8, 80)]:
                _check(layer, n_ent, n_tok=n_tok)


def test_the_bias_form_is_an_option_off_by_default():
    """WORDS["cuda_bias"] is off until a GPU has timed it; on, every form is compiled with BIAS, and it is
    part of a compiled kernel's key (a sweep that turns it on gets its own kernels)."""
    import strata_ray.kernels.expert_rows_cuda as erc
    import strata_ray.kernels.expert_words as ew

    assert ew.WORDS["cuda_bias"] is False
    assert "-DBIAS=0" in build_options(2048, True, 1, 2, 4, Q4_0)
    assert "-DBIAS=1" in build_options(512, False, 8, 2, 4, Q4_K, prefetch=True, bias=True)
    assert "#if BIAS" in erc._SOURCE and "I2F_BIAS" in erc._SOURCE


def test_the_engine_form_follows_the_words_of_now(monkeypatch):
    """engine_form: build_options' arguments of the form the engine launches (and cuda_resources compiles),
    read from WORDS at the call, so a sweep's or a test's WORDS reach both."""
    import strata_ray.kernels.expert_rows_cuda as erc
    import strata_ray.kernels.expert_words as ew

    form = erc.engine_form(2048, True, 4, Q4_0, prefetch=True)
    assert form == dict(k=2048, two=True, bt=4, rpw=ew.WORDS["cuda_rpw"], warps=ew.WORDS["cuda_warps"],
                        wtype=Q4_0, prefetch=True, swiglu=False, cta_fold=bool(ew.WORDS["cuda_cta_fold"]),
                        early=rows_early(True), bias=bool(ew.WORDS["cuda_bias"]))
    monkeypatch.setitem(ew.__dict__, "WORDS", {**ew.WORDS, "cuda_bias": True, "cuda_rpw": 4})
    opts = build_options(**erc.engine_form(512, False, 8, Q4_K))
    assert "-DBIAS=1" in opts and "-DRPW=4" in opts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("wtype", [Q4_0, Q8_0, Q4_K, Q6_K])
@pytest.mark.parametrize("n_tok", [1, 3, 8])
def test_gpu_the_swiglu_down_launch_is_the_swiglu_kernel_then_the_down_launch(wtype, n_tok):
    """The down launch that makes its codes from the gate / up rows (SWIGLU) writes the rows of the SwiGLU
    kernel's codes through the plain down launch, bit for bit, blocks the quantization treats apart
    included: an infinity and a NaN (poisoned: d NaN, codes 0), all zeros and all below TINY (d 0), a
    SwiGLU that overflows (g u past the float range)."""
    pytest.importorskip("cupy")
    from strata_ray.kernels.expert_gpu import plan_tiles, tile_entries
    from strata_ray.kernels.expert_rows_cuda import cuda_rows_ready, launch_cuda_rows
    from strata_ray.kernels.expert_words import _swiglu_tail

    layer = _layer(2048, 512, 12, down=wtype, gate_up=wtype)
    wd = torch.from_numpy(np.ascontiguousarray(layer.down)).cuda()
    n_ent = 10 * n_tok
    gen = torch.Generator(device="cuda").manual_seed(n_tok)
    gu = torch.randn((n_ent, 2, 512), device="cuda", generator=gen) * 3  # [M, 2, n_ff]
    gu[0, 0, 5] = float("inf")
    gu[1, 1, 40] = float("nan")
    gu[2, :, 64:96] = 0.0
    gu[3, :, 96:128] = 1e-12  # h ~1e-24: below TINY
    gu[4, 0, 130], gu[4, 1, 130] = 60.0, 1e38  # h = 6e39: an infinity
    bt = tile_entries(n_tok, "decode", "words", layer)
    slot = torch.randint(0, 12, (n_ent,), device="cuda", generator=gen, dtype=torch.int32)
    plan = (*plan_tiles(slot, bt, 12), bt)
    assert cuda_rows_ready(2048, 512, False, bt, wtype, torch.cuda.current_device(), swiglu=True)
    hq = torch.empty((n_ent, 512), dtype=torch.int8, device="cuda")
    hd = torch.empty((n_ent, 16), dtype=torch.float32, device="cuda")
    hs = torch.empty((n_ent, 16), dtype=torch.int32, device="cuda")
    _swiglu_tail(gu, hq, hd, hs, 512)
    assert hd[0, 0].isnan() and hd[1, 1].isnan() and hd[4, 4].isnan() and hd[2, 2] == 0 and hd[3, 3] == 0
    want = torch.full((n_ent, 2048), 7.0, device="cuda")
    got = torch.full((n_ent, 2048), 7.0, device="cuda")
    assert launch_cuda_rows((hq, hd, hs), None, plan, wd, wd, want, 2048, 512, two=False, wtype=wtype)
    assert launch_cuda_rows((gu, gu, gu), None, plan, wd, wd, got, 2048, 512, two=False, wtype=wtype,
                            swiglu=True)
    assert not (got == 7.0).any()  # every element written
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_a_swiglu_form_that_cannot_be_built_is_not_ready(refusing_nvrtc, caplog):
    """A refused SwiGLU form: not ready (launch_words_swiglu then launches the SwiGLU kernel between, the
    same bits), one warning naming that, and no second try."""
    import strata_ray.kernels.expert_rows_cuda as erc

    tries = refusing_nvrtc(erc)
    with caplog.at_level("WARNING", logger="strata_ray.kernels.nvrtc"):
        assert not erc.cuda_rows_ready(2048, 512, False, 1, Q4_0, 0, swiglu=True)
        assert not erc.cuda_rows_ready(2048, 512, False, 1, Q4_0, 0, swiglu=True)
    # the key: (k, two, bt, rpw, warps, device, wtype, prefetch, swiglu, cta_fold, early, bias)
    assert len(tries) == 1 and tries[0][8] is True
    assert [r.getMessage().split("; ")[-1] for r in caplog.records] == [
        "the SwiGLU kernel between the two launches takes its place (the same bits)"]


def test_the_swiglu_form_is_a_down_launchs():
    with pytest.raises(KernelError, match="down launch"):
        build_options(2048, True, 1, 2, 4, Q4_0, swiglu=True)


def test_a_kernel_that_cannot_be_built_leaves_the_launch_to_triton(refusing_nvrtc, caplog):
    """An NVRTC or driver that refuses the source: None (launch_words then takes the Triton tile), one
    warning, and no second try."""
    import strata_ray.kernels.expert_rows_cuda as erc

    tries = refusing_nvrtc(erc)
    with caplog.at_level("WARNING", logger="strata_ray.kernels.nvrtc"):
        assert erc.cuda_rows_kernel(2048, True, 0) is None
        assert erc.cuda_rows_kernel(2048, True, 0) is None
    assert len(tries) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "the CUDA C expert rows could not be built (RuntimeError: nvrtc: error: invalid value for "
        "--gpu-architecture); a Triton tile takes their launches (the same bits)"]
