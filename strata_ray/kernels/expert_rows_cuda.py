"""The decode expert rows of Q4_0, Q8_0, Q4_K and Q6_K layers as a CUDA C kernel (NVRTC through cupy): the
contract's integers and fold, with the loads of many rows in flight (WORDS["cuda"] / STRATA_WORDS_CUDA).
Q4_0 is described below; Q8_0 pairs are the same with 17 words and signed codes (no -8); a Q4_K lane holds a
quarter super-block (2 sub-blocks: their 8 code words, d, dmin and their two 6-bit scales and mins from the
super-block's 4 header words, then per sub-block dot = sum of dp4a over 8 nibble words, term = float(dot sc)
(d ad) - float(m asum) (dmin ad)); a Q6_K lane a quarter super-block (2 blocks: codes (q - 32) as signed
bytes, one int8 scale a 16-value half, term =
float(sc0 dot0 + sc1 dot1) (d ad)), its 210-byte super-block read from the staged row at 2-byte alignment
by __byte_perm. `geometry` gives each type's words, lanes and units a row.

The Triton words tile runs at 11% of HBM on the H200: its programs wait on each block pair's loads behind
cross-thread sums, and Triton leaves no say in which thread holds which value (session 13 tried a Triton form
with every word of a program's rows in one load and the block terms folded through a scratch buffer: 44-63
us a layer against the tile's 38, the same bits, dropped). Here a row belongs to G lanes of a warp
(G = 32 for 2048 values, 8 for 512), each lane loading 9 * pairs / G words of it at a stride of G words
(coalesced), every row of the warp's RPW rows issued before any arithmetic. A CTA is a tile: up to BT
entries (tokens of a verify window) routed to one expert, each entry's rows from the same weight words.

    a row's words pass through shared memory to the lanes of its pairs: lane g holds pairs g + G q, whole
    per pair:   36 bytes, 9 words [d0 d0 q0..q15 d1 d1 q0..q15]; the first block's codes realigned by one
                __byte_perm a word; then per block and entry, exact integers and the contract's fp32:
                dot = sum of 4 words' dp4a(w & 0x0F0F0F0F, codes lo) + dp4a((w >> 4) & 0x0F0F0F0F, codes hi)
                term = float(dot - 8 * asum) * (d * ad)
    per row:    one thread adds the terms to 0.0 in block order: after a CTA barrier thread ch folds the
                CTA's chain ch, its row groups' (entry, row) side by side (CTAFOLD, the default since
                session 47: 0-3% faster than each warp's lanes folding its own rows, which at one-entry tiles
                kept 30 of a warp's 32 lanes idle through 64 dependent adds)

Session 15's form kept the coalesced words on their lanes and summed each block's word products through
shared memory (a division by 9 and a 4-or-5-term sum per word): ncu found it instruction bound (0.60 issued a
scheduler cycle, DRAM 15%). The activation codes are the token's int8 codes read four a word, built in shared
memory once a CTA while the weight loads are in flight (16-byte loads). A row group's RPW rows are unpacked
into registers before the entries, so each entry's codes leave shared memory once for all of them, and the
fold's terms sit at a pitch whose quarter is odd, read 16 bytes at a time without bank conflicts (session 26:
ncu had the shared-memory pipe at 73% and DRAM at 29% for tiles of several entries before). The integers
are exact in any order and the fp32
steps are the contract's (compiled with --fmad=false), so the rows are the simple tile's, the CPU's, to the
bit. Gate and up rows come out as [M, 2, R]. The down launch then makes the SwiGLU's codes from them itself
(SWIGLU, expert_words.WORDS["cuda_swiglu"]: eight lanes a 32-block, contract_c's SwiGLU and quant_blocks'
steps while the weight words are in flight), or expert_words' SwiGLU + requantization launch runs between,
as for the split words tile (the same codes).

Where a launch's tiles hold several entries, a CTA walks several row blocks (rows_iters: the gate / up launch
at tiles of 4 and 8), each block's successor's words loaded while its entries are computed, a form of its
own (PREFETCH) because its live words cost registers the one-block form keeps (session 37 on an H100: Q4_0 8
tokens x top-10 52.6 -> 42.2 us a layer with the staged rows' pitch below it).

cupy is imported only when the form is on (kernels/nvrtc): CPU machines never load it. `row_reference` is the
kernel's plain twin in numpy (the same lanes, words, codes and fold), tested against the contract on CPU.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from . import nvrtc
from .contract import Q4_0, Q4_K, Q6_K, Q8_0, KernelError
from .contract_c import HALF_SOURCE, I2F_SOURCE, swiglu_source

# BIAS (WORDS["cuda_bias"]) takes contract_c's biased_f: one float subtraction where (float)i is an I2F
_SOURCE = nvrtc.PDL_HOOKS + swiglu_source() + I2F_SOURCE + HALF_SOURCE + r"""
// entry i's activation row (i in the sorted order): ACT_ROW[ORDER[i]], or ORDER[i] itself where ACT_ROW is
// null (the down launch: each entry reads its own h row, one dependent load fewer). Every thread looks up the
// entries it stages itself (a few cached words) rather than wait at a barrier for one warp's lookups
__device__ __forceinline__ long long act_row_of(const int* __restrict__ ACT_ROW,
                                                const int* __restrict__ ORDER, int i) {
    const int o = __ldg(ORDER + i);
    return ACT_ROW ? __ldg(ACT_ROW + o) : o;
}

// A row is NU units: Q4_0 block pairs (9 words, 2 blocks of 32) or Q8_0 block pairs (Q80 1: 17 words), NPL
// of them a lane; or Q4_K super-blocks (Q4K 1: 36 words, 8 blocks) or Q6_K super-blocks (Q6K 1: 210 bytes, 8
// blocks), a lane taking NPL quarters of 2 blocks. WPR words and NB 32-blocks a row (from the host, as G, the
// lanes a row, and WL = ceil(WPR / G), the words a lane loads a row); BT entries at most a tile, RPW rows a
// row group, TWO: gate and up rows (2R of them) into OUT [M, 2, R], else R rows into OUT [M, R]. TP: a term
// slot's pitch in floats (term_pitch on the host, which sizes the shared memory by it too).
#define GROUPS (32 / G)
#define ROWS_CTA (WARPS * GROUPS * RPW)

