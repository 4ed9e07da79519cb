"""GPU expert kernels: rows bit-identical to the CPU kernels for every type, token count, grouping
and tile shape (run on the GPU machine: python -m pytest -m gpu tests/kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_ray.kernels.act_quant import quantize_act_sums
from strata_ray.kernels.contract import ExpertLayer
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from tests.kernels.layers import FLOAT_SETS, N_EMBD, TYPE_SETS, entries, layer_for

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _to_slots(layer: ExpertLayer, rng):
    """Upload the layer's experts to cache slots in a shuffled order; returns (slots, slot_of)."""
    perm = rng.permutation(layer.gate.shape[0])  # slot s holds expert perm[s]
    up = [torch.from_numpy(np.ascontiguousarray(w[perm])).cuda() for w in (layer.gate, layer.up, layer.down)]
    slot_of = np.argsort(perm).astype(np.int32)
    return ExpertLayer(*up, layer.gate_type, layer.up_type, layer.down_type), slot_of


def _gpu_rows(x, tok, exp, slots, slot_of, mode, variant=None):
    from strata_ray.kernels.expert_gpu import expert_ffn_gpu

    out = torch.full((len(tok), N_EMBD), float("nan"), device="cuda")  # poisoned
    rows = expert_ffn_gpu(torch.from_numpy(x).cuda(), torch.from_numpy(tok).cuda(),
                          torch.from_numpy(slot_of[exp]).cuda(), slots, mode=mode, out=out, variant=variant)
    assert rows.data_ptr() == out.data_ptr()
    return rows.cpu().numpy()


CASES = [  # (tokens, entries, top-k; 0 = random pairs)
    (1, 1, 1), (1, 8, 8), (5, 40, 8), (33, 132, 4), (200, 800, 4), (64, 64, 0),
]


@pytest.mark.parametrize("variant", ["words", "simple", "wide", "split"])
@pytest.mark.parametrize("name", [*TYPE_SETS, *FLOAT_SETS])
def test_gpu_rows_equal_cpu_rows(name, variant):
    rng = np.random.default_rng(7)
    layer = layer_for(name)
    slots, slot_of = _to_slots(layer, rng)
    for n_tok, n_ent, k in CASES:
        x = rng.standard_normal((n_tok, N_EMBD)).astype(np.float32)
        tok, exp = entries(rng, n_tok, n_ent, 37, k=k)
        cpu = expert_ffn_cpu(x, tok, exp, layer)
        for mode in ("decode", "prompt"):
            gpu = _gpu_rows(x, tok, exp, slots, slot_of, mode, variant)
            assert not np.isnan(gpu).any(), (name, n_tok, mode, variant)
            assert np.array_equal(gpu.view(np.int32), cpu.view(np.int32)), (name, n_tok, n_ent, mode, variant)


@pytest.mark.parametrize("variant", ["simple", "wide", "split"])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K+Q6_K"])
def test_one_hot_expert_and_duplicates(name, variant):
    """200 entries on one slot (many tiles of one expert) and repeated (token, expert) entries."""
    rng = np.random.default_rng(8)
    layer = layer_for(name)
    slots, slot_of = _to_slots(layer, rng)
    x = rng.standard_normal((200, N_EMBD)).astype(np.float32)
    tok = np.concatenate([np.arange(200), np.zeros(5, int)]).astype(np.int32)
    exp = np.concatenate([np.full(200, 3), np.full(5, 3)]).astype(np.int32)
    cpu = expert_ffn_cpu(x, tok, exp, layer)
    for mode in ("decode", "prompt"):
        rows = _gpu_rows(x, tok, exp, slots, slot_of, mode, variant)
        assert np.array_equal(rows.view(np.int32), cpu.view(np.int32)), (mode, variant)


def test_act_quant_gpu_equals_cpu():
    from strata_ray.kernels.expert_gpu import quantize_act_gpu

    rng = np.random.default_rng(9)
    x = (rng.standard_normal((300, 2048)) * np.exp(rng.uniform(-30, 8, (300, 1)))).astype(np.float32)
    x[0, :32] = 0
    x[1, :64] = 1e-20
    for got, want in zip(quantize_act_gpu(torch.from_numpy(x).cuda()), quantize_act_sums(x), strict=True):
        assert np.array_equal(got.cpu().numpy(), want)


@pytest.mark.parametrize("n_tok", [1, 33, 222])
def test_combine_rows_gpu_equals_the_torch_sequence(n_tok):
    from strata_ray.kernels.expert_gpu import combine_rows_gpu
    from strata_ray.model.moe import combine_rows

    rng = np.random.default_rng(n_tok)
    rows = torch.from_numpy(rng.standard_normal((n_tok, 10, N_EMBD)).astype(np.float32))
    w = torch.from_numpy(rng.uniform(0, 1, (n_tok, 10)).astype(np.float32))
    want = combine_rows(rows, w)  # on the CPU: every op rounded, in k order
    got = combine_rows_gpu(rows.cuda(), w.cuda()).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K+Q6_K"])
def test_a_host_made_plan_gives_the_same_rows(name):
    """expert_ffn_gpu with plan_tiles_host's plan (uploaded as the tiered decode does) == its own plan."""
    from strata_ray.kernels.expert_gpu import expert_ffn_gpu, tile_entries
    from strata_ray.kernels.tile_plan import plan_tiles_host

    rng = np.random.default_rng(10)
    layer = layer_for(name)
    slots, slot_of = _to_slots(layer, rng)
    for n_tok, n_ent, k in CASES:
        x = rng.standard_normal((n_tok, N_EMBD)).astype(np.float32)
        tok, exp = entries(rng, n_tok, n_ent, 37, k=k)
        for mode in ("decode", "prompt"):
            want = _gpu_rows(x, tok, exp, slots, slot_of, mode)
            plan = plan_tiles_host(slot_of[exp], tile_entries(n_tok, mode, "simple", slots))
            out = torch.full((len(tok), N_EMBD), float("nan"), device="cuda")  # poisoned
            got = expert_ffn_gpu(torch.from_numpy(x).cuda(), torch.from_numpy(tok).cuda(),
                                 torch.from_numpy(slot_of[exp]).cuda(), slots, mode=mode, variant="simple",
                                 plan=[torch.from_numpy(p).cuda() for p in plan], out=out)
            assert not torch.isnan(got).any()
            assert np.array_equal(got.cpu().numpy().view(np.int32), want.view(np.int32)), (n_tok, mode)
