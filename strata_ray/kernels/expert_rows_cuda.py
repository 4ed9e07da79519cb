"""The one-token Q4_0 expert rows as a CUDA C kernel (NVRTC through cupy): the words tile's integers and fold,
with the loads of many rows in flight (WORDS["cuda"] / STRATA_WORDS_CUDA).

The Triton words tile runs at 11% of HBM on the H200: its programs wait on each block pair's loads behind
cross-thread sums, and Triton leaves no say in which thread holds which value (session 13 tried a Triton form
with every word of a program's rows in one load and the block terms folded through a scratch buffer: 44-63
us a layer against the tile's 38, the same bits, dropped). Here a row belongs to G lanes of a warp
(G = 32 for 2048 values, 8 for 512), each lane loading 9 * pairs / G words of it at a stride of G words
(coalesced), every row of the warp's RPW rows issued before any arithmetic:

    lane g of a row, word i = g + G j:  pair p = i / 9, word w = i % 9 of it (Q4_0 pair: 36 bytes, 9 words)
    per word:   v = dp4a(w & 0x0F0F0F0F, codes lo) + dp4a((w >> 4) & 0x0F0F0F0F, codes hi)  (exact ints)
    per block:  dot = sum of its words' v (shared memory), term = float(dot - 8 * asum) * (d * ad)
    per row:    one lane adds the terms to 0.0 in block order (lane r of a row group folds its row r, the
                group's RPW rows side by side)

The codes at a word's bytes are the token's activation codes at those places (0 on the scale bytes), built
in shared memory once a CTA (one entry) while the weight loads are in flight. The integers are exact in any
order and the fp32 steps are the contract's (compiled with --fmad=false), so the rows are the simple tile's,
the CPU's, to the bit. Gate and up rows come out as [M, 2, R] and expert_words' SwiGLU + requantization
launch follows, as for the split words tile.

cupy is imported only when the form is on (kernels/nvrtc): CPU machines never load it. `row_reference` is the
kernel's plain twin in numpy (the same lanes, words, codes and fold), tested against the contract on CPU.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from . import nvrtc
from .contract import KernelError

_SOURCE = r"""
// IEEE half bits -> float, exact (no cuda_fp16.h: NVRTC needs no include path)
__device__ __forceinline__ float half_bits(unsigned bits) {
    float f;
    unsigned short h = (unsigned short)bits;
    asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

// NP pairs a row, G lanes a row, WL = 9 NP / G words a lane a row, RPW rows a row group, TWO: gate and up
// rows (2R of them) into OUT [M, 2, R], else R rows into OUT [M, R].
#define WPR (9 * NP)
#define NB (2 * NP)
#define GROUPS (32 / G)
#define ROWS_CTA (WARPS * GROUPS * RPW)

extern "C" __global__ void __launch_bounds__(WARPS * 32) q4_0_rows(
    const signed char* __restrict__ AQ, const float* __restrict__ AD, const int* __restrict__ AS,
    const int* __restrict__ ACT_ROW, const int* __restrict__ ORDER, const int* __restrict__ SORTED_SLOT,
    const int* __restrict__ TILE_START, const unsigned char* __restrict__ W1,
    const unsigned char* __restrict__ W2, long long stride1, long long stride2, long long rb1, long long rb2,
    float* __restrict__ OUT, int R, int M)
{
    __shared__ int part_s[WARPS][GROUPS][WPR];   // each word's integer products
    __shared__ float d_s[WARPS][GROUPS][NB];     // each block's weight scale
    __shared__ float term_s[WARPS][GROUPS][BT][RPW][NB];  // each entry's rows' blocks' fp32 terms
    __shared__ int act_s[BT][2][WPR];             // each entry's codes at each word's bytes: lo, hi nibbles
    __shared__ float ad_s[BT][NB];                // each entry's activation block scales
    __shared__ int as_s[BT][NB];                  // and code sums
    const int start = TILE_START[blockIdx.y];
    if (start < 0) return;
    const int slot_id = SORTED_SLOT[start];
    const long long slot = slot_id;
    // the tile: the sorted entries from start that share its slot, at most BT (plan_tiles cut them so)
    int n_ent = 1;
    while (n_ent < BT && start + n_ent < M && SORTED_SLOT[start + n_ent] == slot_id) ++n_ent;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = lane / G, g = lane % G;
    const int K = 64 * NP;
    const int n_rows = TWO ? 2 * R : R;

    // this row group's rows: every word of them loaded before any arithmetic
    const int row0 = blockIdx.x * ROWS_CTA + (warp * GROUPS + grp) * RPW;
    unsigned words[RPW][WL];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int row = row0 + r;
        const bool live = row < n_rows;
        const int which = TWO && row >= R;
        const int rr = row - which * R;
        const unsigned* wrow = (const unsigned*)(which ? W2 + slot * stride2 + rr * rb2
                                                       : W1 + slot * stride1 + rr * rb1);
#pragma unroll
        for (int j = 0; j < WL; ++j)
            words[r][j] = live ? __ldg(wrow + g + G * j) : 0u;
    }

    // while they come: each entry's activation codes at each word's bytes, packed four a word (dp4a's
    // operand), once a CTA
    for (int ei = threadIdx.x; ei < n_ent * WPR; ei += WARPS * 32) {
        const int e = ei / WPR, i = ei % WPR;
        const signed char* aq = AQ + (long long)ACT_ROW[ORDER[start + e]] * K;
        const int p = i / 9, w = i % 9;
        unsigned lo = 0, hi = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int o = 4 * w + t;  // byte in the pair: [d0 d0 q0..q15 d1 d1 q0..q15]
            const int second = o >= 18;
            const int pos = o - 2 - 18 * second;
            if (pos >= 0) {
                const int base = (2 * p + second) * 32 + pos;
                lo |= (unsigned)(unsigned char)aq[base] << (8 * t);
                hi |= (unsigned)(unsigned char)aq[base + 16] << (8 * t);
            }
        }
        act_s[e][0][i] = (int)lo;
        act_s[e][1][i] = (int)hi;
    }
    for (int eb = threadIdx.x; eb < n_ent * NB; eb += WARPS * 32) {
        const int e = eb / NB, b = eb % NB;
        const long long arow = ACT_ROW[ORDER[start + e]];
        ad_s[e][b] = AD[arow * NB + b];
        as_s[e][b] = AS[arow * NB + b];
    }
    __syncthreads();

    // each entry of the tile in turn over the same weight words (registers), the one-entry arithmetic: an
    // entry's rows do not depend on the others of its tile
    for (int e = 0; e < n_ent; ++e) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