#ifdef MIN_CTAS  // a minimum of 1 is not "none": ptxas then took 60 registers where it takes 40 without
#define ROWS_BOUNDS __launch_bounds__(WARPS * 32, MIN_CTAS)
#else
#define ROWS_BOUNDS __launch_bounds__(WARPS * 32)
#endif
extern "C" __global__ void ROWS_BOUNDS expert_rows(
    const signed char* __restrict__ AQ, const float* __restrict__ AD, const int* __restrict__ AS,
    const int* __restrict__ ACT_ROW, const int* __restrict__ ORDER, const int* __restrict__ SORTED_SLOT,
    const int* __restrict__ TILE_START, const unsigned char* __restrict__ W1,
    const unsigned char* __restrict__ W2, long long stride1, long long stride2, long long rb1, long long rb2,
    float* __restrict__ OUT, int R, int M, int one_row)
{
    // a row's words, from the coalesced loads to unit lanes: SP (stage_pitch on the host) at least WPR + 1
    // (+1: Q6_K's realigning reads) and G mod 32, so the GROUPS row groups of a warp sit G banks apart: their
    // stores (lane g of group grp at g + G (j + grp)) and their unit reads (9 or 17 words a lane) hit 32
    // distinct banks (at WPR + 1 a 512-value Q4_0 down row's reads were 4-way conflicts: session 37)
    __shared__ unsigned stage_s[WARPS][GROUPS][SP];
    // each (entry, row)'s blocks' fp32 terms: slot c = e RPW + r of row group grp at [grp][c], TP apart:
    // a multiple of 4 whose quarter is odd, so the fold's lanes, each reading its own slot's blocks 4 at a
    // time, hit distinct banks within each 8-lane phase of a 16-byte load (NB apart they all hit one bank, a
    // 16-way conflict for a tile of 8 entries, a block at a time)
    __shared__ __align__(16) float term_s[WARPS][GROUPS][BT * RPW][TP];
    // CTAFOLD: (entry, row) chains numbered across the CTA, ch = (e RPW + r) WARPS GROUPS + row group (warp
    // GROUPS + grp), their slots side by side in term_s (flat, ch TP floats in), and thread ch folds chain
    // ch after a CTA barrier: a one-entry tile's 2 chains a warp become 8 in one warp, whose fold serves the
    // CTA's rows where each warp folded its own (64 dependent adds issued once for 8 rows, not 4 times for 2)
    float (*const term_f)[TP] = (float (*)[TP])&term_s[0][0][0][0];
    __shared__ __align__(16) int act_s[BT][8][NB];  // entry e's codes of block b: lo words k, hi words 4 + k
    __shared__ __align__(8) float ad_s[BT][NB];      // each entry's activation block scales
    __shared__ __align__(8) int as_s[BT][NB];        // and code sums
    pdl_trigger();
    pdl_wait();  // the plan, the codes and the slots are the chain's: it only starts early (kernels/pdl.py)
    // EARLY: a tile of one entry (BT 1) is the plan's entry y = blockIdx.y wherever it starts at y, as both
    // plans make them (plan_tiles, decode_plan), so its slot and order are loaded beside TILE_START instead
    // of after it, and a launch of one activation row (one_row: the one-token decode) reads row 0 with no
    // lookup at all. Without it each CTA waited on TILE_START -> ORDER -> ACT_ROW -> the codes, four trips
    // through L2 before its first barrier (session 47's ncu: 39% of the one-token gate / up launch's stall
    // samples on that chain, the whole launch one wave)
    const int y = blockIdx.y;
#if EARLY && BT == 1
    const int slot_y = y < M ? __ldg(SORTED_SLOT + y) : 0, order_y = y < M ? __ldg(ORDER + y) : 0;
#endif
    const int start = TILE_START[y];
    if (start < 0) return;
#if EARLY && BT == 1
    const bool at_y = start == y;
    const int slot_id = at_y ? slot_y : SORTED_SLOT[start];
    const int order0 = at_y ? order_y : __ldg(ORDER + start);  // entry 0's (the tile's only) place
    const long long arow0 = one_row ? 0LL : ACT_ROW ? (long long)__ldg(ACT_ROW + order0) : (long long)order0;
#define ENTRY_OF(e) ((long long)order0)
#define ACT_ROW_OF(e) arow0
#else
    const int slot_id = SORTED_SLOT[start];
#define ENTRY_OF(e) ((long long)ORDER[start + (e)])
#define ACT_ROW_OF(e) (EARLY && one_row ? 0LL : act_row_of(ACT_ROW, ORDER, start + (e)))
#endif
    const long long slot = slot_id;
    // the tile: the sorted entries from start that share its slot, at most BT (plan_tiles cut them so)
    int n_ent = 1;
    while (n_ent < BT && start + n_ent < M && SORTED_SLOT[start + n_ent] == slot_id) ++n_ent;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = lane / G, g = lane % G;
    const int K = 32 * NB;
    const int n_rows = TWO ? 2 * R : R;
    const int n_blocks = (n_rows + ROWS_CTA - 1) / ROWS_CTA;  // row blocks of ROWS_CTA rows

    // a row block's rows of this row group: every word of them loaded (coalesced: lane g takes words g + G j)
    // before any arithmetic that needs them
    unsigned words[RPW][WL];
#define LOAD_ROWS(BLOCK)                                                                                  \
    _Pragma("unroll") for (int r = 0; r < RPW; ++r) {                                                    \
        const int row = (BLOCK) * ROWS_CTA + (warp * GROUPS + grp) * RPW + r;                             \
        const bool live = row < n_rows;                                                                   \
        const int which = TWO && row >= R;                                                                \
        const int rr = row - which * R;                                                                   \
        const unsigned* wrow = (const unsigned*)(which ? W2 + slot * stride2 + rr * rb2                   \
                                                       : W1 + slot * stride1 + rr * rb1);                 \
        _Pragma("unroll") for (int j = 0; j < WL; ++j)                                                   \
            words[r][j] = live && (WPR % G == 0 || g + G * j < WPR) ? __ldg(wrow + g + G * j) : 0u;       \
    }
    LOAD_ROWS(blockIdx.x)

    // while they come: each entry's activation codes, four a word as dp4a takes them, once a CTA (no barrier
    // before: each thread finds its entries' rows itself; session 38's ncu had the down launch's warps
    // stalled at barriers 4.1 cycles an issue, the most of any reason)
#if SWIGLU
    // the down launch with the SwiGLU folded in: AQ is the gate / up launch's GU f32 [M, 2, K] (gate rows,
    // then up rows), and each CTA makes its entries' h = swiglu(gate, up) codes itself, contract steps 3 and
    // 1 as triton_blocks' swiglu and quant_blocks compute them (one launch fewer a layer than the SwiGLU
    // kernel between). Eight lanes a 32-block, a code word (4 values) a lane: the block's amax, finite test
    // and code sum over the eight by three shuffles (a max and an integer sum: exact in any order); four
    // values a lane keep the form within a few registers of the plain down launch's (ptxas)
    for (int qi = threadIdx.x; qi < n_ent * NB * 8; qi += WARPS * 32) {
        const int e = qi / (NB * 8), b = (qi >> 3) % NB, k = qi & 7;
        const unsigned octet = 0xFFu << (lane & 24);  // an octet's lanes are all in the loop or all out
        const float* gp = (const float*)AQ + ACT_ROW_OF(e) * (2LL * K) + 32 * b
                          + 4 * k;  // gate values 32 b + 4 k.. of the entry's GU row; its up values K on
        const float4 g4 = *(const float4*)gp, u4 = *(const float4*)(gp + K);
        const float h[4] = {c_swiglu(g4.x, u4.x), c_swiglu(g4.y, u4.y), c_swiglu(g4.z, u4.z),
                            c_swiglu(g4.w, u4.w)};
        float amax = 0.0f;  // over the finite values; a NaN or an infinity poisons the block
        int fin = 1;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float a = fabsf(h[i]);
            const bool ok = a <= C_F32_MAX;
            fin &= ok;
            amax = ok ? fmaxf(amax, a) : amax;
        }
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(octet, amax, o));
            fin &= __shfl_xor_sync(octet, fin, o);
        }
        const bool live = fin && amax >= C_TINY;
        const float dq = !fin ? __uint_as_float(0x7FC00000u) : live ? __fdiv_rn(amax, C_Q_MAX) : 0.0f;
        const float safe = live ? dq : 1.0f;
        unsigned word = 0u;
        int sum = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int code = live ? (int)c_rint(__fdiv_rn(h[i], safe)) : 0;
            sum += code;
            word |= (unsigned)(code & 0xFF) << (8 * i);
        }
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(octet, sum, o);
        act_s[e][k][b] = (int)word;  // code word k of block b
        if (k == 0) {
            ad_s[e][b] = dq;
            as_s[e][b] = sum;
        }
    }
