"""PipelinedDecodeRows' parts that run without CUDA: the PCIe share's staging slots, the token graphs' and
copies' defaults. The pipelined decode
itself needs CUDA graphs (tests/experts/test_tiered_gpu.py, -m gpu); here the staging copy (Triton
interpreter) and the slot views it feeds are checked against the host layer, byte for byte, and the rows
the expert kernels compute from the slots against the CPU rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata_ray.experts.decode_pipeline import (
    DECODE_WARM,
    TOKEN_GRAPH_PREFETCH,
    _staging_plan,
    ahead_layer,
    decode_warm,
    down_prefetch,
    pinned_block,
    pipeline_supported,
    team_unit_rows,
    token_graph_and_ahead,
)
from strata_ray.experts.host_store import BlobLayout
from strata_ray.kernels.block_dots import HALF_ROWS, ROWS
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.kernels.gather_copy import stage_experts
from tests.kernels.layers import N_EMBD, layer_for
from tests.kernels.triton_interpret import interpret

K = 4


def _layout(lay) -> BlobLayout:
    return BlobLayout(lay.n_embd, lay.n_ff, lay.gate.shape[2], lay.up.shape[2], lay.down.shape[2],
                      lay.gate_type, lay.up_type, lay.down_type)


def _pinned_addresses(lay):
    """HostStore.pinned_addresses' form for a C-contiguous layer: per part (address of expert 0, bytes from
    one expert to the next, bytes of the part)."""
    return [(a.ctypes.data, a.strides[0], a.shape[1] * a.shape[2]) for a in (lay.gate, lay.up, lay.down)]


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K+Q6_K"])
def test_staging_views_are_the_slot_cache_layout(name):
    """The views cut staging slot k into gate | up | down as a cache slot's blob; its table points at each
    part of an expert in the host layer (HostStore.pinned_addresses' form)."""
    lay = layer_for(name)
    layout = _layout(lay)
    staging = torch.zeros((K, layout.nbytes + 8), dtype=torch.uint8)
    parts = _pinned_addresses(lay)
    table, part_bytes, slots = _staging_plan(parts, layout, staging)
    assert part_bytes == max(layout.gate_bytes, layout.up_bytes, layout.down_bytes)
    assert table[:, 3].tolist() == [0, layout.gate_bytes, layout.gate_bytes + layout.up_bytes]
    blob = np.concatenate([lay.gate[5].ravel(), lay.up[5].ravel(), lay.down[5].ravel()])
    staging[2, : blob.size] = torch.from_numpy(blob)
    for view, host in zip((slots.gate, slots.up, slots.down), (lay.gate, lay.up, lay.down), strict=True):
        assert tuple(view.shape) == (K, *host.shape[1:])
        assert np.array_equal(view[2].numpy(), host[5])


@interpret
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0+Q4_0"])
def test_staged_experts_give_the_cpu_rows(name):
    """stage_experts fills the slots the plan picks (entries 0 and 2 here) from the host layer; the rows from
    those slots equal the rows from the host layer, bit for bit."""
    pytest.importorskip("triton")
    from strata_ray.kernels.contract import ExpertLayer

    lay = layer_for(name)
    layout = _layout(lay)
    staging = torch.full((K, layout.nbytes), 7, dtype=torch.uint8)
    parts = _pinned_addresses(lay)
    table, part_bytes, slots = _staging_plan(parts, layout, staging)
    start = torch.tensor([0, -1, 2, -1], dtype=torch.int32)
    expert = torch.tensor([11, 3, 30, 0], dtype=torch.int32)
    stage_experts(start, expert, table, staging, part_bytes)
    for k, e in ((0, 11), (2, 30)):
        for view, host in zip((slots.gate, slots.up, slots.down), (lay.gate, lay.up, lay.down), strict=True):
            assert np.array_equal(view[k].numpy(), host[e])
    assert (staging[1] == 7).all() and (staging[3] == 7).all()  # entries the plan left out: untouched
    x = np.random.default_rng(0).standard_normal((1, N_EMBD)).astype(np.float32)
    tok = np.zeros(2, np.int32)
    want = expert_ffn_cpu(x, tok, np.array([11, 30], np.int32), lay)
    staged = ExpertLayer(*(np.ascontiguousarray(v.numpy()) for v in (slots.gate, slots.up, slots.down)),
                         lay.gate_type, lay.up_type, lay.down_type)
    got = expert_ffn_cpu(x, tok, np.array([0, 2], np.int32), staged)
    assert want.shape == (2, N_EMBD) and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("partial,env,prefetch,want", [
    (True, "", None, (True, TOKEN_GRAPH_PREFETCH)),  # the budget decode's default
    (False, "", None, (True, 0)),  # every expert resident: token graphs too, nothing to copy
    (True, "0", None, (False, 0)),  # per-layer graphs: a copy ahead costs host launches there
    (True, "0", 3, (False, 3)),  # an explicit count is kept
    (True, "1", 0, (True, 0)),
    (False, "1", 2, (True, 0)),  # nothing can miss: no copies
    (False, "0", None, (False, 0)),
])
def test_token_graph_and_copies_ahead_defaults(partial, env, prefetch, want):
    assert token_graph_and_ahead(partial, env, prefetch) == want


@pytest.mark.parametrize("env,want", [("", DECODE_WARM), ("0", False), ("1", True)])
def test_warming_follows_its_switch(env, want, monkeypatch):
    monkeypatch.setenv("STRATA_DECODE_WARM", env)
    assert decode_warm() is want


def test_the_routing_buffers_share_one_block_a_line_each():
    """pinned_block: the ids and codes the device hands the worker, zeroed views of one block (one page at
    the engine's sizes), each on a 64-byte boundary, none overlapping."""
    specs = [((10,), torch.int64), ((1, 2048), torch.int8), ((1, 64), torch.float32), ((1, 7), torch.int32)]
    views = pinned_block(specs)
    base = views[0].data_ptr()
    ends = 0
    for v, (shape, dtype) in zip(views, specs, strict=True):
        assert v.shape == shape and v.dtype == dtype and v.is_contiguous() and not v.any()
        assert (v.data_ptr() - base) % 64 == 0 and v.data_ptr() - base >= ends
        ends = v.data_ptr() - base + v.numel() * v.element_size()
    assert ends <= 4096  # ids and codes of a 2048-wide model: one page
    views[1].fill_(-1)
    assert not views[0].any() and not views[2].any()


@pytest.mark.parametrize("env,want", [("", False), ("0", False), ("1", True)])
def test_down_prefetch_is_an_env_switch_off_by_default(monkeypatch, env, want):
    monkeypatch.setenv("STRATA_DOWN_PREFETCH", env)
    assert down_prefetch() == want


@pytest.mark.parametrize("env,want", [("", "next"), ("same", "same"), ("next", "next")])
def test_copies_ahead_are_picked_a_layer_early_unless_asked(monkeypatch, env, want):
    monkeypatch.setenv("STRATA_AHEAD_LAYER", env)
    assert ahead_layer() == want


@pytest.mark.parametrize("env,want", [("", HALF_ROWS), ("half", HALF_ROWS), ("whole", ROWS)])
def test_team_units_are_half_tiles_unless_asked(monkeypatch, env, want):
    monkeypatch.setenv("STRATA_TEAM_UNITS", env)
    assert team_unit_rows() == want


def test_the_pipelined_decode_takes_contiguous_quantized_layers_of_one_width():
    """The worker keeps read-only C views of every trunk layer for the run: a strided layer (a fused gate_up
    the host store could not split) would be a copy of the whole layer, so such a model takes the decode
    without the pipeline; float layers, or none, too."""
    from types import SimpleNamespace

    from strata_ray.kernels.contract import ExpertLayer

    q8 = layer_for("Q8_0")
    fused = np.concatenate([q8.gate, q8.up], axis=1)
    n_ff = q8.gate.shape[1]
    strided = ExpertLayer(fused[:, :n_ff], fused[:, n_ff:], q8.down, q8.gate_type, q8.up_type, q8.down_type)

    def tiers(*layers):
        return SimpleNamespace(n_layers=len(layers), store=SimpleNamespace(layer=lambda b: layers[b]))

    assert pipeline_supported(tiers(q8, q8))
    assert not pipeline_supported(tiers(q8, strided))
    assert not pipeline_supported(tiers(q8, layer_for("F16")))
    assert not pipeline_supported(tiers())