#pragma unroll
            for (int j = 0; j < WL; ++j) {
                const int i = g + G * j, w = i % 9;
                const unsigned x = words[r][j];
                int v = __dp4a((int)(x & 0x0F0F0F0Fu), act_s[e][0][i], 0);
                v = __dp4a((int)((x >> 4) & 0x0F0F0F0Fu), act_s[e][1][i], v);
                part_s[warp][grp][i] = v;
                if (w == 0) d_s[warp][grp][2 * (i / 9)] = half_bits(x & 0xFFFFu);
                if (w == 4) d_s[warp][grp][2 * (i / 9) + 1] = half_bits(x >> 16);
            }
            __syncwarp();
#pragma unroll
            for (int m = 0; m < NB / G; ++m) {
                const int b = g + G * m, p = b >> 1, first = 9 * p + 5 * (b & 1), n = (b & 1) ? 4 : 5;
                int dot = 0;
                for (int u = 0; u < n; ++u) dot += part_s[warp][grp][first + u];
                dot -= 8 * as_s[e][b];
                const float scale = d_s[warp][grp][b] * ad_s[e][b];
                term_s[warp][grp][e][r][b] = (float)dot * scale;
            }
            __syncwarp();  // part_s and d_s are the next row's
        }
    }

    // the fold: lane c of the row group adds the terms of (entry, row) c / RPW, c % RPW in block order, the
    // tile's entries and rows side by side
    for (int c = g; c < n_ent * RPW; c += G) {
        const int e = c / RPW, r = c % RPW, row = row0 + r;
        if (row < n_rows) {
            float acc = 0.0f;
            for (int b = 0; b < NB; ++b) acc = acc + term_s[warp][grp][e][r][b];
            const long long ent = ORDER[start + e];
            const int which = TWO && row >= R;
            OUT[(TWO ? (ent * 2 + which) : ent) * R + (row - which * R)] = acc;
        }
    }
}
"""


def cuda_rows_serves(k: int, bt: int = 1) -> bool:
    """Whether the CUDA form serves Q4_0 rows of k values in tiles of up to bt entries: a whole number of
    block pairs, at most 36 words a lane a row (the registers of RPW rows in flight), and the CTA's shared
    memory within the 48 KiB a kernel may declare statically."""
    if k % 64 or bt < 1:
        return False
    np_ = k // 64
    from .expert_words import WORDS

    smem = shared_bytes(np_, bt, WORDS["cuda_rpw"], WORDS["cuda_warps"])
    return 9 * np_ // _lanes(np_) <= 36 and smem <= 48 << 10


def shared_bytes(np_: int, bt: int, rpw: int, warps: int) -> int:
    """The kernel's static shared memory: part_s, d_s, term_s, act_s, ad_s and as_s (4-byte elements)."""
    wpr, nb, groups = 9 * np_, 2 * np_, 32 // _lanes(np_)
    return 4 * (warps * groups * (wpr + nb + bt * rpw * nb) + bt * (2 * wpr + 2 * nb))


def _lanes(np_: int) -> int:
    """G: lanes a row, the largest power of two dividing the row's pairs, at most 32."""
    return min(32, np_ & -np_)