#else
    if (((unsigned long long)AQ & 15) == 0) {
        // a block's 8 code words as two 16-byte loads: lanes 2 apart store 2 words apart (2-way), where one
        // word a lane stored 8 rows of NB apart: an 8-way conflict
        for (int qi = threadIdx.x; qi < n_ent * (K / 16); qi += WARPS * 32) {
            const int e = qi / (K / 16), wq = qi % (K / 16), b = wq >> 1, k0 = 4 * (wq & 1);
            const int4 v = ((const int4*)(AQ + ACT_ROW_OF(e) * K))[wq];
            act_s[e][k0][b] = v.x;
            act_s[e][k0 + 1][b] = v.y;
            act_s[e][k0 + 2][b] = v.z;
            act_s[e][k0 + 3][b] = v.w;
        }
    } else {
        for (int ei = threadIdx.x; ei < n_ent * (K / 4); ei += WARPS * 32) {
            const int e = ei / (K / 4), wi = ei % (K / 4);
            const int* aq = (const int*)(AQ + ACT_ROW_OF(e) * K);
            act_s[e][wi & 7][wi >> 3] = aq[wi];
        }
    }
    for (int eb = threadIdx.x; eb < n_ent * NB; eb += WARPS * 32) {
        const int e = eb / NB, b = eb % NB;
        const long long arow = ACT_ROW_OF(e);
        ad_s[e][b] = AD[arow * NB + b];
        as_s[e][b] = AS[arow * NB + b];
    }
#endif
    __syncthreads();

    // PREFETCH: the CTA's row blocks blockIdx.x + gridDim.x i (rows_iters of them on the host's grid): the
    // activation staging above serves them all, and each block's successor's words are loaded while its
    // entries are computed and folded, so a warp's loads stay in flight through its arithmetic (one block a
    // CTA leaves every CTA loads, then arithmetic: the gate / up launch at 8 entries a tile 42.6 -> 31.6 us
    // under ncu, session 37). Otherwise one block a CTA (grid.x = n_blocks).
#if PREFETCH
    for (int blk = blockIdx.x; blk < n_blocks; blk += gridDim.x) {
#else
    {  // one row block a CTA: no loop, whose live values took registers from the occupancy (ptxas: 40 -> 56)
        const int blk = blockIdx.x;
#endif
    // (the block's body, not indented for the loop)
    const int row0 = blk * ROWS_CTA + (warp * GROUPS + grp) * RPW;

    // every row of the group unpacked into registers first, so each entry's activation codes are read from
    // shared memory once for the RPW rows (a read a row and entry kept the shared-memory pipe the kernel's
    // busiest unit at tiles of several entries, ncu: L1 73%, DRAM 29%)
#if Q4K
    unsigned cw[RPW][NPL][8];
    int sc[RPW][NPL][2], mn[RPW][NPL][2];
    float d[RPW][NPL][2];
#elif Q6K
    unsigned cw[RPW][NPL][16];
    int sc[RPW][NPL][4];
    float d[RPW][NPL];
#elif Q80
    unsigned cw[RPW][NPL][16];  // code words of blocks 2p (k < 8) and 2p + 1 (k >= 8)
    float d[RPW][NPL][2];
#else
    unsigned lo[RPW][NPL][8], hi[RPW][NPL][8];  // nibbles of blocks 2p (k < 4), 2p + 1 (k >= 4) by dp4a word
    float d[RPW][NPL][2];
#endif
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        // the row's words to the lanes of its units: lane g holds units g + G q
#pragma unroll
        for (int j = 0; j < WL; ++j)
            if (WPR % G == 0 || g + G * j < WPR) stage_s[warp][grp][g + G * j] = words[r][j];
        __syncwarp();
#if Q4K
        // super-block bytes [d d dmin dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes]: code
        // bytes 32 h .. 32 h + 31 hold sub-block 2 h in their low nibbles and 2 h + 1 in their high ones.
        // Quarter c = g + G q is sub-blocks 2 h, 2 h + 1 (h = c % 4) of super-block c / 4: its 8 code words
        // and the two sub-blocks' scales and mins (bytes j, 4 + j, 8 + j of the scale words, j = 2 h + s
        // mod 4)
#pragma unroll
        for (int q = 0; q < NPL; ++q) {
            const int c = g + G * q, h = c & 3;
            const unsigned* pw = &stage_s[warp][grp][36 * (c >> 2)];
            const unsigned w0 = pw[0];
            d[r][q][0] = half_bits(w0 & 0xFFFFu);
            d[r][q][1] = half_bits(w0 >> 16);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const int j = 2 * h + s, sh = 8 * (j & 3);
                const unsigned s_lo = (pw[1] >> sh) & 0xFFu, s_mid = (pw[2] >> sh) & 0xFFu;
                const unsigned s_hi = (pw[3] >> sh) & 0xFFu;
                sc[r][q][s] = j < 4 ? s_lo & 63 : (s_hi & 0xF) | ((s_lo >> 6) << 4);
                mn[r][q][s] = j < 4 ? s_mid & 63 : (s_hi >> 4) | ((s_mid >> 6) << 4);
            }
#pragma unroll
            for (int t = 0; t < 8; ++t) cw[r][q][t] = pw[4 + 8 * h + t];
        }
#elif Q6K
        // super-block bytes [ql 128, qh 64, 16 int8 scales, d d], 2-byte aligned for odd super-blocks.
        // Quarter c = g + G q is blocks 2 jj, 2 jj + 1 (jj = c % 4) of super-block c / 4; block j = 4 h + r:
        // its codes' low 4 bits from ql bytes 64 h + 32 (r % 2).. (nibble r / 2), high 2 bits from qh bytes
        // 128 + 32 h.. (bits 2 r, 2 r + 1). cw: (q - 32) as signed bytes, 8 words a block; sc: the scales of
        // the two blocks' 16-value halves (bytes 192 + 4 jj..).
#pragma unroll
        for (int q = 0; q < NPL; ++q) {
            const int c = g + G * q, u = c >> 2, jj = c & 3, h = jj >> 1, base = 210 * u;
            const unsigned* sw = stage_s[warp][grp];
            const unsigned sel = (base & 2) ? 0x5432u : 0x3210u;  // the word at base + o, realigned
#define Q6_WORD(o) __byte_perm(sw[(base + (o)) >> 2], sw[((base + (o)) >> 2) + 1], sel)
            d[r][q] = half_bits(Q6_WORD(208) & 0xFFFFu);
            const unsigned s4 = Q6_WORD(192 + 4 * jj);
#pragma unroll
            for (int i = 0; i < 4; ++i) sc[r][q][i] = (int)(signed char)(s4 >> (8 * i));
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int rr = 2 * (jj & 1) + half;
#pragma unroll
                for (int t = 0; t < 8; ++t) {
                    const unsigned ql = Q6_WORD(64 * h + 32 * (rr & 1) + 4 * t);
                    const unsigned qh = Q6_WORD(128 + 32 * h + 4 * t);
                    const unsigned code = ((ql >> (4 * (rr >> 1))) & 0x0F0F0F0Fu)
                                          | (((qh >> (2 * rr)) & 0x03030303u) << 4);
                    cw[r][q][8 * half + t] = __vsub4(code, 0x20202020u);
                }
            }
#undef Q6_WORD
        }
