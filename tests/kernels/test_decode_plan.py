"""One token's resident-entry plan (strata_ray/kernels/decode_plan.py): the torch twin's meaning, the kernel's
tensors equal to it (Triton interpreter on CPU machines, compiled with -m gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata_ray.kernels.contract import pcie_entries
from strata_ray.kernels.decode_plan import (
    decode_plan,
    decode_plan_pcie,
    decode_plan_pcie_reference,
    decode_plan_reference,
    prefetch_pick,
    prefetch_pick_reference,
)
from strata_ray.kernels.tile_plan import plan_tiles_host
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()
N_LAYER, N_EXPERT = 3, 37


def _table(seed: int, resident: float) -> torch.Tensor:
    """[L * X] int32: each (layer, expert) a distinct slot with probability `resident`, else -1."""
    g = torch.Generator().manual_seed(seed)
    live = torch.rand(N_LAYER * N_EXPERT, generator=g) < resident
    table = torch.full((N_LAYER * N_EXPERT,), -1, dtype=torch.int32)
    table[live] = torch.randperm(int(live.sum()), generator=g).to(torch.int32)
    return table


def _cases():
    for seed, resident, k in [(0, 0.5, 10), (1, 0.0, 10), (2, 1.0, 10), (3, 0.5, 1), (4, 0.3, 33)]:
        g = torch.Generator().manual_seed(100 + seed)
        yield _table(seed, resident), seed % N_LAYER, torch.randperm(N_EXPERT, generator=g)[:k]


@pytest.mark.parametrize("case", range(5))
def test_reference_tiles_are_the_resident_entries_of_plan_tiles(case):
    """Its live tiles are plan_tiles' one-entry tiles (BT = 1) minus those of slot -1: the same (entry, slot)
    pairs, so the expert kernels compute the same rows."""
    table, layer, ids = list(_cases())[case]
    hit, order, slot, start = decode_plan_reference(table, layer * N_EXPERT, ids, N_EXPERT)
    want_slot = table[layer * N_EXPERT + ids]
    assert torch.equal(hit, (want_slot >= 0).to(torch.int32))
    got = {(int(order[s]), int(slot[s])) for s in start.tolist() if s >= 0}
    h_order, h_slot, h_start = plan_tiles_host(np.where(want_slot >= 0, want_slot, -1), 1)
    want = {(int(h_order[s]), int(h_slot[s])) for s in h_start if h_slot[s] >= 0}
    assert got == want and len(got) == int(hit.sum())


@pytest.mark.parametrize("share", [1, 250, 600, 1000])
@pytest.mark.parametrize("case", range(5))
def test_pcie_reference_takes_the_misses_of_the_lowest_expert_ids(case, share):
    """The PCIe entries are the pcie_entries(M, share) misses of the lowest expert ids; hit marks them as
    well, the resident tiles are decode_plan's, and every PCIe tile reads its own expert from the host
    layer."""
    table, layer, ids = list(_cases())[case]
    base = layer * N_EXPERT
    r_hit, r_order, r_slot, r_start = decode_plan_reference(table, base, ids, N_EXPERT)
    hit, order, slot, start, hslot, hstart, pslot, astart = decode_plan_pcie_reference(table, base, ids,
                                                                                       N_EXPERT, share)
    assert torch.equal(order, r_order) and torch.equal(slot, r_slot) and torch.equal(start, r_start)
    misses = sorted((k for k in range(ids.numel()) if r_hit[k] == 0), key=lambda k: int(ids[k]))
    pcie = misses[: pcie_entries(len(misses), share)]
    assert hstart.tolist() == [k if k in pcie else -1 for k in range(ids.numel())]
    assert hit.tolist() == [int(r_hit[k] == 1 or k in pcie) for k in range(ids.numel())]
    assert hslot.tolist() == ids.tolist()
    assert (astart == -1).all() and torch.equal(pslot, order)  # nothing copied ahead


def _staged(table: torch.Tensor, base: int, ids: torch.Tensor, c: int) -> torch.Tensor:
    """[C] int32: a routed miss, a resident routed expert, an expert not routed, then -1s."""
    g = torch.Generator().manual_seed(c)
    miss = [int(e) for e in ids.tolist() if table[base + e] < 0]
    res = [int(e) for e in ids.tolist() if table[base + e] >= 0]
    other = [e for e in torch.randperm(N_EXPERT, generator=g).tolist() if e not in ids.tolist()]
    pick = (miss[-1:] + res[:1] + other[:1] + miss[:1] + [-1] * c)[:c]
    return torch.tensor(pick, dtype=torch.int32)


@pytest.mark.parametrize("share", [0, 400, 1000])
@pytest.mark.parametrize("c", [1, 3, 5])
@pytest.mark.parametrize("case", range(5))
def test_pcie_reference_gives_staged_misses_to_the_gpu_first(case, c, share):
    """A miss whose expert is staged is the GPU's, read from staging slot K + c; the other misses split by
    pcie_entries over their own count; a staged expert that is resident or not routed changes nothing."""
    table, layer, ids = list(_cases())[case]
    base, k = layer * N_EXPERT, ids.numel()
    staged = _staged(table, base, ids, c)
    r_hit = decode_plan_reference(table, base, ids, N_EXPERT)[0]
    hit, order, slot, start, hslot, hstart, pslot, astart = decode_plan_pcie_reference(
        table, base, ids, N_EXPERT, share, staged=staged)
    st = staged.tolist()
    ahead = [j for j in range(k) if r_hit[j] == 0 and int(ids[j]) in st]
    rest = sorted((j for j in range(k) if r_hit[j] == 0 and j not in ahead), key=lambda j: int(ids[j]))
    pcie = rest[: pcie_entries(len(rest), share)]
    assert hstart.tolist() == [j if j in pcie else -1 for j in range(k)]
    assert astart.tolist() == [j if j in ahead else -1 for j in range(k)]
    assert hit.tolist() == [int(r_hit[j] == 1 or j in pcie or j in ahead) for j in range(k)]
    for j in ahead:
        assert int(pslot[j]) == k + st.index(int(ids[j]))
    for j in pcie:
        assert int(pslot[j]) == j


@pytest.mark.parametrize("cap", [1, 2, 7])
@pytest.mark.parametrize("case", range(5))
def test_pick_takes_the_first_predicted_misses_in_rank_order(case, cap):
    table, layer, ids = list(_cases())[case]
    base = layer * N_EXPERT
    start, expert = prefetch_pick_reference(table, base, ids, N_EXPERT, cap)
    miss = [int(e) for e in ids.tolist() if table[base + e] < 0][:cap]
    assert expert.tolist() == miss + [-1] * (cap - len(miss))
    assert start.tolist() == list(range(len(miss))) + [-1] * (cap - len(miss))


def test_pcie_entries_rule():
    """Half up, never more than the misses, none at share 0, all at 1000."""
    assert [pcie_entries(m, 600) for m in range(7)] == [0, 1, 1, 2, 2, 3, 4]
    assert all(pcie_entries(m, 0) == 0 and pcie_entries(m, 1000) == m for m in range(40))
    assert all(0 <= pcie_entries(m, s) <= m for m in range(40) for s in range(0, 1001, 7))


def test_bad_arguments():
    table = _table(0, 0.5)
    with pytest.raises(ValueError, match="past the table"):
        decode_plan_reference(table, N_LAYER * N_EXPERT, torch.arange(3), N_EXPERT)
    with pytest.raises(ValueError, match="int32"):
        decode_plan_reference(table.long(), 0, torch.arange(3), N_EXPERT)
    with pytest.raises(ValueError, match="one token"):
        decode_plan_reference(table, 0, torch.arange(6).view(2, 3), N_EXPERT)
    with pytest.raises(ValueError, match="permille"):
        decode_plan_pcie_reference(table, 0, torch.arange(3), N_EXPERT, 1001)
    with pytest.raises(ValueError, match="staged must be int32"):
        decode_plan_pcie_reference(table, 0, torch.arange(3), N_EXPERT, 400, staged=torch.arange(2))
    with pytest.raises(ValueError, match="seven contiguous"):
        decode_plan_pcie(table, 0, torch.arange(3), N_EXPERT, 400, out=(torch.zeros(3, dtype=torch.int32),))
    with pytest.raises(ValueError, match="cap must be"):
        prefetch_pick_reference(table, 0, torch.arange(3), N_EXPERT, 0)
    with pytest.raises(ValueError, match="contiguous int32"):
        prefetch_pick(table, 0, torch.arange(3), N_EXPERT, torch.zeros(2, dtype=torch.int32),
                      torch.zeros(3, dtype=torch.int32))


def _kernel_cases(device):
    for table, layer, ids in _cases():
        table, ids = table.to(device), ids.to(device)
        want = decode_plan_reference(table, layer * N_EXPERT, ids, N_EXPERT)
        hit = torch.full((ids.numel(),), 7, dtype=torch.int32, device=device)  # poisoned: every lane written
        got = decode_plan(table, layer * N_EXPERT, ids, N_EXPERT, hit=hit)
        assert got[0] is hit
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        for share in (1, 600, 1000):
            want = decode_plan_pcie_reference(table, layer * N_EXPERT, ids, N_EXPERT, share)
            hit = torch.full((ids.numel(),), 7, dtype=torch.int32, device=device)
            got = decode_plan_pcie(table, layer * N_EXPERT, ids, N_EXPERT, share, hit=hit)
            assert got[0] is hit and len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w)
        for c in (1, 3):
            staged = _staged(table.cpu(), layer * N_EXPERT, ids.cpu(), c).to(device)
            for share in (0, 600):
                want = decode_plan_pcie_reference(table, layer * N_EXPERT, ids, N_EXPERT, share,
                                                  staged=staged)
                out = tuple(torch.full((ids.numel(),), 7, dtype=torch.int32, device=device) for _ in range(7))
                got = decode_plan_pcie(table, layer * N_EXPERT, ids, N_EXPERT, share, staged=staged, out=out)
                assert len(got) == len(want) == 8 and all(g is o for g, o in zip(got[1:], out, strict=True))
                for g, w in zip(got, want, strict=True):
                    assert torch.equal(g, w)
            # the pick, into poisoned buffers
            start = torch.full((c,), 7, dtype=torch.int32, device=device)
            expert = torch.full((c,), 7, dtype=torch.int32, device=device)
            prefetch_pick(table, layer * N_EXPERT, ids.view(1, -1), N_EXPERT, start, expert)
            w_start, w_expert = prefetch_pick_reference(table, layer * N_EXPERT, ids, N_EXPERT, c)
            assert torch.equal(start, w_start) and torch.equal(expert, w_expert)


@interpret
def test_interpreted_kernel_equals_reference():
    pytest.importorskip("triton")
    _kernel_cases("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_kernel_equals_reference():
    _kernel_cases("cuda")
