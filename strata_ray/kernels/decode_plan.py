"""One token's resident-entry plan in one launch: which of its K routed entries sit in the slot cache, and
the expert kernels' tiles over them.

The pipelined decode (experts/decode_pipeline.py) plans each layer on the device, inside the layer's graph.
Through the general `expert_gpu.plan_tiles` (a stable sort, then cummax / cumsum / scatter to cut runs of
one slot into tiles) and the masking of the misses' tiles, that plan took ~30 small kernels a layer,
~1,400 launches a token on the 48-layer 80b-a3b. A one-token launch has tiles of one entry (BT = 1:
`tile_entries(1, "decode", ...)`), and K distinct experts, so no sort is needed: entry k is tile k, live
where its expert is resident. The expert kernels compute each tile's rows alone, so the rows have the
same bits whatever the tiles' order.

`decode_plan_pcie` adds the misses the GPU computes itself (a budget decode, STRATA_PCIE_SHARE): the
`contract.pcie_entries(M, share)` of a layer's M misses with the lowest expert ids, the CPU worker computing
the others.
Their host_start marks them and host_slot names their expert in the host store: the pipelined decode copies
entry k's expert into staging slot k over PCIe (gather_copy.stage_experts) and runs their tiles there. The
hit mask marks them too: the combine takes their rows from the GPU's rows.

Predicted experts copied ahead (STRATA_DECODE_PREFETCH): while a layer's attention / GDN mixer runs, the
pipelined decode routes the layer's input (its residual before the mixer, through the MoE's norm and
router: the mixer adds little to the residual, so the prediction is mostly right) and `prefetch_pick`
takes the first `cap` non-resident experts of that prediction in rank order; they are copied into staging
slots K.. beside the mixer, when neither the host's memory nor PCIe has other work. The layer's plan
(`decode_plan_pcie(..., staged=...)`) then gives a miss whose expert was copied ahead to the GPU (its
tile reads staging slot K + c), and of the other misses the first contract.pcie_entries as before; the
worker reads the same staged list (kernels/publish) and applies the same rule (contract.pcie_entries).
A wrong prediction costs a copy and nothing else: the bits are the same, wherever a row is computed.

`decode_plan_reference` / `decode_plan_pcie_reference` / `prefetch_pick_reference` are the torch twins
(the oracles of the tests; also the CPU form). Triton is imported on first use only; TRITON_INTERPRET=1
runs the kernels on the CPU (tests/kernels/test_decode_plan.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .contract import pcie_entries
from .lazy_triton import jit_bodies
from .pdl import pdl_args
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


def _check_staged(staged: Tensor | None) -> None:
    if staged is not None and (staged.dtype != torch.int32 or staged.ndim != 1 or staged.numel() == 0):
        raise ValueError(f"decode_plan: staged must be int32 [C] expert ids (-1: none), got {staged.dtype} "
                         f"{list(staged.shape)}")


def decode_plan_pcie_reference(table: Tensor, base: int, ids: Tensor, n_expert: int, share: int,
                               staged: Tensor | None = None) -> tuple[Tensor, ...]:
    """decode_plan_reference plus the misses the GPU computes: (hit, order, slot, tile_start, host_slot,
    host_start, pcie_slot, pcie_start), int32 [K] each. share: permille of the misses (contract.pcie_entries);
    staged: int32 [C], the experts copied ahead into staging slots K.. (-1: none; module docstring).
    A miss whose expert is staged[c] is the GPU's, its tile reading staging slot K + c; of the other misses
    the pcie_entries(R, share) of the lowest expert ids are copied (host_start k, host_slot their expert
    id: into staging slot k) and the GPU's too; hit marks every entry the GPU computes; ahead_start is k for
    each staged miss (else -1: their tiles, launched apart from the copied ones), pcie_slot the staging slot
    of each (K + c for a staged miss, k otherwise). slot / tile_start are the resident tiles as before."""
    _check(table, base, ids, n_expert, share)
    _check_staged(staged)
    hit, order, slot, start = decode_plan_reference(table, base, ids, n_expert)
    miss = hit == 0
    pslot = order.clone()
    ahead = torch.zeros_like(miss)
    if staged is not None:
        k = ids.numel()
        for c, e in enumerate(staged.tolist()):
            match = miss & (ids == e) & (e >= 0)
            ahead |= match
            pslot = torch.where(match, torch.full_like(pslot, k + c), pslot)
    rest = miss & ~ahead
    # [K]: the other misses of a lower expert id than entry k's (a token's experts are distinct)
    rank = (rest[None, :] & (ids[None, :] < ids[:, None])).sum(1)
    pcie = rest & (rank < pcie_entries(int(rest.sum()), share))
    host_start = torch.where(pcie, order, torch.full_like(order, -1))
    astart = torch.where(ahead, order, torch.full_like(order, -1))
    hit = hit | (pcie | ahead).to(torch.int32)
    return hit, order, slot, start, ids.to(torch.int32), host_start, pslot, astart


def prefetch_pick_reference(table: Tensor, base: int, pred: Tensor, n_expert: int, cap: int
                            ) -> tuple[Tensor, Tensor]:
    """The experts to copy ahead from a predicted routing pred int [K'] (rank order): the first `cap`
    non-resident ones -> (start int32 [cap]: c where slot c is filled, else -1; expert int32 [cap]: the
    expert of staging slot K + c, else -1), in stage_experts' form."""
    _check(table, base, pred, n_expert)
    if cap < 1:
        raise ValueError(f"prefetch_pick: cap must be at least 1, got {cap}")
    miss = [int(e) for e in pred.tolist() if int(table[base + int(e)]) < 0][:cap]
    expert = torch.full((cap,), -1, dtype=torch.int32, device=pred.device)
    start = torch.full((cap,), -1, dtype=torch.int32, device=pred.device)
    expert[: len(miss)] = torch.tensor(miss, dtype=torch.int32)
    start[: len(miss)] = torch.arange(len(miss), dtype=torch.int32)
    return start, expert


def _plan_body(TABLE, IDS, HIT, ORDER, SLOT, START, HSLOT, HSTART, PSLOT, ASTART, STAGED, base, K, share,
               BLOCK: tl.constexpr, PCIE: tl.constexpr, C: tl.constexpr, PDL: tl.constexpr):
    # TABLE int32 [L * X]; IDS int [K]; HIT, ORDER, SLOT, START (and with PCIE: HSLOT, HSTART, PSLOT, ASTART)
    # int32 [K]; STAGED int32 [C] (C > 0: experts copied ahead). One program, one lane an entry. PDL: it
    # starts early, then waits (kernels/pdl.py)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    k = tl.arange(0, BLOCK)
    live = k < K
    expert = tl.load(IDS + k, mask=live, other=0).to(tl.int64)
    slot = tl.load(TABLE + base + expert, mask=live, other=-1)
    hit = slot >= 0
    tl.store(ORDER + k, k, mask=live)
    tl.store(SLOT + k, slot, mask=live)
    tl.store(START + k, tl.where(hit, k, -1), mask=live)
    if PCIE:  # the staged misses, then the pcie_entries(R, share) other misses of the lowest expert ids
        miss = live & (slot < 0)
        pslot = k
        ahead = k < 0
        for c in tl.static_range(C):
            e = tl.load(STAGED + c)
            match = miss & (expert == e) & (e >= 0)
            ahead = ahead | match
            pslot = tl.where(match, K + c, pslot)
        rest = (miss & ~ahead).to(tl.int32)
        # the other misses of a lower expert id than lane k's: [BLOCK, BLOCK] pairs, summed over the row's
        rank = tl.sum(((rest[None, :] > 0) & (expert[None, :] < expert[:, None])).to(tl.int32), 1)
        n_pcie = (tl.sum(rest, 0) * share + 500) // 1000  # contract.pcie_entries, written out
        pcie = (rest > 0) & (rank < n_pcie)
        hit = hit | pcie | ahead
        tl.store(HSLOT + k, expert.to(tl.int32), mask=live)
        tl.store(HSTART + k, tl.where(pcie, k, -1), mask=live)
        tl.store(PSLOT + k, pslot, mask=live)
        tl.store(ASTART + k, tl.where(ahead, k, -1), mask=live)
    tl.store(HIT + k, hit.to(tl.int32), mask=live)


def _pick_body(TABLE, PRED, START, EXPERT, base, K, BLOCK: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    # TABLE int32 [L * X]; PRED int [K] (rank order); START, EXPERT int32 [C]. One program: slot c takes the
    # (c+1)-th non-resident predicted expert.
    k = tl.arange(0, BLOCK)
    live = k < K
    pred = tl.load(PRED + k, mask=live, other=0).to(tl.int64)
    miss = (live & (tl.load(TABLE + base + pred, mask=live, other=0) < 0)).to(tl.int32)
    rank = tl.cumsum(miss, 0) - miss
    c = tl.arange(0, BC)  # BC: C rounded up to a power of two
    sel = (rank[None, :] == c[:, None]) & (miss[None, :] > 0)  # [C', BLOCK]
    has = tl.sum(sel.to(tl.int32), 1) > 0
    val = tl.sum(tl.where(sel, pred[None, :], 0), 1)
    tl.store(EXPERT + c, tl.where(has, val, -1).to(tl.int32), mask=c < C)
    tl.store(START + c, tl.where(has, c, -1), mask=c < C)


def decode_plan(table: Tensor, base: int, ids: Tensor, n_expert: int, hit: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """decode_plan_reference in one launch (the same tensors); CUDA-graph capturable. hit: an int32 [K]
    tensor to write the mask into (a graph's static buffer), else a new one."""
    return _launch(table, base, ids, n_expert, hit, 0)


def decode_plan_pcie(table: Tensor, base: int, ids: Tensor, n_expert: int, share: int,
                     hit: Tensor | None = None, staged: Tensor | None = None,
                     out: tuple[Tensor, ...] | None = None) -> tuple[Tensor, ...]:
    """decode_plan_pcie_reference in one launch (the same tensors); CUDA-graph capturable. out: the seven
    int32 [K] tensors after hit to write into (a graph's static buffers), else new ones."""
    return _launch(table, base, ids, n_expert, hit, share, staged, out)


def prefetch_pick(table: Tensor, base: int, pred: Tensor, n_expert: int, start: Tensor, expert: Tensor
                  ) -> None:
    """prefetch_pick_reference in one launch, into start and expert (int32 [C], contiguous: a graph's static
    buffers); CUDA-graph capturable."""
    _check(table, base, pred.view(-1), n_expert)
    cap = start.numel()
    for t in (start, expert):
        if t.dtype != torch.int32 or t.shape != (cap,) or not t.is_contiguous() or cap < 1:
            raise ValueError("prefetch_pick: start and expert must be contiguous int32 [C], C >= 1")
    n = pred.numel()
    _kernels()[1][(1,)](table, pred.contiguous().view(-1), start, expert, base, n, BLOCK=next_pow2(n), C=cap,
                        BC=next_pow2(cap), num_warps=1)


def _launch(table: Tensor, base: int, ids: Tensor, n_expert: int, hit: Tensor | None, share: int,
            staged: Tensor | None = None, out: tuple[Tensor, ...] | None = None):
    _check(table, base, ids, n_expert, share)
    _check_staged(staged)
    n = ids.numel()
    if hit is None:
        hit = torch.empty(n, dtype=torch.int32, device=ids.device)
    elif hit.shape != (n,) or hit.dtype != torch.int32 or not hit.is_contiguous():
        raise ValueError(f"decode_plan: hit must be a contiguous int32 [{n}] tensor")
    pcie = share > 0 or staged is not None
    if out is not None:
        if len(out) != 7 or not pcie or any(t.shape != (n,) or t.dtype != torch.int32 or not t.is_contiguous()
                                            for t in out):
            raise ValueError(f"decode_plan: out must be seven contiguous int32 [{n}] tensors (a PCIe plan)")
        order, slot, start, hslot, hstart, pslot, astart = out
    else:
        order, slot, start, hslot, hstart, pslot, astart = (
            torch.empty(n if pcie or i < 3 else 1, dtype=torch.int32, device=ids.device) for i in range(7))
    stg = staged.contiguous() if staged is not None else hslot
    _kernels()[0][(1,)](table, ids.contiguous(), hit, order, slot, start, hslot, hstart, pslot, astart, stg,
                        base, n, share, BLOCK=next_pow2(n), PCIE=pcie,
                        C=0 if staged is None else staged.numel(), num_warps=1, **pdl_args(hit))
    return (hit, order, slot, start, hslot, hstart, pslot, astart) if pcie else (hit, order, slot, start)


@functools.cache
def _kernels():
    return jit_bodies(_plan_body, _pick_body)