#elif Q80
        // pair bytes [d0 d0 c0..c31 d1 d1 c0..c31] (int8 codes): the first block's sit two bytes into a word
#pragma unroll
        for (int q = 0; q < NPL; ++q) {
            const unsigned* pw = &stage_s[warp][grp][17 * (g + G * q)];
            unsigned w[17];
#pragma unroll
            for (int i = 0; i < 17; ++i) w[i] = pw[i];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                cw[r][q][k] = __byte_perm(w[k], w[k + 1], 0x5432);
                cw[r][q][8 + k] = w[9 + k];
            }
            d[r][q][0] = half_bits(w[0] & 0xFFFFu);
            d[r][q][1] = half_bits(w[8] >> 16);
        }
#else
#pragma unroll
        for (int q = 0; q < NPL; ++q) {
            const unsigned* pw = &stage_s[warp][grp][9 * (g + G * q)];
            unsigned w[9];
#pragma unroll
            for (int i = 0; i < 9; ++i) w[i] = pw[i];
            // pair bytes [d0 d0 q0..q15 d1 d1 q0..q15]: the first block's codes sit two bytes into a word
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const unsigned a = __byte_perm(w[k], w[k + 1], 0x5432), b = w[5 + k];
                lo[r][q][k] = a & 0x0F0F0F0Fu;
                hi[r][q][k] = (a >> 4) & 0x0F0F0F0Fu;
                lo[r][q][4 + k] = b & 0x0F0F0F0Fu;
                hi[r][q][4 + k] = (b >> 4) & 0x0F0F0F0Fu;
            }
            d[r][q][0] = half_bits(w[0] & 0xFFFFu);
            d[r][q][1] = half_bits(w[4] >> 16);
        }
#endif
        __syncwarp();  // stage_s is the next row's
    }
#if PREFETCH
    if (blk + gridDim.x < n_blocks) {  // the next row block's words, in flight through its arithmetic
        LOAD_ROWS(blk + gridDim.x)
    }
#endif

    // each entry of the tile over the same registers, the one-entry arithmetic: an entry's rows do not
    // depend on the others of its tile. A unit's two blocks are b0, b0 + 1 (b0 = 2 (g + G q) for every type:
    // Q4_K and Q6_K quarter c holds blocks 8 (c / 4) + 2 (c % 4) = 2 c); their code words k side by side
    for (int e = 0; e < n_ent; ++e) {
#pragma unroll
        for (int q = 0; q < NPL; ++q) {
            const int b0 = 2 * (g + G * q);
            int2 ac[8];  // the entry's code words k of blocks b0 (.x), b0 + 1 (.y)
#pragma unroll
            for (int k = 0; k < 8; ++k) ac[k] = *(const int2*)&act_s[e][k][b0];
            const float2 ad = *(const float2*)&ad_s[e][b0];
#if Q4K || !(Q6K || Q80)
            const int2 as = *(const int2*)&as_s[e][b0];
#endif
#if BIAS && !(Q4K || Q6K || Q80)
            // BIAS: the dot chains start at I2F_BIAS - 8 asum, so they end at the contract's dot plus the
            // bias and float() is one subtraction (exact: |dot - 8 asum| < 2^22), with no I2F
            const int2 zb = make_int2(I2F_BIAS - 8 * as.x, I2F_BIAS - 8 * as.y);
#endif
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                // b0 even: its two terms one 8-byte store
                float* term = CTAFOLD ? term_f[(e * RPW + r) * (WARPS * GROUPS) + warp * GROUPS + grp]
                                      : term_s[warp][grp][e * RPW + r];
                float2 tt;
#if Q4K
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    int dot = 0;
#pragma unroll
                    for (int t = 0; t < 8; ++t) {
                        const unsigned nib = s ? (cw[r][q][t] >> 4) & 0x0F0F0F0Fu : cw[r][q][t] & 0x0F0F0F0Fu;
                        dot = __dp4a((int)nib, s ? ac[t].y : ac[t].x, dot);
                    }
                    const float a_d = s ? ad.y : ad.x;
#if BIAS  // |dot sc| < 2^22 (60,960 x 63), |m asum| < 2^18
                    const float t_i = biased_f(dot * sc[r][q][s] + I2F_BIAS) * (d[r][q][0] * a_d);
                    const int m_as = mn[r][q][s] * (s ? as.y : as.x);
                    const float t_m = biased_f(m_as + I2F_BIAS) * (d[r][q][1] * a_d);
#else
                    const float t_i = (float)(dot * sc[r][q][s]) * (d[r][q][0] * a_d);
                    const float t_m = (float)(mn[r][q][s] * (s ? as.y : as.x)) * (d[r][q][1] * a_d);
#endif
                    (s ? tt.y : tt.x) = t_i - t_m;
                }
#elif Q6K
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    int lo = 0, hi = 0;  // the block's two 16-value halves
#pragma unroll
                    for (int t = 0; t < 4; ++t) {
                        lo = __dp4a((int)cw[r][q][8 * half + t], half ? ac[t].y : ac[t].x, lo);
                        hi = __dp4a((int)cw[r][q][8 * half + 4 + t], half ? ac[4 + t].y : ac[4 + t].x, hi);
                    }
                    const int isum = sc[r][q][2 * half] * lo + sc[r][q][2 * half + 1] * hi;
                    (half ? tt.y : tt.x) = (float)isum * (d[r][q] * (half ? ad.y : ad.x));
                }
