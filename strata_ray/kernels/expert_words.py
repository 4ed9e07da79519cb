"""The "words" decode tile: one token's expert rows with the weights read as 32-bit words, two blocks a word
run. Same bits as the simple tile (and the CPU), for Q4_0 and (opt-in, WORDS["types"]) Q8_0 layers; other
shapes take the simple tile.

The simple tile loads each weight byte of a 32-block with a byte load of its own (twice for Q4_0's two
nibbles), at addresses 18 or 34 bytes apart from row to row, one block per loop step: on the H200 its
launches read 4-7% of HBM bandwidth (session 8), waiting on each step's loads. A pair of blocks is a whole
number of words (Q4_0 36 bytes = 9 words, Q8_0 68 = 17), so here a program loads its rows' blocks pair by
pair as words, WORDS["chunk_pairs"] pairs a chunk, every chunk's loads at once (the chunk loop is unrolled:
no load waits for the sums), and multiplies a word's bytes (Q4_0: its low and high nibbles) by dp4a:

    pair words (Q4_0):  w0 = [d0 d0 q q] w1..w3 = [q q q q] w4 = [q q d1 d1] w5..w8 = [q q q q]
    block 0 = words 0..S, block 1 = words S+1..: S = 4 (Q4_0) or 8 (Q8_0)

Each weight byte is multiplied by the activation code at its place in the block (gathered once a program
from the token's codes, zero on the scale bytes), so a block's integer dot is the sum over its words: an
exact integer, as in the contract (Q4_0's -8 offset comes back through the activation sum). The fp32 part is
the simple tile's to the letter: term = float(dot) * (d * ad), added to the row's sum from 0.0 in block
order (each term picked out of its chunk by a masked sum of zeros and itself: exact).

Only one-token tiles (BT = 1: `tile_entries(1, "decode", ...)`): the decode step and the pipelined decode.
Knobs in WORDS (bits do not depend on them). On the H200 (session 9, 1 token x top-10 Q4_0, E = 2048,
n_ff = 512): 38.6 us a layer against the simple tile's 102 (11% of HBM copy against 4%); with every expert
resident, 8K decode 117 tok/s against 89.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import nvrtc
from .contract import Q4_0, Q8_0, KernelError
from .expert_rows_cuda import cuda_rows_ready, launch_cuda_rows
from .pdl import pdl_args
from .triton_blocks import T_Q4_0, quant_blocks, row_offsets, swiglu

# br rows a program (gate+up: a multiple of 32, the program requantizes whole h blocks), pairs a chunk;
# dp4a: a word's products by the dp4a instruction (inline PTX: not under the Triton interpreter, which runs
# the plain products, the same integers); types: the weight types the tile serves. Q8_0 is opt-in: its
# plain products gave the CPU's bits on the H200 (session 9, call 2) but neither its speed nor its dp4a
# form has been measured there yet.
# split_gu: gate and up rows in programs of their own (gu_split_br rows, down_warps), twice the programs of
# the fused gate+up tile, then one small SwiGLU + requantization launch (not measured on the GPU yet).
# cuda: Q4_0, Q8_0, Q4_K and Q6_K decode launches on CUDA (tiles of up to 8 entries, Q4_K 2) take the CUDA C
# kernel of expert_rows_cuda.py (STRATA_WORDS_CUDA; where cupy is installed), cuda_rpw rows in flight a row
# group, cuda_warps warps a CTA, about cuda_iters row blocks a CTA by the launch's most entries a tile (each
# block's successor loaded while its entries are computed; 1: one block a CTA, every CTA's loads then
# arithmetic). Session 37 on an H100 (bench_kernels, us a layer at iters 1 / 2 / 4 / 8): 1 token x top-10
# Q4_0 18.1 / 17.7 / 18.9 / 22.2, 4 tokens 35.7 / 34.7 / 35.8 / 36.4, 8 tokens 52.6 / 47.2 / 45.1 / 47.9
# (Q8_0 and Q4_K alike): the walking form holds 95-126 registers against 40-74 (ptxas, sm_90), so one-entry
# tiles stay at 1, and two-entry tiles too (their walking form takes 117-126 registers, 4 CTAs an SM against
# 9: not measured against the one-block form, which stays).
# The down launch (cuda_down_iters) walks one block a CTA below tiles of 8: ncu at 8 tokens after the stage
# pitch, 21.0 us at 1 (72 registers, 7 CTAs an SM) against 23.2 at 4 (123, 4 CTAs); gate / up 42.7 against
# 33.5. Tiles of 8 walk 4 since session 51: the sweep (bench_kernels, us a layer at 8 tokens x top-10, iters
# 1 / 2 / 4, the same bits) on an H200, Q4_0 40.8 / 39.4 / 39.0, Q4_K 45.2 / 43.2 / 42.7, Q6_K 59.3 / 58.5 /
# 58.9, Q8_0 53.8 / 51.0 / 50.7; session 37's on an H100 42.0 / 41.7 / 40.5, 46.4 / 45.9 / 44.7, 64.0 / 63.9
# / 64.7, 58.8 / 57.4 / 57.3 (1-6% less but Q6_K on the H100, +1%). At 4 tokens walking gained nothing on
# either card (H200 Q6_K 44.9 / 45.4 / 48.5), so smaller tiles stay at 1.
# Session 16 on the H200: a one-token layer's rows 13.3 us against this tile's 37.5 (RPW 4 / 8 or 8 warps no
# faster; at 8 entries a tile they overflow the 48 KiB of shared memory and decline to the simple tile).
# cuda_swiglu: in launches of tiles of at most this many entries (0: none) where the CUDA C form takes both
# launches of a layer, the down launch makes the h codes from the gate / up rows itself (expert_rows_cuda's
# SWIGLU form), and the SwiGLU kernel between goes. Session 44 on an H100 (bench_kernels, the SwiGLU kernel
# 1.7-2.1 us a layer): one token x top-10, kernels 16.9 / 17.8 / 25.1 / 21.8 us against 17.6 / 18.4 / 26.2 /
# 22.9 (Q4_0 / Q4_K / Q6_K / Q8_0), graphed 53.6 / 54.8 / 58.9 / 58.5 against 56.7 / 55.4 / 64.9 / 61.5; but
# each CTA of a tile makes its entries' codes itself, so tiles of 4 and 8 entries were 1-3 us slower (Q4_0
# 8 tokens 46.4 against 43.2): one-entry tiles only (the decode step's), the rest keep the kernel between.
# cuda_bt: decode tiles of the CUDA C form cut to at most this many entries (a power of two; 0: no cut, the
# tile cap alone; a bench sweep knob). Session 46 on an H100 (bench_kernels, us a layer, no cut / 2 / 1):
# Q4_0 4 tokens 31.6 / 34.5 / 38.2, 8 tokens 43.3 / 56.2 / 67.8; Q4_K and Q6_K alike. An entry's own tile
# unpacks the expert's rows again, which costs more than the one-block form's registers and the SwiGLU fold
# save, so tiles stay as large as the cap.
# cuda_cta_fold: the CUDA C form's fold done by the CTA's first threads after a barrier, one chain a thread,
# rather than by each warp's own lanes (expert_rows_cuda CTAFOLD). Session 47 on an H100 (bench_kernels, us a
# layer, 1 / 4 / 8 tokens, per-warp -> CTA fold): Q4_0 16.5 / 31.9 / 43.4 -> 16.1 / 31.4 / 43.2, Q4_K 17.8 /
# 34.8 / 47.0 -> 17.5 / 34.6 / 47.0, Q6_K 25.1 / 48.8 / 63.2 -> 25.0 / 47.5 / 62.1, Q8_0 21.9 / 44.8 / 60.1 ->
# 21.8 / 44.3 / 60.4: 0-3% (the fold's issue was not what holds these launches).
# cuda_early: the CUDA C form's prologue at tiles of one entry with the tile's slot and order loaded beside
# TILE_START, and one activation row read with no lookup (expert_rows_cuda EARLY; session 47's ncu put 39% of
# the one-token gate / up launch's stall samples on that chain). Session 50 on an H100 (bench_kernels, us a
# layer, 1 / 4 / 8 tokens, off -> on, the same bits): Q4_0 16.1 / 31.4 / 43.2 -> 15.5 / 31.8 / 43.6, Q4_K
# 17.4 / 34.5 / 47.3 -> 16.8 / 34.9 / 47.5, Q6_K 25.1 / 47.4 / 62.2 -> 23.7 / 48.3 / 62.6, Q8_0 21.9 / 44.7 /
# 61.1 -> 20.5 / 44.7 / 61.7: 3-6% less at one token (the decode step's: spec is off by default), 0-2% more at
# 4-8; the engine's decode-graph and tier GPU tests passed with it on. On by default since.
# cuda_early_down: EARLY in the down launches too (off: the gate / up launch's only). Offline (ptxas, sm_90,
# Q4_0) EARLY takes the one-entry SwiGLU down form from 48 to 56 registers (10 -> 9 CTAs an SM), a candidate
# for the 4-8-token cost above; not yet measured on a GPU, so the default stays as measured (on).
# cuda_bias: the CUDA C form's block terms with their integers carried as i + 1.5 * 2^23, so float(i) is one
# float subtraction (expert_rows_cuda BIAS; exact below 2^22, which Q4_0 / Q8_0 / Q4_K block integers are;
# Q6_K's are not and keep the conversion): Q4_0's and Q8_0's dot chains start at the bias (Q4_0's at the bias
# - 8 asum, its subtraction gone too), Q4_K's products add it in their multiply. Session 53, offline (ptxas,
# sm_90, Q4_0): no I2F left, the walking forms 1544 -> 1344 (gate / up, tiles of 4) and 1480 -> 1192 (down,
# tiles of 8) instructions, the one-block forms unchanged in count. The MMA prompt rows' same change took
# 3.5-4.5% off their launches (session 53). Session 54 on an H100 (bench_kernels --sweep-with cuda_bias, us a
# layer, off -> on): Q4_0 4 tokens 31.3 -> 31.2, 8 tokens 41.2 -> 40.4; Q4_K 34.2 -> 34.2, 44.1 -> 44.3; its
# bit tests passed (both walks). 0-2%, under the 3-8% expected, and the engine's tier tests have not run with
# it: it stays off. The bits do not depend on it.
WORDS = dict(gu_br=32, gu_warps=8, down_br=32, down_warps=4, chunk_pairs=1, dp4a=True, types=(Q4_0,),
             split_gu=False, gu_split_br=16, cuda=True, cuda_rpw=2, cuda_warps=4,
             cuda_iters={1: 1, 2: 1, 4: 2, 8: 4}, cuda_down_iters={1: 1, 8: 4}, cuda_swiglu=1, cuda_bt=0,
             cuda_cta_fold=True, cuda_early=True, cuda_early_down=True, cuda_bias=False)
_OPTS = dict(enable_fp_fusion=False)  # the contract forbids FMA contraction
_PAIR = {Q4_0: (9, 16, 4, 18, 16), Q8_0: (17, 32, 8, 34, 32)}  # words, padded, S, block bytes, data bytes


def words_supported(t1: int, t2: int, k: int, bt: int, mats: tuple = ()) -> bool:
    """Whether the Triton words tile serves a launch: one weight type of the two, in WORDS["types"] (Q4_0,
    and Q8_0 when added), a whole number of chunks a row, tiles of one entry, and the weight tensors (mats,
    uint8 [S, rows, row_bytes]) on 4-byte words."""
    return (bt == 1 and t1 == t2 and t1 in _PAIR and t1 in WORDS["types"]
            and (k // 32) % (2 * WORDS["chunk_pairs"]) == 0 and _on_words(mats))


def _on_words(mats: tuple) -> bool:
    """Whether the weight tensors start and stride on 4-byte words (the words tiles read them as words)."""
    return all(w.data_ptr() % 4 == 0 and w.stride(0) % 4 == 0 and w.stride(1) % 4 == 0 for w in mats)


def cuda_words_serve(t1: int, t2: int, k: int, bt: int, mats: tuple, device: torch.device) -> bool:
    """Whether the CUDA C form (expert_rows_cuda) takes a launch: on, gate / up or down of one type on a CUDA
    device, rows of that type and tiles of up to bt entries it serves (cuda_rows_serves), the weights on
    4-byte words."""
    from .expert_rows_cuda import cuda_rows_on, cuda_rows_serves

    return (t1 == t2 and device.type == "cuda" and cuda_rows_on() and cuda_rows_serves(k, bt, t1)
            and _on_words(mats))


@triton.jit
def _dp4a(a, b, c, SIGNED: tl.constexpr):
    """c + the dot of a's and b's 4 bytes (b signed; a signed or unsigned): one dp4a, exact."""
    b = tl.broadcast_to(b, a.shape)
    if SIGNED:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _chunk_terms(wbase, c, AD, AS, dbase, alo, ahi,
                 T: tl.constexpr, NP: tl.constexpr, WP: tl.constexpr, WPP: tl.constexpr, S: tl.constexpr,
                 DP4A: tl.constexpr):
    """The fp32 block terms of chunk c (NP pairs) of BR rows: (t0, t1) [BR, NP], blocks 2p and 2p + 1.
    wbase int32 pointers [BR] to the rows' first word; alo / ahi the activation codes at each byte's place
    (ahi: Q4_0's high nibbles), int32 [NP, WPP, 4], or with DP4A packed four bytes a word [NP, WPP]."""
    p = c * NP + tl.arange(0, NP)  # [NP] pairs of this chunk
    w = tl.arange(0, WPP)  # [WPP] words of a pair
    ptrs = wbase[:, None, None] + (p * WP)[None, :, None] + w[None, None, :]  # [BR, NP, WPP]
    words = tl.load(ptrs, mask=(w < WP)[None, None, :], other=0)
    if DP4A:  # a word's 4 (Q8_0) or 8 (Q4_0) products in one or two instructions
        zero = tl.zeros(words.shape, tl.int32)
        if T == T_Q4_0:
            per_word = _dp4a(words & 0x0F0F0F0F, alo[None, :, :], zero, False)
            per_word = _dp4a((words >> 4) & 0x0F0F0F0F, ahi[None, :, :], per_word, False)
        else:
            per_word = _dp4a(words, alo[None, :, :], zero, True)
    else:
        shift = (tl.arange(0, 4) * 8)[None, None, None, :]
        byte = (words[:, :, :, None] >> shift) & 0xFF  # [BR, NP, WPP, 4]
        if T == T_Q4_0:  # Q4_0: nibbles times the codes of values j and j + 16
            prod = (byte & 0xF) * alo[None, :, :, :] + (byte >> 4) * ahi[None, :, :, :]
        else:  # Q8_0: signed bytes
            prod = (byte - ((byte & 0x80) << 1)) * alo[None, :, :, :]
        per_word = tl.sum(prod, axis=3)  # [BR, NP, WPP] exact
    first = (w <= S)[None, None, :]
    dot0 = tl.sum(tl.where(first, per_word, 0), axis=2)  # [BR, NP]
    dot1 = tl.sum(tl.where(first, 0, per_word), axis=2)
    b0 = 2 * p  # [NP] block ids
    if T == T_Q4_0:
        dot0 = dot0 - 8 * tl.load(AS + dbase + b0)[None, :]
        dot1 = dot1 - 8 * tl.load(AS + dbase + b0 + 1)[None, :]
    d0 = tl.sum(tl.where((w == 0)[None, None, :], words & 0xFFFF, 0), axis=2)  # [BR, NP] f16 bits
    d1 = tl.sum(tl.where((w == S)[None, None, :], (words >> 16) & 0xFFFF, 0), axis=2)
    d0 = d0.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    d1 = d1.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    t0 = dot0.to(tl.float32) * (d0 * tl.load(AD + dbase + b0)[None, :])
    t1 = dot1.to(tl.float32) * (d1 * tl.load(AD + dbase + b0 + 1)[None, :])
    return t0, t1


@triton.jit
def _act_codes(AQ, abase, c, NP: tl.constexpr, WPP: tl.constexpr, WP: tl.constexpr, BB: tl.constexpr,
               DB: tl.constexpr, HI: tl.constexpr, PACK: tl.constexpr):
    """int32 [NP, WPP, 4]: the activation code at each byte of chunk c's pairs (0 on scale and pad bytes);
    HI: the code 16 places on (a Q4_0 byte's high nibble); PACK: the four codes of a word as its bytes,
    int32 [NP, WPP] (dp4a's operand)."""
    p = c * NP + tl.arange(0, NP)
    w = tl.arange(0, WPP)
    i = tl.arange(0, 4)
    o = (w * 4)[:, None] + i[None, :]  # [WPP, 4] byte offset in the pair
    blk = (o >= BB).to(tl.int32)
    pos = o - 2 - BB * blk  # place in the block's data
    ok = (pos >= 0) & (pos < DB) & (w < WP)[:, None]
    idx = ((2 * p)[:, None, None] + blk[None, :, :]) * 32 + pos[None, :, :] + (16 if HI else 0)
    codes = tl.load(AQ + abase + idx, mask=ok[None, :, :], other=0).to(tl.int32)
    if PACK:  # disjoint bytes: the sum is the packed word
        return tl.sum((codes & 0xFF) << (i * 8)[None, None, :], axis=2)
    else:
        return codes


@triton.jit
def _pick(t, j, NP: tl.constexpr):
    """Column j of t [BR, NP], exactly (the other columns add +0.0)."""
    return tl.sum(tl.where((tl.arange(0, NP) == j)[None, :], t, 0.0), axis=1)


@triton.jit
def _expert_words_kernel(AQ, AD, AS, ACT_ROW, ORDER, SORTED_SLOT, TILE_START, W1, W2, stride1, stride2,
                         RB1, RB2, OUT, HQ, HD, HS, R, K, n_blocks,
                         T: tl.constexpr, GATED: tl.constexpr, BR: tl.constexpr, NP: tl.constexpr,
                         N_CHUNKS: tl.constexpr, WP: tl.constexpr, WPP: tl.constexpr, S: tl.constexpr,
                         BB: tl.constexpr, DB: tl.constexpr, DP4A: tl.constexpr, SPLIT_GU: tl.constexpr):
    """BR rows of one entry's expert (tile of one entry): gated, h = swiglu(gate, up) requantized into HQ /
    HD / HS; else the rows into OUT [M, R]; SPLIT_GU (not gated): the first R / BR row programs take W1's
    rows, the others W2's, into OUT [M, 2, R]. Row byte strides RB and slot strides are multiples of 4."""
    pid_r = tl.program_id(0)
    start = tl.load(TILE_START + tl.program_id(1))
    if start < 0:
        return
    slot = tl.load(SORTED_SLOT + start).to(tl.int64)
    ent = tl.load(ORDER + start).to(tl.int64)
    arow = tl.load(ACT_ROW + ent).to(tl.int64)
    out_row = OUT + ent * R
    if SPLIT_GU:
        which = pid_r // (R // BR)  # 0: gate, 1: up
        pid_r = pid_r - which * (R // BR)
        out_row = OUT + (ent * 2 + which) * R
    rows, off1, off2 = row_offsets(pid_r, slot, stride1, stride2, RB1, RB2, BR)  # byte offsets [BR]
    w1 = W1.to(tl.pointer_type(tl.int32)) + off1 // 4
    w2 = W2.to(tl.pointer_type(tl.int32)) + off2 // 4
    if SPLIT_GU:
        if which == 1:
            w1 = w2
    abase = arow * K
    dbase = arow * n_blocks
    acc1 = tl.zeros((BR,), tl.float32)
    acc2 = tl.zeros((BR,), tl.float32)
    for c in tl.static_range(N_CHUNKS):
        alo = _act_codes(AQ, abase, c, NP, WPP, WP, BB, DB, False, DP4A)
        if T == T_Q4_0:
            ahi = _act_codes(AQ, abase, c, NP, WPP, WP, BB, DB, True, DP4A)
        else:
            ahi = alo
        t0, t1 = _chunk_terms(w1, c, AD, AS, dbase, alo, ahi, T, NP, WP, WPP, S, DP4A)
        if GATED:
            u0, u1 = _chunk_terms(w2, c, AD, AS, dbase, alo, ahi, T, NP, WP, WPP, S, DP4A)
        for j in tl.static_range(NP):  # blocks 2j, 2j + 1 of the chunk, in order
            acc1 = acc1 + _pick(t0, j, NP)
            acc1 = acc1 + _pick(t1, j, NP)
            if GATED:
                acc2 = acc2 + _pick(u0, j, NP)
                acc2 = acc2 + _pick(u1, j, NP)
    if GATED:
        h = swiglu(acc1, acc2)  # [BR]
        q, d, s = quant_blocks(tl.reshape(h, (BR // 32, 32)))
        tl.store(HQ + ent * R + rows, tl.reshape(q, (BR,)))
        cols = pid_r * (BR // 32) + tl.arange(0, BR // 32)
        tl.store(HD + ent * (R // 32) + cols, d)
        tl.store(HS + ent * (R // 32) + cols, s)
    else:
        tl.store(out_row + rows, acc1)


@triton.jit
def _swiglu_quant_kernel(GU, HQ, HD, HS, R, NBB: tl.constexpr, PDL: tl.constexpr):
    """The gated tile's tail for split gate / up programs: GU f32 [M, 2, R] (gate rows, then up rows) ->
    h = swiglu(gate, up) requantized into HQ int8 [M, R], HD f32 / HS int32 [M, R / 32]: the very ops of the
    fused tile. Program (entry, NBB 32-blocks). PDL: it starts early, then waits (kernels/pdl.py)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    ent = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * NBB + tl.arange(0, NBB)  # [NBB]
    cols = blk[:, None] * 32 + tl.arange(0, 32)[None, :]  # [NBB, 32]
    g = tl.load(GU + ent * 2 * R + cols)
    u = tl.load(GU + ent * 2 * R + R + cols)
    q, d, s = quant_blocks(swiglu(g, u))
    tl.store(HQ + ent * R + cols, q)
    tl.store(HD + ent * (R // 32) + blk, d)
    tl.store(HS + ent * (R // 32) + blk, s)


def _swiglu_tail(gu, hq, hd, hs, r) -> None:
    """h = swiglu(gate, up) of GU [M, 2, R] requantized into hq / hd / hs (one launch over the M entries)."""
    nbb = min(16, (r // 32) & -(r // 32))  # a power of two dividing the row's 32-blocks
    _swiglu_quant_kernel[(hq.shape[0], r // 32 // nbb)](gu, hq, hd, hs, r, NBB=nbb, num_warps=4, **_OPTS,
                                                         **pdl_args(gu))


def launch_rows_kernel(rows, act, act_row, plan, mats, out, hq, hd, hs, r, k, gated) -> bool:
    """A CUDA C rows kernel (`rows`: expert_rows_cuda.launch_cuda_rows or expert_mma_cuda.launch_mma_rows):
    gate and up rows, then SwiGLU and the requantization; or the down rows. False where its kernel cannot
    take the launch here (nothing launched)."""
    (w1, t), (w2, _) = mats
    if not gated:  # each entry's own h row (act_row is 0..M-1 here): None spares the kernels that lookup
        return rows(act, None, plan, w1, w2, out, r, k, two=False, wtype=t)
    gu = torch.empty((hq.shape[0], 2, r), dtype=torch.float32, device=hq.device)  # [M, 2, n_ff]
    if not rows(act, act_row, plan, w1, w2, gu, r, k, two=True, wtype=t):
        return False
    _swiglu_tail(gu, hq, hd, hs, r)
    return True


def launch_words_swiglu(act, act_row, plan, gate_up, down, out, n_ff: int, n_embd: int) -> bool:
    """A quantized layer's two decode launches where the CUDA C form takes both, in tiles of at most
    WORDS["cuda_swiglu"] entries:
    gate and up rows into GU f32 [M, 2, n_ff], then the down rows, whose launch makes the SwiGLU's codes from
    GU itself, into out [M, n_embd]: the rows of the three launches (gate / up, SwiGLU, down) to the bit.
    False (nothing launched) where it does not serve: the caller then launches them one by one."""
    (w1, t), (w2, t2) = gate_up
    (wd, td), _ = down
    bt, dev = plan[3], act[0].device
    if not (bt <= WORDS["cuda_swiglu"] and cuda_words_serve(t, t2, n_embd, bt, (w1, w2), dev)
            and cuda_words_serve(td, td, n_ff, bt, (wd, wd), dev)):
        return False
    # the down form is built first (cuda_rows_ready): once the gate / up launch has run, the down launch
    # must too; a gate / up form that cannot be built declines before anything is launched
    if not cuda_rows_ready(n_embd, n_ff, False, bt, td, nvrtc.device_index(act[0]), swiglu=True):
        return False
    gu = torch.empty((act_row.numel(), 2, n_ff), dtype=torch.float32, device=dev)  # [M, 2, n_ff]
    if not launch_cuda_rows(act, act_row, plan, w1, w2, gu, n_ff, n_embd, two=True, wtype=t):
        return False
    if not launch_cuda_rows((gu, gu, gu), None, plan, wd, wd, out, n_embd, n_ff, two=False, wtype=td,
                            swiglu=True):  # ready above: a False now would leave out unwritten
        raise KernelError("the CUDA C rows declined a launch they were ready for (a knob changed between?)")
    return True


def launch_words(act, act_row, plan, mats, out, hq, hd, hs, r, k, gated, row_tile, grid) -> bool:
    """One launch of the words tiles: the CUDA C form where it serves (tiles of up to 8 entries), else the
    Triton tile (tiles of one entry); False (nothing launched) where neither takes it."""
    (w1, t), (w2, t2) = mats
    bt = plan[3]
    if (cuda_words_serve(t, t2, k, bt, (w1, w2), act[0].device)
            and launch_rows_kernel(launch_cuda_rows, act, act_row, plan, mats, out, hq, hd, hs, r, k, gated)):
        return True
    if not words_supported(t, t2, k, bt, (w1, w2)):
        return False
    order, sorted_slot, tile_start, _ = plan
    aq, ad, asum, _ = act
    wp, wpp, s, bb, db = _PAIR[t]
    n_blocks = k // 32
    np_ = WORDS["chunk_pairs"]
    split = gated and WORDS["split_gu"]
    br = row_tile(r, WORDS["gu_split_br" if split else "gu_br" if gated else "down_br"])
    dest = out
    if split:  # gate and up rows in programs of their own, then SwiGLU and the requantization
        dest = torch.empty((hq.shape[0], 2, r), dtype=torch.float32, device=aq.device)  # [M, 2, n_ff]
    _expert_words_kernel[grid(2 * r if split else r, br, tile_start)](
        aq, ad, asum, act_row, order, sorted_slot, tile_start, w1, w2, w1.stride(0), w2.stride(0),
        w1.stride(1), w2.stride(1), dest, hq, hd, hs, r, k, n_blocks,
        T=t, GATED=gated and not split, BR=br, NP=np_, N_CHUNKS=n_blocks // (2 * np_), WP=wp, WPP=wpp, S=s,
        BB=bb, DB=db, DP4A=WORDS["dp4a"] and os.environ.get("TRITON_INTERPRET") != "1", SPLIT_GU=split,
        num_warps=WORDS["down_warps" if split or not gated else "gu_warps"], **_OPTS)
    if split:
        _swiglu_tail(dest, hq, hd, hs, r)
    return True
