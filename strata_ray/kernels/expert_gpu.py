"""GPU expert kernels (Triton) under the arithmetic contract: bit-identical to expert_cpu.

Weights stay in GGUF block bytes in cache slots (uint8 [S, rows, row_bytes]); every (token, k)
entry names its slot. One layer's routed experts run as three launches: activation quantization,
gate+up+SwiGLU+requantization (fused), down. Entries are sorted by slot on the device (no host
sync, CUDA-graph friendly) and cut into tiles of at most BT entries of one slot; a program computes
BR output rows of one tile, so a slot's weight rows are read once per tile.

Two tile shapes, same bits: "decode" (BT <= 8 entries, CUDA-core integer dots, several 32-blocks
in flight) and "prompt" (BT = 64, tensor-core int8 tl.dot per 32-block).

Kernel variants, same bits (`STRATA_KERNEL_VARIANT` or the `variant` argument; contract.KERNEL_VARIANTS):
- "words" (default): prompt launches of Q8_0 / Q4_0 / Q4_K / Q6_K layers take the int8 MMA rows of
  expert_mma_cuda.py on CUDA where cupy is installed (STRATA_PROMPT_MMA); one-token decode launches of Q4_0
  layers (Q8_0: opt-in) take the words tile
  (expert_words.py: weights read as 32-bit words a block pair, dp4a products), 2.2-2.6x the simple tile on
  the H200 (session 9); with cupy, Q4_0 / Q8_0 / Q4_K / Q6_K decode launches of 1-8 tokens take its CUDA C
  form (expert_rows_cuda.py: a tile's entries share the weight words); every other launch is the simple
  one's.
- "simple": the first kernels (one 32-block per step), proven bit-identical to the CPU on the H200.
- "wide": decode tiles load NB 32-blocks of BR rows per step as 16-bit words, the next
  chunk in flight while this one is computed (triton_chunks.py); all NB integer block dots come out
  of one reduction and only the fp32 terms are added one block at a time, in block order. The
  prompt tiles are larger, and int->float uses an exact magic-number conversion.
- "split": decode tiles in two passes, block terms then ordered sums (_expert_terms_kernel,
  _expert_sum_kernel).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .contract import DECODE_MAX_TOKENS, KERNEL_VARIANTS, QK, ExpertLayer, KernelError
from .expert_mma_cuda import launch_mma_rows, mma_on, mma_serves
from .expert_rows_cuda import cuda_rows_on, cuda_rows_tile_cap
from .expert_words import launch_rows_kernel, launch_words, launch_words_swiglu
from .triton_blocks import block_step, block_term, float_block_step, quant_blocks, row_offsets, swiglu
from .triton_chunks import mm_chunked

VARIANTS = KERNEL_VARIANTS
# "simple" decode tile tuning (bits do not depend on these): 32-blocks per unrolled step, warps.
DECODE_UNROLL_MAX = 4
DECODE_WARPS = 4
# "wide" tile tuning (bits do not depend on these). gu_* = gate+up launch, down_* = down launch;
# br rows per program (gu_br a multiple of 32: the program requantizes its h blocks), nb 32-blocks
# per chunk (power of 2), prompt_bt entries per prompt tile. Chosen from sm_90 compiles without a
# GPU (ptxas register/spill counts): these compile spill-free for Q8_0/Q4_0/Q4_K at 1 token, where
# the simple prompt tile (64 x 64, 4 warps) spills 560-960 bytes per thread.
WIDE = dict(gu_br=32, gu_nb=8, gu_warps=8, down_br=16, down_nb=8, down_warps=4, decode_stages=1,
            prompt_bt=64, prompt_br=64, prompt_warps=8, prompt_stages=3)
# "split" decode tiles (bits do not depend on these): br rows x nb 32-blocks of block terms a program;
# sum_br rows a program of the ordered sums (a multiple of 32: it requantizes whole h blocks).
SPLIT = dict(br=32, nb=8, warps=4, sum_br=128, sum_warps=4)
_OPTS = dict(enable_fp_fusion=False)  # the contract forbids FMA contraction


@triton.jit
def _act_quant_kernel(X, Q, D, S, n_blocks, BB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BB + tl.arange(0, BB)
    bmask = blk < n_blocks
    offs = row * n_blocks * 32 + blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(X + offs, mask=bmask[:, None], other=0.0)
    q, d, s = quant_blocks(x)
    tl.store(Q + offs, q, mask=bmask[:, None])
    tl.store(D + row * n_blocks + blk, d, mask=bmask)
    tl.store(S + row * n_blocks + blk, s, mask=bmask)


@triton.jit
def _tile_entries(start, M, ORDER, SORTED_SLOT, ACT_ROW, BT: tl.constexpr):
    """The entries of the tile starting at sorted entry `start`: (its slot, valid [BT] (in range and of that
    slot), ent int64 [BT] entry ids, arow int64 [BT] activation rows); invalid lanes read 0."""
    offs = start + tl.arange(0, BT)
    in_range = offs < M
    slot0 = tl.load(SORTED_SLOT + start)
    valid = in_range & (tl.load(SORTED_SLOT + offs, mask=in_range, other=-1) == slot0)
    ent = tl.load(ORDER + offs, mask=valid, other=0).to(tl.int64)  # [BT] entry ids
    arow = tl.load(ACT_ROW + ent, mask=valid, other=0).to(tl.int64)  # [BT] activation rows
    return slot0, valid, ent, arow


@triton.jit
def _expert_mm_kernel(AQ, AD, AS, AF, ACT_ROW, ORDER, SORTED_SLOT, TILE_START,
                      W1, W2, stride1, stride2, RB1, RB2,
                      OUT, HQ, HD, HS, M, R, K, n_blocks,
                      T1: tl.constexpr, T2: tl.constexpr, GATED: tl.constexpr, IS_FLOAT: tl.constexpr,
                      BT: tl.constexpr, BR: tl.constexpr, UNROLL: tl.constexpr, USE_DOT: tl.constexpr,
                      FAST_I2F: tl.constexpr):
    pid_r = tl.program_id(0)
    start = tl.load(TILE_START + tl.program_id(1))
    if start < 0:
        return
    slot0, valid, ent, arow = _tile_entries(start, M, ORDER, SORTED_SLOT, ACT_ROW, BT)
    rows, off1, off2 = row_offsets(pid_r, slot0, stride1, stride2, RB1, RB2, BR)
    w1 = W1 + off1
    w2 = W2 + off2
    acc1 = tl.zeros((BT, BR), tl.float32)
    acc2 = tl.zeros((BT, BR), tl.float32)
    k = tl.arange(0, 32)[None, :]
    for b0 in range(0, n_blocks, UNROLL):
        for u in tl.static_range(UNROLL):
            b = b0 + u
            if IS_FLOAT:
                acc1 = float_block_step(acc1, w1, b, AF + arow * K, valid, K)
                if GATED:
                    acc2 = float_block_step(acc2, w2, b, AF + arow * K, valid, K)
            else:
                a = tl.load(AQ + arow[:, None] * K + b * 32 + k, mask=valid[:, None], other=0)
                ad = tl.load(AD + arow * n_blocks + b, mask=valid, other=0.0)
                asum = tl.load(AS + arow * n_blocks + b, mask=valid, other=0)
                acc1 = block_step(acc1, w1, b, a, ad, asum, T1, USE_DOT, FAST_I2F)
                if GATED:
                    acc2 = block_step(acc2, w2, b, a, ad, asum, T2, USE_DOT, FAST_I2F)
    if GATED:
        h = swiglu(acc1, acc2)  # [BT, BR]
        if IS_FLOAT:
            tl.store(OUT + ent[:, None] * R + rows[None, :], h, mask=valid[:, None])
        else:
            q, d, s = quant_blocks(tl.reshape(h, (BT * (BR // 32), 32)))
            tl.store(HQ + ent[:, None] * R + rows[None, :], tl.reshape(q, (BT, BR)), mask=valid[:, None])
            cols = pid_r * (BR // 32) + tl.arange(0, BR // 32)
            hoffs = ent[:, None] * (R // 32) + cols[None, :]
            tl.store(HD + hoffs, tl.reshape(d, (BT, BR // 32)), mask=valid[:, None])
            tl.store(HS + hoffs, tl.reshape(s, (BT, BR // 32)), mask=valid[:, None])
    else:
        tl.store(OUT + ent[:, None] * R + rows[None, :], acc1, mask=valid[:, None])


@triton.jit
def _expert_mm_wide_kernel(AQ, AD, AS, ACT_ROW, ORDER, SORTED_SLOT, TILE_START,
                           W1, W1H, W2, W2H, stride1, stride2, RB1, RB2,
                           OUT, HQ, HD, HS, M, R, K, n_blocks,
                           T1: tl.constexpr, T2: tl.constexpr, GATED: tl.constexpr,
                           BT: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr):
    """Decode tile (quantized weights): BR rows of one slot for its <= BT entries, NB-block chunks."""
    pid_r = tl.program_id(0)
    start = tl.load(TILE_START + tl.program_id(1))
    if start < 0:
        return
    slot0, valid, ent, arow = _tile_entries(start, M, ORDER, SORTED_SLOT, ACT_ROW, BT)
    rows, base1, base2 = row_offsets(pid_r, slot0, stride1, stride2, RB1, RB2, BR)  # [BR] byte offsets
    acc1 = tl.zeros((BT, BR), tl.float32)
    acc2 = tl.zeros((BT, BR), tl.float32)
    acc1, acc2 = mm_chunked(acc1, acc2, W1, W1H, W2, W2H, base1, base2, AQ, AD, AS, arow, valid, K,
                            n_blocks, T1, T2, GATED, BT, NB)
    if GATED:
        h = swiglu(acc1, acc2)  # [BT, BR]
        q, d, s = quant_blocks(tl.reshape(h, (BT * (BR // 32), 32)))
        tl.store(HQ + ent[:, None] * R + rows[None, :], tl.reshape(q, (BT, BR)), mask=valid[:, None])
        cols = pid_r * (BR // 32) + tl.arange(0, BR // 32)
        hoffs = ent[:, None] * (R // 32) + cols[None, :]
        tl.store(HD + hoffs, tl.reshape(d, (BT, BR // 32)), mask=valid[:, None])
        tl.store(HS + hoffs, tl.reshape(s, (BT, BR // 32)), mask=valid[:, None])
    else:
        tl.store(OUT + ent[:, None] * R + rows[None, :], acc1, mask=valid[:, None])


@triton.jit
def _expert_terms_kernel(AQ, AD, AS, ACT_ROW, ORDER, SORTED_SLOT, TILE_START,
                         W1, W2, stride1, stride2, RB1, RB2, TERMS1, TERMS2, M, R, K, n_blocks,
                         T1: tl.constexpr, T2: tl.constexpr, GATED: tl.constexpr, BT: tl.constexpr,
                         BR: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
    """Split decode tile, first pass: the fp32 block terms of BR rows x NB blocks of one slot for its <= BT
    entries, into TERMS [M, n_blocks, R] (entry, block, row). No term depends on another, so every program
    loads all of its weight bytes at once; _expert_sum_kernel adds them per row in block order. EVEN: NB
    divides n_blocks (no block of a program is past the row: no branch between the loads)."""
    pid_r = tl.program_id(0)
    start = tl.load(TILE_START + tl.program_id(2))
    if start < 0:
        return
    slot0, valid, ent, arow = _tile_entries(start, M, ORDER, SORTED_SLOT, ACT_ROW, BT)
    rows, off1, off2 = row_offsets(pid_r, slot0, stride1, stride2, RB1, RB2, BR)
    w1 = W1 + off1
    w2 = W2 + off2
    k = tl.arange(0, 32)[None, :]
    for u in tl.static_range(NB):
        b = tl.program_id(1) * NB + u
        if EVEN or b < n_blocks:
            a = tl.load(AQ + arow[:, None] * K + b * 32 + k, mask=valid[:, None], other=0)
            ad = tl.load(AD + arow * n_blocks + b, mask=valid, other=0.0)
            asum = tl.load(AS + arow * n_blocks + b, mask=valid, other=0)
            toffs = (ent[:, None] * n_blocks + b) * R + rows[None, :]  # [BT, BR]
            t1 = block_term(w1, b, a, ad, asum, T1, False, False)
            tl.store(TERMS1 + toffs, t1, mask=valid[:, None])
            if GATED:
                t2 = block_term(w2, b, a, ad, asum, T2, False, False)
                tl.store(TERMS2 + toffs, t2, mask=valid[:, None])


@triton.jit
def _expert_sum_kernel(TERMS1, TERMS2, OUT, HQ, HD, HS, R, N_BLOCKS: tl.constexpr, GATED: tl.constexpr,
                       BR: tl.constexpr):
    """Split decode tile, second pass: entry m's rows [BR] summed from 0.0 over the block terms in block order
    (the simple tile's exact sequence); gated: SwiGLU and the requantized h, else the rows into OUT. The
    block loop is unrolled (N_BLOCKS a constant): no load waits for the sum, so all are in flight at once
    (a runtime loop waited for each: ~0.6 us a block, session 8)."""
    m = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]; R % BR == 0 (a multiple of 32 when gated)
    base = m * N_BLOCKS * R + rows
    acc1 = tl.zeros((BR,), tl.float32)
    acc2 = tl.zeros((BR,), tl.float32)
    for b in tl.static_range(N_BLOCKS):
        acc1 = acc1 + tl.load(TERMS1 + base + b * R)
        if GATED:
            acc2 = acc2 + tl.load(TERMS2 + base + b * R)
    if GATED:
        h = swiglu(acc1, acc2)  # [BR]
        q, d, s = quant_blocks(tl.reshape(h, (BR // 32, 32)))
        tl.store(HQ + m * R + rows, tl.reshape(q, (BR,)))
        cols = tl.program_id(0) * (BR // 32) + tl.arange(0, BR // 32)
        tl.store(HD + m * (R // 32) + cols, d)
        tl.store(HS + m * (R // 32) + cols, s)
    else:
        tl.store(OUT + m * R + rows, acc1)


@triton.jit
def _combine_kernel(ROWS, W, OUT, E, K: tl.constexpr, BE: tl.constexpr):
    """out[n] = rows[n, 0] * w[n, 0], then + rows[n, k] * w[n, k] for k = 1..K-1, each op rounded
    (no FMA: _OPTS): moe.combine_rows' exact sequence, in one launch instead of 2K - 1."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BE + tl.arange(0, BE)
    mask = cols < E
    acc = tl.load(ROWS + n * K * E + cols, mask=mask, other=0.0) * tl.load(W + n * K)
    for k in tl.static_range(1, K):
        acc = acc + tl.load(ROWS + (n * K + k) * E + cols, mask=mask, other=0.0) * tl.load(W + n * K + k)
    tl.store(OUT + n * E + cols, acc, mask=mask)


def combine_rows_gpu(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows f32 [N, K, E], weights f32 [N, K] (cuda) -> [N, E]; bit-identical to moe.combine_rows."""
    rows, weights = rows.contiguous().float(), weights.contiguous().float()
    n, k, e = rows.shape
    out = torch.empty((n, e), dtype=torch.float32, device=rows.device)
    if n:
        be = min(1024, triton.next_power_of_2(e))
        _combine_kernel[(n, triton.cdiv(e, be))](rows, weights, out, e, K=k, BE=be, num_warps=4, **_OPTS)
    return out


def quantize_act_gpu(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x f32 [N, n] (cuda) -> (q int8 [N, n], d f32 [N, n/32], s int32 [N, n/32]); contract step 1.
    out: those three, contiguous, to write into (tests poison them first)."""
    x = x.contiguous().float()
    n_rows, n = x.shape
    if n % QK:
        raise KernelError(f"activation width {n} is not a multiple of {QK}")
    nb = n // QK
    if out is None:
        q = torch.empty((n_rows, n), dtype=torch.int8, device=x.device)
        d = torch.empty((n_rows, nb), dtype=torch.float32, device=x.device)
        s = torch.empty((n_rows, nb), dtype=torch.int32, device=x.device)
    else:
        q, d, s = out
        want = ((n_rows, n, torch.int8), (n_rows, nb, torch.float32), (n_rows, nb, torch.int32))
        if any(t.shape != (r, c) or t.dtype != dt or not t.is_contiguous() or t.device != x.device
               for t, (r, c, dt) in zip(out, want, strict=True)):
            raise KernelError("quantize_act_gpu: out must be contiguous int8 [N, n], f32 and int32 [N, n/32] "
                              "on x's device")
    if n_rows:
        bb = min(64, triton.next_power_of_2(nb))
        _act_quant_kernel[(n_rows, triton.cdiv(nb, bb))](x, q, d, s, nb, BB=bb, num_warps=4, **_OPTS)
    return q, d, s


def plan_tiles(slot: torch.Tensor, bt: int, n_slots: int):
    """Sort entries by slot and cut each slot's run into tiles of <= bt entries, on the device.

    Returns (order int32 [M], sorted_slot int32 [M], tile_start int32 [n_tiles]) where unused tiles
    hold -1; n_tiles = ceil(M / bt) + min(M, n_slots) bounds the real count without a host sync.
    """
    m = slot.numel()
    sorted_slot, order = torch.sort(slot.to(torch.int32), stable=True)
    idx = torch.arange(m, device=slot.device)
    is_start = torch.ones(m, dtype=torch.bool, device=slot.device)
    is_start[1:] = sorted_slot[1:] != sorted_slot[:-1]
    group_start = torch.cummax(torch.where(is_start, idx, 0), 0).values
    first = (idx - group_start) % bt == 0
    tile_id = torch.cumsum(first.to(torch.int64), 0) - 1
    n_tiles = triton.cdiv(m, bt) + min(m, n_slots)
    tile_start = torch.full((n_tiles + 1,), -1, dtype=torch.int32, device=slot.device)
    tile_start.scatter_(0, torch.where(first, tile_id, n_tiles), torch.where(first, idx, -1).to(torch.int32))
    return order.to(torch.int32), sorted_slot, tile_start[:n_tiles]


def tile_entries(n_tok: int, mode: str, variant: str, layer: ExpertLayer | None) -> int:
    """Entries per tile (BT) for a launch over n_tok tokens in this mode ("decode" or "prompt") on this
    layer's experts (None: no experts, any BT). Decode tiles of the words variant are cut to the most entries
    the CUDA C rows take for the layer's types (Q4_K: 2), so a verify window stays on them: an entry's rows
    do not depend on its tile."""
    is_float = layer is not None and layer.is_float
    if mode == "decode":
        bt = min(triton.next_power_of_2(n_tok), DECODE_MAX_TOKENS)
        if variant == "words" and layer is not None and not is_float and bt > 1 and cuda_rows_on():
            kinds = ((layer.n_embd, layer.gate_type), (layer.n_embd, layer.up_type),
                     (layer.n_ff, layer.down_type))
            bt = cuda_rows_tile_cap(kinds, bt)
            from .expert_words import WORDS  # at the call: tests swap the dict

            if WORDS["cuda_bt"]:  # a bench knob: any cut gives the same rows
                bt = min(bt, WORDS["cuda_bt"])
        return bt
    return WIDE["prompt_bt"] if variant == "wide" and not is_float else 64


def _float_view(w: torch.Tensor, t: int) -> torch.Tensor:
    from .contract import BF16, F16, F32

    return w.view({F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}[t])


def _launch_split(act, act_row, plan, mats, out, hq, hd, hs, m, r, k, gated):
    """The split decode tile (two passes: block terms, then ordered sums); same bits as the simple one."""
    order, sorted_slot, tile_start, bt = plan
    (w1, t1), (w2, t2) = mats
    aq, ad, asum, _ = act
    n_blocks = k // QK
    br, nb = _row_tile(r, SPLIT["br"]), min(SPLIT["nb"], n_blocks)
    terms1 = torch.empty((m, n_blocks, r), dtype=torch.float32, device=aq.device)  # [M, blocks, R]
    terms2 = torch.empty_like(terms1) if gated else terms1
    row_tiles, n_tiles = _grid(r, br, tile_start)
    grid = (row_tiles, triton.cdiv(n_blocks, nb), n_tiles)
    _expert_terms_kernel[grid](aq, ad, asum, act_row, order, sorted_slot, tile_start, w1, w2, w1.stride(0),
                               w2.stride(0), w1.stride(1), w2.stride(1), terms1, terms2, m, r, k, n_blocks,
                               T1=t1, T2=t2, GATED=gated, BT=bt, BR=br, NB=nb, EVEN=n_blocks % nb == 0,
                               num_warps=SPLIT["warps"], **_OPTS)
    sbr = _row_tile(r, SPLIT["sum_br"])
    _expert_sum_kernel[(r // sbr, m)](terms1, terms2, out, hq, hd, hs, r, N_BLOCKS=n_blocks, GATED=gated,
                                      BR=sbr, num_warps=SPLIT["sum_warps"], **_OPTS)


def _launch_mm(act, act_row, plan, mats, out, hq, hd, hs, m, r, k, gated, is_float, mode, variant):
    order, sorted_slot, tile_start = plan[:3]
    bt, use_dot = plan[3], mode == "prompt"
    if variant == "split" and not use_dot and not is_float:  # decode tiles; prompt tiles stay simple
        _launch_split(act, act_row, plan, mats, out, hq, hd, hs, m, r, k, gated)
        return
    if (variant == "words" and not use_dot and not is_float  # else, or where no words form serves: simple
            and launch_words(act, act_row, plan, mats, out, hq, hd, hs, r, k, gated, _row_tile, _grid)):
        return
    if (variant == "words" and use_dot and not is_float and _mma_serves(act[0], mats, r, k, plan[3])
            and launch_rows_kernel(launch_mma_rows, act, act_row, plan, mats, out, hq, hd, hs, r, k, gated)):
        return
    wide = variant == "wide" and not is_float  # float layers keep the simple kernel (and its bits)
    (w1, t1), (w2, t2) = mats
    aq, ad, asum, af = act
    if wide and not use_dot:
        br = WIDE["gu_br"] if gated else WIDE["down_br"]
        nb = min(WIDE["gu_nb"] if gated else WIDE["down_nb"], triton.next_power_of_2(k // QK))
        grid = _grid(r, br, tile_start)
        # the same bytes as 16-bit words (every block size and row width is even)
        w1h, w2h = w1.view(torch.int16), w2.view(torch.int16)
        _expert_mm_wide_kernel[grid](aq, ad, asum, act_row, order, sorted_slot, tile_start,
                                     w1, w1h, w2, w2h, w1.stride(0), w2.stride(0), w1.stride(1),
                                     w2.stride(1), out, hq, hd, hs, m, r, k, k // QK,
                                     T1=t1, T2=t2, GATED=gated, BT=bt, BR=br, NB=nb,
                                     num_warps=WIDE["gu_warps"] if gated else WIDE["down_warps"],
                                     num_stages=WIDE["decode_stages"], **_OPTS)
        return
    if use_dot:
        br = WIDE["prompt_br"] if wide else 64
        br = max(_row_tile(r, br), 32)
        warps, stages = (WIDE["prompt_warps"], WIDE["prompt_stages"]) if wide else (4, None)
    else:
        br, warps, stages = 32, DECODE_WARPS, None
    unroll = 1
    if not use_dot:
        while unroll < DECODE_UNROLL_MAX and (k // QK) % (unroll * 2) == 0:
            unroll *= 2
    if is_float:
        w1, w2 = _float_view(w1, t1), _float_view(w2, t2)
    opts = dict(_OPTS, **({"num_stages": stages} if stages else {}))
    _expert_mm_kernel[_grid(r, br, tile_start)](
        aq, ad, asum, af, act_row, order, sorted_slot, tile_start,
        w1, w2, w1.stride(0), w2.stride(0), w1.stride(1), w2.stride(1),
        out, hq, hd, hs, m, r, k, k // QK,
        T1=t1, T2=t2, GATED=gated, IS_FLOAT=is_float, BT=bt, BR=br, UNROLL=unroll,
        USE_DOT=use_dot, FAST_I2F=wide, num_warps=warps, **opts)


def _mma_serves(aq: torch.Tensor, mats, r: int, k: int, bt: int) -> bool:
    """Whether a prompt launch takes the int8 MMA rows (expert_mma_cuda): on, on CUDA, gate / up or down of
    one type that it serves."""
    (_, t1), (_, t2) = mats
    return t1 == t2 and aq.device.type == "cuda" and mma_on() and mma_serves(k, r, t1, bt)


def _row_tile(r: int, br: int) -> int:
    """br halved until it divides the r rows of a launch (a row tile never straddles the end)."""
    while r % br:
        br //= 2
    return br


def _grid(r: int, br: int, tile_start: torch.Tensor) -> tuple[int, int]:
    if tile_start.numel() > 65535:
        raise KernelError(f"too many entry tiles in one launch ({tile_start.numel()})")
    return (r // br, tile_start.numel())


def kernel_variant(variant: str | None = None) -> str:
    """The kernel variant to use: the argument, else STRATA_KERNEL_VARIANT, else the default (words)."""
    v = variant or os.environ.get("STRATA_KERNEL_VARIANT") or VARIANTS[0]
    if v not in VARIANTS:
        raise KernelError(f"unknown expert kernel variant {v!r} ({', '.join(VARIANTS)})")
    return v


def expert_ffn_gpu(x: torch.Tensor, tok: torch.Tensor, slot: torch.Tensor, slots: ExpertLayer,
                   mode: str = "auto", out: torch.Tensor | None = None,
                   variant: str | None = None, plan=None, act=None, ident=None) -> torch.Tensor:
    """rows f32 [M, E] (cuda): row m = down(swiglu(gate x, up x)) of slot[m] for token tok[m].

    x f32 [N, E]; tok, slot int [M] (cuda); slots: ExpertLayer of cuda uint8 [S, rows, row_bytes].
    mode: "decode", "prompt" or "auto" (decode when N <= 8). Both give the same bits.
    out: optional f32 [M, E] to write the rows into (every element is written).
    variant: one of VARIANTS (default: STRATA_KERNEL_VARIANT, else "words"); same bits.
    plan: (order, sorted_slot, tile_start) int32 cuda tensors from `plan_tiles_host(slot,
    tile_entries(N, mode, variant, slots))`, to skip planning on the device (about 15 small launches).
    act: quantize_act_gpu(x), when the caller launches several calls over one x (quantized once);
    ident: int32 [M] holding 0..M-1 (the down launch's rows), when the caller keeps one.
    """
    slots.validate()
    variant = kernel_variant(variant)
    if mode == "auto":
        mode = "decode" if x.shape[0] <= DECODE_MAX_TOKENS else "prompt"
    if mode not in ("decode", "prompt"):
        raise KernelError(f"unknown expert kernel mode {mode!r} (decode, prompt or auto)")
    if x.ndim != 2 or x.shape[1] != slots.n_embd:
        raise KernelError(f"x must be [N, {slots.n_embd}], got {tuple(x.shape)}")
    dev = x.device
    m, n_embd, n_ff = tok.numel(), slots.n_embd, slots.n_ff
    if out is None:
        out = torch.empty((m, n_embd), dtype=torch.float32, device=dev)
    elif tuple(out.shape) != (m, n_embd) or out.dtype != torch.float32 or not out.is_contiguous():
        raise KernelError(f"out must be a contiguous f32 [{m}, {n_embd}] tensor")
    if m == 0:
        return out
    x = x.contiguous().float()
    bt = tile_entries(x.shape[0], mode, variant, slots)
    plan = (*(plan if plan is not None else plan_tiles(slot, bt, slots.gate.shape[0])), bt)
    tok32 = tok.to(torch.int32).contiguous()
    if ident is None:
        ident = torch.arange(m, dtype=torch.int32, device=dev)
    gate_up = ((slots.gate, slots.gate_type), (slots.up, slots.up_type))
    down = ((slots.down, slots.down_type), (slots.down, slots.down_type))
    if slots.is_float:
        h = torch.empty((m, n_ff), dtype=torch.float32, device=dev)
        none = torch.zeros(1, dtype=torch.int32, device=dev)  # unused pointer arguments
        _launch_mm((none, none, none, x), tok32, plan, gate_up, h, none, none, none, m, n_ff, n_embd,
                   True, True, mode, variant)
        _launch_mm((none, none, none, h), ident, plan, down, out, none, none, none, m, n_embd, n_ff,
                   False, True, mode, variant)
        return out
    xq, xd, xs = act if act is not None else quantize_act_gpu(x)
    if (variant == "words" and mode == "decode"  # the SwiGLU in the down launch, where the CUDA C rows serve
            and launch_words_swiglu((xq, xd, xs, x), tok32, plan, gate_up, down, out, n_ff, n_embd)):
        return out
    hq = torch.empty((m, n_ff), dtype=torch.int8, device=dev)
    hd = torch.empty((m, n_ff // QK), dtype=torch.float32, device=dev)
    hs = torch.empty((m, n_ff // QK), dtype=torch.int32, device=dev)
    _launch_mm((xq, xd, xs, x), tok32, plan, gate_up, out, hq, hd, hs, m, n_ff, n_embd, True, False, mode,
               variant)
    _launch_mm((hq, hd, hs, x), ident, plan, down, out, hq, hd, hs, m, n_embd, n_ff, False, False, mode,
               variant)
    return out