#elif Q80
                int dot[2] = {BIAS ? I2F_BIAS : 0, BIAS ? I2F_BIAS : 0};  // |dot| < 2^19 (32 x 127 x 127)
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    dot[0] = __dp4a((int)cw[r][q][k], ac[k].x, dot[0]);
                    dot[1] = __dp4a((int)cw[r][q][8 + k], ac[k].y, dot[1]);
                }
#if BIAS
                tt.x = biased_f(dot[0]) * (d[r][q][0] * ad.x);
                tt.y = biased_f(dot[1]) * (d[r][q][1] * ad.y);
#else
                tt.x = (float)dot[0] * (d[r][q][0] * ad.x);
                tt.y = (float)dot[1] * (d[r][q][1] * ad.y);
#endif
#else
#if BIAS
                int dot[2] = {zb.x, zb.y};
#else
                int dot[2] = {0, 0};
#endif
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    dot[0] = __dp4a((int)lo[r][q][k], ac[k].x, dot[0]);
                    dot[0] = __dp4a((int)hi[r][q][k], ac[4 + k].x, dot[0]);
                    dot[1] = __dp4a((int)lo[r][q][4 + k], ac[k].y, dot[1]);
                    dot[1] = __dp4a((int)hi[r][q][4 + k], ac[4 + k].y, dot[1]);
                }
#if BIAS
                tt.x = biased_f(dot[0]) * (d[r][q][0] * ad.x);
                tt.y = biased_f(dot[1]) * (d[r][q][1] * ad.y);
#else
                tt.x = (float)(dot[0] - 8 * as.x) * (d[r][q][0] * ad.x);
                tt.y = (float)(dot[1] - 8 * as.y) * (d[r][q][1] * ad.y);
#endif
#endif
                *(float2*)&term[b0] = tt;
            }
        }
    }
#if CTAFOLD
    __syncthreads();
#else
    __syncwarp();
#endif

    // the fold: lane c of the row group adds the terms of (entry, row) c / RPW, c % RPW in block order, the
    // tile's entries and rows side by side
#if PREFETCH && !TWO
    // a down launch walking row blocks: the fold's loop kept rolled, which holds the form at 94 registers
    // against 123 (ptxas, sm_90, tiles of 8; the gate / up form gains nothing from it: 95 either way). The
    // down launch walks where WORDS["cuda_down_iters"] > 1: tiles of 8 and more (1-6% less a layer there)
#pragma unroll 1
#endif
#if CTAFOLD
#pragma unroll 1
    for (int ch = threadIdx.x; ch < WARPS * GROUPS * n_ent * RPW; ch += WARPS * 32) {
        const int c = ch / (WARPS * GROUPS), e = c / RPW, r = c % RPW;
        const int row = blk * ROWS_CTA + ch % (WARPS * GROUPS) * RPW + r;  // its row group's row r
        const float4* t4 = (const float4*)term_f[ch];
#else
    for (int c = g; c < n_ent * RPW; c += G) {
        const int e = c / RPW, r = c % RPW, row = row0 + r;
        const float4* t4 = (const float4*)term_s[warp][grp][c];
#endif
        if (row < n_rows) {
            float acc = 0.0f;
#pragma unroll
            for (int b4 = 0; b4 < (NB + 3) / 4; ++b4) {  // block order: a 16-byte load, its terms in turn
                const float4 v = t4[b4];
                acc = acc + v.x;
                if (4 * b4 + 1 < NB) acc = acc + v.y;
                if (4 * b4 + 2 < NB) acc = acc + v.z;
                if (4 * b4 + 3 < NB) acc = acc + v.w;
            }
            const long long ent = ENTRY_OF(e);
            const int which = TWO && row >= R;
            OUT[(TWO ? (ent * 2 + which) : ent) * R + (row - which * R)] = acc;
        }
    }
#if PREFETCH && CTAFOLD
    __syncthreads();  // every chain folded before any warp writes the next block's terms
#elif PREFETCH
    __syncwarp();  // a safeguard: the next block's unpack syncs the warp before its terms are written
#endif
    }
#undef LOAD_ROWS
#undef ENTRY_OF
#undef ACT_ROW_OF
}
"""


# weight type -> (words a unit, 32-blocks a unit, values a unit): Q4_0 / Q8_0 block pairs
UNITS = {Q4_0: (9, 2, 64), Q8_0: (17, 2, 64)}


@functools.cache  # asked several times a launch on the host (serves, tile cap, grid): integers in, out
def geometry(k: int, wtype: int) -> tuple[int, int, int, int, int] | None:
    """(WPR words a row, NB 32-blocks a row, G lanes a row, WL words a lane loads a row, NPL units (Q4_K and
    Q6_K: quarter super-blocks) a lane) of rows of k values of type wtype, or None where the kernel has no
    form for them: a whole number of units, at most 36 words a lane a row (the registers of RPW rows in
    flight)."""
    if wtype == Q6_K:  # 210-byte super-blocks: an even count makes whole words; 4 quarters of 2 blocks each
        nu = k // 256
        if k % 256 or nu < 2 or nu & (nu - 1):
            return None
        wpr, g = 105 * nu // 2, min(32, 4 * nu)
        wl = -(-wpr // g)
        return (wpr, 8 * nu, g, wl, 4 * nu // g) if wl <= 36 else None
    if wtype == Q4_K:  # 144-byte super-blocks (36 words); 4 quarters of 2 blocks each, one or more a lane
        nu = k // 256
        if k % 256 or nu < 1:
            return None
        g = _lanes(4 * nu)
        return (36 * nu, 8 * nu, g, 36 * nu // g, 4 * nu // g) if 36 * nu // g <= 36 else None
    if wtype not in UNITS:
        return None
    uw, ub, per = UNITS[wtype]
    if k % per:
        return None
    nu = k // per
    g = _lanes(nu)
    return (uw * nu, ub * nu, g, uw * nu // g, nu // g) if uw * nu // g <= 36 else None


def cuda_rows_serves(k: int, bt: int = 1, wtype: int = Q4_0) -> bool:
    """Whether the CUDA form serves rows of k values of type wtype (Q4_0, Q8_0, Q4_K, Q6_K) in tiles of up to
    bt entries: a geometry for them, and the CTA's shared memory within the 48 KiB a kernel may declare
    statically."""
    geo = geometry(k, wtype)
    if geo is None or bt < 1:
        return False
    from .expert_words import WORDS

    return shared_bytes(geo, bt, WORDS["cuda_rpw"], WORDS["cuda_warps"]) <= STATIC_SHARED


def cuda_rows_tile_cap(kinds, bt: int) -> int:
    """The most entries a tile (a power of two, at most bt) for which the CUDA form serves each (k, wtype) of
    kinds that it serves at all (kinds it never serves take the simple tile at any bt and cap nothing)."""
    cap = bt
    for k, wtype in kinds:
        if cuda_rows_serves(k, 1, wtype):
            while cap > 1 and not cuda_rows_serves(k, cap, wtype):
                cap //= 2
    return cap


STATIC_SHARED = 48 << 10  # the most static shared memory a kernel may declare


def shared_bytes(geo: tuple[int, int, int, int, int], bt: int, rpw: int, warps: int, pitch: int = 0) -> int:
    """The kernel's static shared memory for rows of that geometry: stage_s (row groups pitch words apart; 0:
    the least, WPR + 1), term_s, act_s, ad_s and as_s (4-byte elements)."""
    wpr, nb, g = geo[:3]
    stage = -(-warps * (32 // g) * (pitch or wpr + 1) // 4) * 4  # term_s after it starts 16-byte aligned
    terms = warps * (32 // g) * bt * rpw * term_pitch(nb)
    return 4 * (stage + terms + bt * (8 * nb + 2 * nb))


def stage_pitch(wpr: int, g: int) -> int:
    """The words between two row groups' staged rows that keeps a warp's groups (32 / G of them) G banks
    apart: WPR + 1 rounded up to G mod 32 (one group a warp, G = 32: WPR + 1 as it is)."""
    return wpr + 1 if g == 32 else wpr + 1 + (g - (wpr + 1)) % 32


def staged_pitch(geo: tuple[int, int, int, int, int], bt: int, rpw: int, warps: int) -> int:
    """SP, the kernel's pitch: stage_pitch where its shared memory fits, else WPR + 1 (bank conflicts rather
    than no CUDA form: a 768-value Q4_K row's tiles of 4)."""
    wpr, g = geo[0], geo[2]
    pitch = stage_pitch(wpr, g)
    return pitch if shared_bytes(geo, bt, rpw, warps, pitch) <= STATIC_SHARED else wpr + 1


