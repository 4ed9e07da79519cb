"""One token's resident-entry plan in one launch: which of its K routed entries sit in the slot cache, and
the expert kernels' tiles over them.

The pipelined decode (experts/decode_pipeline.py) plans each layer on the device, inside the layer's graph.
Through the general `expert_gpu.plan_tiles` (a stable sort, then cummax / cumsum / scatter to cut runs of
one slot into tiles) and the masking of the misses' tiles, that plan took ~30 small kernels a layer,
~1,400 launches a token on the 48-layer 80b-a3b. A one-token launch has tiles of one entry (BT = 1:
`tile_entries(1, "decode", ...)`), and K distinct experts, so no sort is needed: entry k is tile k, live
where its expert is resident. The expert kernels compute each tile's rows alone, so the rows have the
same bits whatever the tiles' order.

`decode_plan_pcie` adds the misses the GPU computes itself (a budget decode, STRATA_PCIE_SHARE): the first
`contract.pcie_entries(M, share)` of a layer's M misses in k order, the CPU worker computing the others.
Their host_start marks them and host_slot names their expert in the host store: the pipelined decode copies
entry k's expert into staging slot k over PCIe (gather_copy.stage_experts) and runs their tiles there. The
hit mask marks them too: the combine takes their rows from the GPU's rows.

`decode_plan_reference` / `decode_plan_pcie_reference` are the torch twins (the oracles of the tests; also
the CPU form). Triton is imported on first use only; TRITON_INTERPRET=1 runs the kernel on the CPU
(tests/kernels/test_decode_plan.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .contract import pcie_entries
from .lazy_triton import jit_bodies
from .tile_plan import next_pow2

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


def _check(table: Tensor, base: int, ids: Tensor, n_expert: int, share: int = 0) -> None:
    if table.dtype != torch.int32 or table.ndim != 1:
        raise ValueError(f"decode_plan: the residency table must be int32 [L * X], got {table.dtype} "
                         f"{list(table.shape)}")
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(f"decode_plan: ids must be one token's [K] expert ids, got {list(ids.shape)}")
    if base < 0 or base + n_expert > table.numel():
        raise ValueError(f"decode_plan: layer base {base} + {n_expert} experts is past the table "
                         f"({table.numel()} entries)")
    if not 0 <= share <= 1000:
        raise ValueError(f"decode_plan: the PCIe share is in permille, 0 to 1000, got {share}")


def decode_plan_reference(table: Tensor, base: int, ids: Tensor, n_expert: int
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """table int32 [L * X] (slot or -1), base = layer * X, ids int [K] -> (hit int32 [K], order int32 [K],
    slot int32 [K], tile_start int32 [K]): order is k, slot the entry's slot (-1: not resident), tile k
    starts at entry k where resident, else -1 (no tile)."""
    _check(table, base, ids, n_expert)
    slot = table[base + ids.long()]  # [K] int32
    hit = slot >= 0
    k = torch.arange(ids.numel(), dtype=torch.int32, device=ids.device)
    return hit.to(torch.int32), k, slot, torch.where(hit, k, torch.full_like(k, -1))


def decode_plan_pcie_reference(table: Tensor, base: int, ids: Tensor, n_expert: int, share: int
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """decode_plan_reference plus the misses the GPU reads over PCIe: (hit, order, slot, tile_start,
    host_slot, host_start), int32 [K] each. share: permille of the misses (contract.pcie_entries). The
    first pcie_entries(M, share) misses in k order are PCIe entries: hit 1, host_slot their expert id,
    host_start k; every other host_start is -1. slot / tile_start are the resident tiles as before."""
    _check(table, base, ids, n_expert, share)
    hit, order, slot, start = decode_plan_reference(table, base, ids, n_expert)
    miss = hit == 0
    rank = torch.cumsum(miss.to(torch.int32), 0) - miss.to(torch.int32)  # misses before entry k
    pcie = miss & (rank < pcie_entries(int(miss.sum()), share))
    host_start = torch.where(pcie, order, torch.full_like(order, -1))
    return (hit | pcie.to(torch.int32)), order, slot, start, ids.to(torch.int32), host_start


def _plan_body(TABLE, IDS, HIT, ORDER, SLOT, START, HSLOT, HSTART, base, K, share, BLOCK: tl.constexpr,
               PCIE: tl.constexpr):
    # TABLE int32 [L * X]; IDS int [K]; HIT, ORDER, SLOT, START (and with PCIE: HSLOT, HSTART) int32 [K].
    # One program, one lane an entry.
    k = tl.arange(0, BLOCK)
    live = k < K
    expert = tl.load(IDS + k, mask=live, other=0).to(tl.int64)
    slot = tl.load(TABLE + base + expert, mask=live, other=-1)
    hit = slot >= 0
    tl.store(ORDER + k, k, mask=live)
    tl.store(SLOT + k, slot, mask=live)
    tl.store(START + k, tl.where(hit, k, -1), mask=live)
    if PCIE:  # the first pcie_entries(M, share) misses in k order (contract.pcie_entries, written out)
        miss = (live & (slot < 0)).to(tl.int32)
        rank = tl.cumsum(miss, 0) - miss
        n_pcie = (tl.sum(miss, 0) * share + 500) // 1000
        pcie = (miss > 0) & (rank < n_pcie)
        hit = hit | pcie
        tl.store(HSLOT + k, expert.to(tl.int32), mask=live)
        tl.store(HSTART + k, tl.where(pcie, k, -1), mask=live)
    tl.store(HIT + k, hit.to(tl.int32), mask=live)


def decode_plan(table: Tensor, base: int, ids: Tensor, n_expert: int, hit: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """decode_plan_reference in one launch (the same tensors); CUDA-graph capturable. hit: an int32 [K]
    tensor to write the mask into (a graph's static buffer), else a new one."""
    return _launch(table, base, ids, n_expert, hit, 0)


def decode_plan_pcie(table: Tensor, base: int, ids: Tensor, n_expert: int, share: int,
                     hit: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """decode_plan_pcie_reference in one launch (the same tensors); CUDA-graph capturable."""
    return _launch(table, base, ids, n_expert, hit, share)


def _launch(table: Tensor, base: int, ids: Tensor, n_expert: int, hit: Tensor | None, share: int):
    _check(table, base, ids, n_expert, share)
    n = ids.numel()
    if hit is None:
        hit = torch.empty(n, dtype=torch.int32, device=ids.device)
    elif hit.shape != (n,) or hit.dtype != torch.int32 or not hit.is_contiguous():
        raise ValueError(f"decode_plan: hit must be a contiguous int32 [{n}] tensor")
    pcie = share > 0
    order, slot, start, hslot, hstart = (torch.empty(n if pcie or i < 3 else 1, dtype=torch.int32,
                                                     device=ids.device) for i in range(5))
    _kernel()[(1,)](table, ids.contiguous(), hit, order, slot, start, hslot, hstart, base, n, share,
                    BLOCK=next_pow2(n), PCIE=pcie, num_warps=1)
    return (hit, order, slot, start, hslot, hstart) if pcie else (hit, order, slot, start)


@functools.cache
def _kernel():
    return jit_bodies(_plan_body)[0]