@functools.cache
def _kernel(np_: int, two: bool, bt: int, rpw: int, warps: int, device: int):
    g = _lanes(np_)
    defines = (f"-DNP={np_}", f"-DG={g}", f"-DWL={9 * np_ // g}", f"-DBT={bt}", f"-DRPW={rpw}",
               f"-DWARPS={warps}", f"-DTWO={int(two)}")
    return nvrtc.build(_SOURCE, "q4_0_rows", ("--fmad=false", *defines), device)


def cuda_rows_kernel(k: int, two: bool, device: int, bt: int = 1):
    """The compiled kernel for rows of k values in tiles of up to bt entries on CUDA device `device`, or None
    where it cannot be built (an NVRTC or driver too old for the GPU, say): the Triton tile then, with the
    same bits, after one warning."""
    from .expert_words import WORDS

    key = (k // 64, two, bt, WORDS["cuda_rpw"], WORDS["cuda_warps"], device)  # rows in flight a group, warps
    return nvrtc.build_or_none(("q4_0_rows", *key), lambda: _kernel(*key), "expert rows",
                               "the Triton tile takes their launches (the same bits)")


def launch_cuda_rows(act, act_row, plan, w1, w2, out, r: int, k: int, two: bool) -> bool:
    """OUT [M, 2, R] (two: gate rows of w1, up rows of w2) or [M, R] (w1's rows) over the plan's tiles
    (order, sorted_slot, tile_start, bt: up to bt entries of one slot a tile), on the current torch stream;
    False (nothing launched) where the kernel cannot be built here."""
    order, sorted_slot, tile_start = plan[:3]
    bt = plan[3] if len(plan) > 3 else 1
    aq, ad, asum = act[:3]
    if not cuda_rows_serves(k, bt):
        raise KernelError(f"the CUDA expert rows do not serve rows of {k} values in tiles of {bt} entries")
    from .expert_words import WORDS

    dev = nvrtc.device_index(aq)
    kern = cuda_rows_kernel(k, two, dev, bt)
    if kern is None:
        return False
    rpw, warps = WORDS["cuda_rpw"], WORDS["cuda_warps"]
    rows_cta = warps * (32 // _lanes(k // 64)) * rpw
    n_rows = 2 * r if two else r
    grid = ((n_rows + rows_cta - 1) // rows_cta, tile_start.numel())
    if grid[1] > 65535:
        raise KernelError(f"too many entry tiles in one launch ({grid[1]})")
    ptrs = [nvrtc.ptr(t) for t in (aq, ad, asum, act_row, order, sorted_slot, tile_start, w1, w2)]
    args = (*ptrs, np.int64(w1.stride(0)), np.int64(w2.stride(0)), np.int64(w1.stride(1)),
            np.int64(w2.stride(1)), nvrtc.ptr(out), np.int32(r), np.int32(order.numel()))
    nvrtc.launch(kern, grid, warps * 32, args, dev)
    return True


def cuda_rows_on() -> bool:
    """STRATA_WORDS_CUDA, else expert_words.WORDS["cuda"]; off where cupy is not installed (the Triton tile
    then, with the same bits)."""
    from .expert_words import WORDS

    on = os.environ.get("STRATA_WORDS_CUDA", "")  # config refuses values other than 0 / 1
    return (on == "1" if on else bool(WORDS["cuda"])) and nvrtc.has_cupy()


def row_reference(row: np.ndarray, aq: np.ndarray, ad: np.ndarray, asum: np.ndarray) -> np.float32:
    """The kernel's arithmetic for one Q4_0 row, lane by lane in numpy (its plain twin: the same word to lane
    map, packed codes, block sums and fold). row uint8 [9 NP * 4]; aq int8 [64 NP]; ad f32 / asum int32
    [2 NP]."""
    words = np.ascontiguousarray(row).view(np.uint32)
    np_ = len(words) // 9
    g_lanes = _lanes(np_)
    part = np.zeros(9 * np_, np.int64)  # part_s
    d = np.zeros(2 * np_, np.float32)  # d_s
    for g in range(g_lanes):
        for j in range(9 * np_ // g_lanes):
            i = g + g_lanes * j
            p, w = divmod(i, 9)
            x = int(words[i])
            for t in range(4):
                o = 4 * w + t
                second = int(o >= 18)
                pos = o - 2 - 18 * second
                if pos >= 0:
                    base = (2 * p + second) * 32 + pos
                    byte = x >> (8 * t)
                    part[i] += (byte & 0xF) * int(aq[base]) + ((byte >> 4) & 0xF) * int(aq[base + 16])
            if w == 0:
                d[2 * p] = np.uint16(x & 0xFFFF).view(np.float16)
            if w == 4:
                d[2 * p + 1] = np.uint16(x >> 16).view(np.float16)
    terms = np.zeros(2 * np_, np.float32)  # term_s
    for b in range(2 * np_):
        first, n = 9 * (b >> 1) + 5 * (b & 1), 4 if b & 1 else 5
        dot = int(part[first:first + n].sum()) - 8 * int(asum[b])
        terms[b] = np.float32(dot) * (d[b] * ad[b])
    acc = np.float32(0.0)
    for b in range(2 * np_):
        acc = np.float32(acc + terms[b])
    return acc