def term_pitch(nb: int) -> int:
    """TP, the floats between two (entry, row) term slots of nb blocks: nb rounded up to a multiple of 4 whose
    quarter is odd, so the fold's 16-byte loads of 8 lanes' slots hit distinct banks."""
    quads = -(-nb // 4)
    return 4 * (quads if quads % 2 else quads + 1)


def _lanes(nu: int) -> int:
    """G: lanes a row, the largest power of two dividing the row's units, at most 32."""
    return min(32, nu & -nu)


def build_options(k: int, two: bool, bt: int, rpw: int, warps: int, wtype: int = Q4_0,
                  prefetch: bool = False, swiglu: bool = False, cta_fold: bool = False,
                  early: bool = False, bias: bool = False) -> tuple[str, ...]:
    """NVRTC's options for that form (scripts/cuda_resources.py compiles the same ones offline); prefetch: a
    row block's successor's words loaded before its arithmetic (the form for CTAs of several blocks);
    swiglu: a down launch that makes its codes from the gate / up rows (SWIGLU); cta_fold: the CTA's chains
    folded by its first threads after a barrier (CTAFOLD), not each warp's by its own lanes; early: a
    one-entry tile's slot and order loaded beside TILE_START, and one activation row read with no lookup
    (EARLY); bias: the terms' integers carried with the int-to-float bias, float() one subtraction (BIAS)."""
    if swiglu and two:
        raise KernelError("the SwiGLU form is a down launch's (one matrix, two=False)")
    geo = geometry(k, wtype)
    wpr, nb, g, wl, npl = geo
    kinds = (f"-DQ4K={int(wtype == Q4_K)}", f"-DQ80={int(wtype == Q8_0)}", f"-DQ6K={int(wtype == Q6_K)}")
    return ("--fmad=false", f"-DWPR={wpr}", f"-DSP={staged_pitch(geo, bt, rpw, warps)}", f"-DNB={nb}",
            f"-DTP={term_pitch(nb)}", f"-DG={g}", f"-DWL={wl}", f"-DNPL={npl}", *kinds, f"-DBT={bt}",
            f"-DRPW={rpw}", f"-DWARPS={warps}", f"-DTWO={int(two)}", f"-DPREFETCH={int(prefetch)}",
            f"-DSWIGLU={int(swiglu)}", f"-DCTAFOLD={int(cta_fold)}", f"-DEARLY={int(early)}",
            f"-DBIAS={int(bias)}",
            # the walking form with the CTA's fold: ptxas gave it 115-125 registers against the per-warp
            # fold's 91-96 (sm_90, RPW 2), held at the CTAs 96 registers allow with no spill there. Only at
            # RPW <= 2: at 4 and 8 rows a group that cap spills 128-1,860 bytes (session 47's review)
            *(nvrtc.min_ctas_option(65536 // (96 * 32 * warps)) if cta_fold and prefetch and rpw <= 2
              else ()))


@functools.cache
def _kernel(k: int, two: bool, bt: int, rpw: int, warps: int, device: int, wtype: int, prefetch: bool,
            swiglu: bool = False, cta_fold: bool = False, early: bool = False, bias: bool = False):
    opts = build_options(k, two, bt, rpw, warps, wtype, prefetch, swiglu, cta_fold, early, bias)
    return nvrtc.build(_SOURCE, "expert_rows", opts, device)


def engine_form(k: int, two: bool, bt: int, wtype: int, prefetch: bool = False, swiglu: bool = False) -> dict:
    """build_options' arguments for the form the engine launches for that shape under WORDS as they are now
    (rows a group, warps, the CTA fold, EARLY, BIAS): what cuda_rows_kernel compiles, and what
    scripts/cuda_resources.py compiles offline."""
    from .expert_words import WORDS

    return dict(k=k, two=two, bt=bt, rpw=WORDS["cuda_rpw"], warps=WORDS["cuda_warps"], wtype=wtype,
                prefetch=prefetch, swiglu=swiglu, cta_fold=bool(WORDS["cuda_cta_fold"]),
                early=rows_early(two), bias=bool(WORDS["cuda_bias"]))


def cuda_rows_kernel(k: int, two: bool, device: int, bt: int = 1, wtype: int = Q4_0, prefetch: bool = False,
                     swiglu: bool = False):
    """The compiled kernel for rows of k values of type wtype in tiles of up to bt entries on CUDA device
    `device` (swiglu: the down form that makes its codes from the gate / up rows), or None where it cannot be
    built (an NVRTC or driver too old for the GPU, say): a Triton tile then, with the same bits, after one
    warning."""
    f = engine_form(k, two, bt, wtype, prefetch, swiglu)
    key = (k, two, bt, f["rpw"], f["warps"], device, wtype, prefetch, swiglu, f["cta_fold"], f["early"],
           f["bias"])
    fallback = ("the SwiGLU kernel between the two launches takes its place (the same bits)" if swiglu
                else "a Triton tile takes their launches (the same bits)")
    return nvrtc.build_or_none(("expert_rows", *key), lambda: _kernel(*key), "expert rows", fallback)


def _launch_form(r: int, k: int, two: bool, bt: int, wtype: int, device: int, swiglu: bool):
    """(the kernel or None, CTAs a tile) of a launch of r rows (2r: two) of k values in tiles of bt."""
    from .expert_words import WORDS

    rows_cta = WORDS["cuda_warps"] * (32 // geometry(k, wtype)[2]) * WORDS["cuda_rpw"]
    n_blocks = -(-(2 * r if two else r) // rows_cta)
    ctas = row_block_ctas(n_blocks, rows_iters(bt, two))
    # the walking form exactly where a CTA gets more than one block: the one-block form covers only
    # grid.x = n_blocks (and keeps its fewer registers where a walk would be one block anyway)
    return cuda_rows_kernel(k, two, device, bt, wtype, prefetch=ctas < n_blocks, swiglu=swiglu), ctas


def cuda_rows_ready(r: int, k: int, two: bool, bt: int, wtype: int, device: int,
                    swiglu: bool = False) -> bool:
    """Whether launch_cuda_rows of that form would launch here: it builds the kernel (once, cached) to
    know."""
    return (cuda_rows_serves(k, bt, wtype)
            and _launch_form(r, k, two, bt, wtype, device, swiglu)[0] is not None)


def launch_cuda_rows(act, act_row, plan, w1, w2, out, r: int, k: int, two: bool, wtype: int = Q4_0,
                     swiglu: bool = False) -> bool:
    """OUT [M, 2, R] (two: gate rows of w1, up rows of w2) or [M, R] (w1's rows), weights of type wtype, over
    the plan's tiles (order, sorted_slot, tile_start, bt: up to bt entries of one slot a tile), on the
    current torch stream; act_row None: each entry's own activation row. swiglu (a down launch): act[0] is
    the gate / up launch's rows f32 [M, 2, k], whose SwiGLU the kernel requantizes itself. False (nothing
    launched) where the kernel cannot be built here."""
    order, sorted_slot, tile_start = plan[:3]
    bt = plan[3] if len(plan) > 3 else 1
    aq, ad, asum = act[:3]
    if not cuda_rows_serves(k, bt, wtype):
        raise KernelError(f"the CUDA expert rows do not serve rows of {k} values of type {wtype} in tiles "
                          f"of {bt} entries")
    if swiglu and (not aq.is_floating_point() or aq.element_size() != 4 or tuple(aq.shape[1:]) != (2, k)
                   or not aq.is_contiguous() or aq.data_ptr() % 16):
        raise KernelError(f"the SwiGLU form reads the gate / up rows as contiguous, 16-byte aligned f32 "
                          f"[M, 2, {k}] (float4 loads), got {aq.dtype} {list(aq.shape)}")
    from .expert_words import WORDS

    dev = nvrtc.device_index(aq)
    warps = WORDS["cuda_warps"]
    kern, ctas = _launch_form(r, k, two, bt, wtype, dev, swiglu)
    if kern is None:
        return False
    grid = (ctas, tile_start.numel())
    if grid[1] > 65535:
        raise KernelError(f"too many entry tiles in one launch ({grid[1]})")
    ptrs = [nvrtc.ptr(aq), nvrtc.ptr(ad), nvrtc.ptr(asum), nvrtc.ptr_or_null(act_row),  # None: own rows
            *(nvrtc.ptr(t) for t in (order, sorted_slot, tile_start, w1, w2))]
    args = (*ptrs, np.int64(w1.stride(0)), np.int64(w2.stride(0)), np.int64(w1.stride(1)),
            np.int64(w2.stride(1)), nvrtc.ptr(out), np.int32(r), np.int32(order.numel()),
            np.int32(aq.shape[0] == 1))  # one activation row: every entry's is row 0 (EARLY reads it so)
    nvrtc.launch(kern, grid, warps * 32, args, dev, pdl=True)
    return True


def rows_iters(bt: int, two: bool = True) -> int:
    """About how many row blocks a CTA walks in a launch of tiles of up to bt entries (two: gate and up rows,
    else down rows): STRATA_ROWS_ITERS for both (config refuses values other than 1-64), else
    expert_words.WORDS["cuda_iters"] / ["cuda_down_iters"] (a number, or a number by bt: the tile size past
    the largest listed takes that one's)."""
    from .expert_words import WORDS

    value = os.environ.get("STRATA_ROWS_ITERS", "")
    if value:
        return int(value)
    iters = WORDS["cuda_iters" if two else "cuda_down_iters"]
    if isinstance(iters, int):
        return iters
    return iters[max((t for t in iters if t <= bt), default=min(iters))]


def rows_early(two: bool = True) -> bool:
    """Whether the kernels of a gate / up launch (two) or a down launch take the EARLY prologue (one-entry
    tiles' slot and order loaded beside TILE_START): STRATA_ROWS_EARLY (0 or 1; config refuses others), else
    expert_words.WORDS["cuda_early"]; a down launch's only where WORDS["cuda_early_down"] too (offline, EARLY
    costs the one-entry SwiGLU down form 8 registers: 48 -> 56, 10 -> 9 CTAs an SM, Q4_0 on sm_90)."""
    from .expert_words import WORDS

    value = os.environ.get("STRATA_ROWS_EARLY", "")
    early = value == "1" if value else bool(WORDS["cuda_early"])
    return early and (two or bool(WORDS["cuda_early_down"]))


def row_block_ctas(n_blocks: int, iters: int) -> int:
    """The CTAs a tile's n_blocks row blocks take when each walks about iters of them: CTA c walks blocks
    c, c + CTAs, ... (ceil(n_blocks / CTAs) or one fewer each), at least one CTA."""
    return max(1, -(-n_blocks // max(1, iters)))


def cuda_rows_on() -> bool:
    """STRATA_WORDS_CUDA, else expert_words.WORDS["cuda"]; off where cupy is not installed (the Triton tile
    then, with the same bits)."""
    from .expert_words import WORDS

    on = os.environ.get("STRATA_WORDS_CUDA", "")  # config refuses values other than 0 / 1
    return (on == "1" if on else bool(WORDS["cuda"])) and nvrtc.has_cupy()


def row_reference(row: np.ndarray, aq: np.ndarray, ad: np.ndarray, asum: np.ndarray) -> np.float32:
    """The kernel's arithmetic for one Q4_0 row, pair by pair in numpy (its plain twin: the same realigned
    words, dp4a operands, block terms and fold). row uint8 [9 NP * 4]; aq int8 [64 NP]; ad f32 / asum int32
    [2 NP]."""
    words = np.ascontiguousarray(row).view(np.uint32).astype(np.int64)
    codes = np.ascontiguousarray(aq).view(np.int32)  # act_s: code word k of block b is codes[8 b + k]
    np_ = len(words) // 9
    terms = np.zeros(2 * np_, np.float32)  # term_s
    for p in range(np_):
        w = words[9 * p: 9 * p + 9]
        first = [(w[k] >> 16) | ((w[k + 1] & 0xFFFF) << 16) for k in range(4)]  # __byte_perm(.., 0x5432)
        for half, quant in enumerate((first, list(w[5:9]))):
            b = 2 * p + half
            dot = 0
            for k in range(4):
                dot += _dp4a(quant[k] & 0x0F0F0F0F, codes[8 * b + k])
                dot += _dp4a((quant[k] >> 4) & 0x0F0F0F0F, codes[8 * b + 4 + k])
            d = np.uint16((w[0] & 0xFFFF) if half == 0 else (w[4] >> 16)).view(np.float16)
            terms[b] = np.float32(dot - 8 * int(asum[b])) * (np.float32(d) * ad[b])
    acc = np.float32(0.0)
    for b in range(2 * np_):
        acc = np.float32(acc + terms[b])
    return acc


def _dp4a(a: int, b: int) -> int:
    """dp4a.s32.s32 without the accumulator: the sum of the products of a's and b's four signed bytes."""
    ab = np.array([a & 0xFFFFFFFF], np.uint32).view(np.int8).astype(np.int64)
    bb = np.array([b], np.int32).view(np.int8).astype(np.int64)
    return int((ab * bb).sum())


def row_reference_q4k(row: np.ndarray, aq: np.ndarray, ad: np.ndarray, asum: np.ndarray) -> np.float32:
    """The kernel's arithmetic for one Q4_K row (Q4K 1), quarter super-block by quarter in numpy (a lane's
    share): the same header words, scale bytes, nibble words, dp4a operands, terms and fold. row uint8
    [144 NU]; aq int8 [256 NU]; ad f32 / asum int32 [8 NU]."""
    words = np.ascontiguousarray(row).view(np.uint32).astype(np.int64)
    codes = np.ascontiguousarray(aq).view(np.int32)  # act_s: code word t of block b is codes[8 b + t]
    nu = len(words) // 36
    terms = np.zeros(8 * nu, np.float32)
    for c in range(4 * nu):
        u, h = divmod(c, 4)
        w = words[36 * u: 36 * u + 36]
        d = np.float32(np.uint16(w[0] & 0xFFFF).view(np.float16))
        dmin = np.float32(np.uint16(w[0] >> 16).view(np.float16))
        for s in range(2):
            j = 2 * h + s
            sh = 8 * (j & 3)
            s_lo, s_mid, s_hi = ((w[i] >> sh) & 0xFF for i in (1, 2, 3))
            sc = s_lo & 63 if j < 4 else (s_hi & 0xF) | ((s_lo >> 6) << 4)
            mn = s_mid & 63 if j < 4 else (s_hi >> 4) | ((s_mid >> 6) << 4)
            b = 8 * u + j
            dot = sum(_dp4a((w[4 + 8 * h + t] >> (4 * s)) & 0x0F0F0F0F, codes[8 * b + t]) for t in range(8))
            t_i = np.float32(dot * sc) * (d * ad[b])
            t_m = np.float32(mn * int(asum[b])) * (dmin * ad[b])
            terms[b] = np.float32(t_i - t_m)
    acc = np.float32(0.0)
    for b in range(8 * nu):
        acc = np.float32(acc + terms[b])
    return acc


def row_reference_q8(row: np.ndarray, aq: np.ndarray, ad: np.ndarray) -> np.float32:
    """The kernel's arithmetic for one Q8_0 row (Q80 1), pair by pair in numpy: the realigned code words,
    dp4a operands, terms and fold. row uint8 [17 NP * 4]; aq int8 [64 NP]; ad f32 [2 NP]."""
    words = np.ascontiguousarray(row).view(np.uint32).astype(np.int64)
    codes = np.ascontiguousarray(aq).view(np.int32)
    np_ = len(words) // 17
    terms = np.zeros(2 * np_, np.float32)
    for p in range(np_):
        w = words[17 * p: 17 * p + 17]
        first = [(w[k] >> 16) | ((w[k + 1] & 0xFFFF) << 16) for k in range(8)]  # __byte_perm(.., 0x5432)
        for half, cw in enumerate((first, list(w[9:17]))):
            b = 2 * p + half
            dot = sum(_dp4a(cw[k], codes[8 * b + k]) for k in range(8))
            d = np.uint16((w[0] & 0xFFFF) if half == 0 else (w[8] >> 16)).view(np.float16)
            terms[b] = np.float32(dot) * (np.float32(d) * ad[b])
    acc = np.float32(0.0)
    for b in range(2 * np_):
        acc = np.float32(acc + terms[b])
    return acc


def row_reference_q6k(row: np.ndarray, aq: np.ndarray, ad: np.ndarray) -> np.float32:
    """The kernel's arithmetic for one Q6_K row (Q6K 1), quarter super-block by quarter in numpy: the same
    code bytes (low 4 bits from ql, high 2 from qh, minus 32), dp4a words, 16-value halves, terms and fold.
    row uint8 [210 NU]; aq int8 [256 NU]; ad f32 [8 NU]."""
    raw = np.ascontiguousarray(row).astype(np.int64)
    codes = np.ascontiguousarray(aq).view(np.int32)
    nu = len(raw) // 210
    terms = np.zeros(8 * nu, np.float32)
    for c in range(4 * nu):
        u, jj = divmod(c, 4)
        sb = raw[210 * u: 210 * u + 210]
        h = jj >> 1
        d = np.float32(np.uint16(sb[208] | (sb[209] << 8)).view(np.float16))
        sc = sb[192 + 4 * jj: 196 + 4 * jj].astype(np.uint8).view(np.int8).astype(np.int64)
        for half in range(2):
            r = 2 * (jj & 1) + half
            b = 8 * u + 2 * jj + half
            ql = sb[64 * h + 32 * (r & 1): 64 * h + 32 * (r & 1) + 32]
            qh = sb[128 + 32 * h: 160 + 32 * h]
            q = ((ql >> (4 * (r >> 1))) & 0xF) | (((qh >> (2 * r)) & 3) << 4)  # [32] codes 0..63
            w = (q - 32).astype(np.int8).view(np.uint8).astype(np.int64)
            words = [int(w[4 * t] | (w[4 * t + 1] << 8) | (w[4 * t + 2] << 16) | (w[4 * t + 3] << 24))
                     for t in range(8)]
            lo = sum(_dp4a(words[t], codes[8 * b + t]) for t in range(4))
            hi = sum(_dp4a(words[4 + t], codes[8 * b + 4 + t]) for t in range(4))
            terms[b] = np.float32(int(sc[2 * half]) * lo + int(sc[2 * half + 1]) * hi) * (d * ad[b])
    acc = np.float32(0.0)
    for b in range(8 * nu):
        acc = np.float32(acc + terms[b])
    return acc
