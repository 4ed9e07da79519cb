"""The prompt expert rows of Q8_0, Q4_0 and Q4_K layers as a CUDA C kernel on the int8 tensor cores (mma.sync
m16n8k32, NVRTC through cupy): the contract's exact block dots by MMA, its fp32 terms and fold in registers.

The Triton prompt tile (`tl.dot` a 32-block, the weight bytes gathered a byte a load) ran at 15-41 int8 TOP/s
on the H200, 1-2% of the int8 peak (session 2): a prompt chunk's expert layer cost ~2.2 ms at 1024 tokens. An
m16n8k32 MMA is exactly one 32-block of 16 entries and 8 rows, so the contract needs nothing of the MMA but
its integers: each thread's four int32 results a block become the contract's terms in registers,

    term = float(I) * (d * ad)                                   (Q8_0; Q4_0 with its codes as q - 8)
    term = float(I * sc) * (d * ad) - float(m * asum) * (dmin * ad)    (Q4_K: I over the unsigned nibbles)

added to the thread's running sums from 0.0 in block order: the very operations of the simple tile and the
CPU, so the rows are theirs to the bit (compiled with --fmad=false; the magic-number int-to-float is exact
below 2^22, which every Q8_0 / Q4_0 / Q4_K block dot is). For Q8_0 and Q4_0 the MMA adds the magic number
itself, through its accumulator input: session 53's ncu had the launches issue bound (74% of issue slots,
the ALU pipe the busiest), and that took four integer adds an MMA off it (ptxas: 2616 -> 2512 instructions
for Q4_0, 2552 -> 2440 for Q8_0; an s8 x u8 MMA for Q4_0's unsigned nibbles, its - 8 folded in too, came
to 2624: the per-entry accumulator inputs cost more moves than the nibbles' adds they saved).

A CTA is a tile of up to BT = 64 entries routed to one expert (plan_tiles' prompt tiles) and BN = 64 rows of
one matrix; 4 warps of 64 entries x 16 rows each (4 x 2 MMA tiles, 32 fp32 sums a thread; MMA["warp_entries"]
32: 32 entries x 32 rows, 2 x 4). The K axis runs in stages of KB 32-blocks, double-buffered in shared memory
by cp.async: the entries' activation codes (16-byte copies), their block scales (and Q4_K's code sums), and
the 64 rows' raw GGUF block bytes (16-byte copies, or 8-byte ones where a stage of 4 Q8_0 / Q4_0 blocks is
136 / 72 bytes), each thread's copies at the same places every stage. Fragments come from the staged bytes:
the entries' code words by one ldmatrix (four 8 x 16-byte matrices: a whole A fragment); a weight row's code
words realigned by __byte_perm where a Q8_0 / Q4_0 block starts two bytes into a word, Q4_0's nibbles made
signed (q - 8) byte-wise, Q4_K's left unsigned. Staged rows are padded to a stride of 4 words mod 8, so the
8 x 4 fragment reads of a warp hit 32 different banks. m16 tiles past the tile's entries are skipped (a
warp-uniform branch).

Session 54 on an H100 (bench_kernels, a 4096-token layer, the MMA launches): each thread's copies laid out
once (~20 instructions a copy before, in divisions and 64-bit products), the tile's entries found by two
ballots (a chain of up to 64 dependent loads before) and the A fragments by ldmatrix took Q4_0 2.06 -> 1.64
ms, Q4_K 3.81 -> 3.15, Q6_K 3.73 -> 2.89; the 64-entry warp tile then 1.47, 2.87, 2.46 (Q8_0 1.67 -> 1.59):
148 int8 TOP/s for Q4_0's layer with every expert kernel, 7.5% of the H100's peak.

The plain twin is the contract itself (reference.py / the CPU kernels): integer sums are exact in any order,
so the only arithmetic of this kernel that could differ is the fp32 epilogue, and that is the contract's
step by step. tests/kernels/test_expert_mma_cuda.py compares its rows with the CPU's bit for bit.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import numpy as np

from . import nvrtc
from .contract import Q4_0, Q4_K, Q6_K, Q8_0, KernelError
from .contract_c import HALF_SOURCE, I2F_SOURCE

_SOURCE = I2F_SOURCE + HALF_SOURCE + r"""

__device__ __forceinline__ void cp16(void* dst, const void* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(d), "l"(src));
}

__device__ __forceinline__ void cp8(void* dst, const void* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(d), "l"(src));
}

__device__ __forceinline__ void cp4(void* dst, const void* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(d), "l"(src));
}

// the k = 16 MMA: Q6_K's two 16-value halves of a block have scales of their own
__device__ __forceinline__ void mma_s8_k16(int c[4], unsigned a0, unsigned a1, unsigned b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%7, %7, %7, %7};\n"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3]) : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

// Q6_K codes of 4 elements: low 4 bits from a ql word (nibble r / 2), high 2 from a qh word (bits 2 r), then
// q - 32 as signed bytes (+ 0x60 then flip the sign bit: no carry, the codes are below 64)
__device__ __forceinline__ unsigned q6_codes(unsigned ql, unsigned qh, int r) {
    const unsigned code = ((ql >> (4 * (r >> 1))) & 0x0F0F0F0Fu) | (((qh >> (2 * r)) & 0x03030303u) << 4);
    return (code + 0x60606060u) ^ 0x80808080u;
}

// c = a b + z, z the accumulator input of every element (0, or I2F_BIAS for biased_f: contract_c)
__device__ __forceinline__ void mma_s8(int c[4], const unsigned a[4], const unsigned b[2], int z) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};\n"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(z));
}

// An entry tile's A fragment of a 32-block (16 entries x 32 codes) from its shared-window address by one
// ldmatrix of four 8 x 16-byte matrices, where four 4-byte shared loads a thread took four issues: lane l
// gives the row of matrix l / 8, entries 0-7 / 8-15 (lane & 15) at bytes 0 / 16 (lane >> 4), so a[0] = entry
// gid's codes 4 tig.., a[1] entry gid + 8's, a[2] and a[3] the same at 16 + 4 tig (the m16n8k32 A layout).
// Staged rows at a stride of 4 words mod 8 put each 8-row phase on 32 different banks
__device__ __forceinline__ void a_frag(unsigned a[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}

// The word of 4 bytes at byte offset off (even) of a 4-byte aligned shared row
__device__ __forceinline__ unsigned word_at(const unsigned char* row, int off) {
    const unsigned* w = (const unsigned*)(row + (off & ~3));
    return (off & 2) ? __byte_perm(w[0], w[1], 0x5432) : w[0];
}

// Q4_0 nibbles (0..15, one a byte) -> the signed codes q - 8 byte-wise: + 0x78 then flip the sign bit
__device__ __forceinline__ unsigned signed_nibbles(unsigned n) {
    return (n + 0x78787878u) ^ 0x80808080u;
}

// NB 32-blocks a row; KB a stage (NB % KB == 0); BB bytes a 32-block of the weights (Q4_K: 18, a 144-byte
// super-block over 8 blocks; Q6_K: unused); STAGE bytes of a row copied a stage, CPB bytes a copy (16, 8 or
// 4); AST / WST bytes a staged activation / weight row (padded); TWO: gate rows of W1 then up rows of W2 into
// OUT [M, 2, R], else W1's R rows into OUT [M, R].
#define BT 64
#define BN 64
// a warp's tile: MI m16 tiles of entries by NI n8 tiles of rows (EM x RN), four warps a CTA's BT x BN
#define EM (16 * MI)
#define RN (8 * NI)
#define WARPS_N (BN / RN)
static_assert((BT / EM) * WARPS_N == 4, "four warps cover the CTA's tile");
static_assert(BT == 64, "a tile's entries are found by two warps' ballots");
#define NSTAGE (NB / KB)
// FULL_TILES (MMA["full_tiles"]): a full tile's MMAs a form of their own (see compute), with the A
// fragments' shared-window address made once a CTA (a_addr); Q4_0 / Q8_0 only: a_addr alone took Q6_K's
// down form from 122 registers to 168 with a spill (ptxas, sm_90)
#define FULL (FULL_TILES && !Q4K && !Q6K)
#define A_BYTES (BT * AST)
#define W_BYTES (BN * WST)
#define S_BYTES (A_BYTES + W_BYTES + 2 * BT * KB * 4)   // + the entries' block scales and code sums

// MIN_CTAS (STRATA_MMA_KQUANT_CTAS, K-quants only): CTAs an SM the registers are capped for; unset, the
// compiler's choice (scripts/cuda_resources.py: at the 32-entry warp tile Q6_K takes 174 registers, 2 CTAs an
// SM; at the 64-entry tile the K-quants take 128-140 under the cap or not, 3 CTAs by shared memory)
#ifdef MIN_CTAS
#define MMA_BOUNDS __launch_bounds__(128, MIN_CTAS)
#else
#define MMA_BOUNDS __launch_bounds__(128)
#endif

extern "C" __global__ void MMA_BOUNDS expert_mma(
    const signed char* __restrict__ AQ, const float* __restrict__ AD, const int* __restrict__ AS,
    const int* __restrict__ ACT_ROW, const int* __restrict__ ORDER, const int* __restrict__ SORTED_SLOT,
    const int* __restrict__ TILE_START, const unsigned char* __restrict__ W1,
    const unsigned char* __restrict__ W2, long long stride1, long long stride2, long long rb1, long long rb2,
    float* __restrict__ OUT, int R, int M)
{
    extern __shared__ __align__(16) unsigned char smem[];  // [2 stages][A | W | ad | as]
    __shared__ int arow_s[BT];                     // each entry's activation row
    __shared__ const signed char* arow_p[BT];      // and its codes
    __shared__ unsigned stop_s[BT / 32];           // the tile's entries: ballots of "not this slot's"
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int start = TILE_START[blockIdx.y];
    if (start < 0) return;
    const int K = 32 * NB;
    // the tile is the run of entries from start in the slot of its first (at most BT): thread t < BT looks at
    // entry start + t (its slot, order and activation row loaded at once), and the first that is past M or
    // of another slot ends it. A loop from start took one dependent load an entry (64 in a row for a full
    // tile, each behind the last's compare: ~1.4 us before a CTA's first copy)
    const int slot_id = SORTED_SLOT[start];
    bool stop = true;
    if (tid < BT && start + tid < M) {  // a null ACT_ROW: each entry's own row (the down launch's h rows)
        const int sl = SORTED_SLOT[start + tid], o = ORDER[start + tid];
        const int ar = ACT_ROW ? ACT_ROW[o] : o;
        arow_s[tid] = ar;
        arow_p[tid] = AQ + (long long)ar * K;
        stop = sl != slot_id;
    }
    const unsigned stops_w = __ballot_sync(0xFFFFFFFFu, stop);
    if (tid < BT && lane == 0) stop_s[warp] = stops_w;
    __syncthreads();
    const unsigned long long stops = ((unsigned long long)stop_s[1] << 32) | stop_s[0];
    const int n_ent = stops ? __ffsll((long long)stops) - 1 : BT;  // entry 0 is the slot's: n_ent >= 1
    const int gid = lane >> 2, tig = lane & 3;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;  // the warp's EM entries and RN rows of the tile

    // the CTA's 64 rows, all of one matrix (R % 64 == 0)
    const int row0 = blockIdx.x * BN;
    const int which = TWO && row0 >= R;
    const int rr0 = row0 - which * R;
    const unsigned char* wbase = which ? W2 + slot_id * stride2 + (long long)rr0 * rb2
                                       : W1 + slot_id * stride1 + (long long)rr0 * rb1;
    const long long rb = which ? rb2 : rb1;

    // Each thread's copies of a stage sit at the same places every stage, so they are laid out once: thread
    // tid copies piece ca of entries ea + EPI it (the codes), piece cw of rows nw + RPI it (the weights, LPR
    // lanes a row of which C_W copy), each copy's addresses an immediate or one add from the last (the loops
    // over i / pieces before spent ~20 instructions a copy on divisions and 64-bit products: ~6 an MMA)
    constexpr int C_A = KB * 2;        // 16-byte pieces of an entry's codes a stage (8 or 16)
    constexpr int EPI = 128 / C_A;     // entries a pass
    constexpr int C_W = STAGE / CPB;   // CPB-byte pieces of a row's stage (9, 17 or 53)
    constexpr int LPR = C_W <= 16 ? 16 : C_W <= 32 ? 32 : 64;  // lanes a row
    constexpr int RPI = 128 / LPR;     // rows a pass
    const int ca = tid % C_A, ea = tid / C_A;
    const int cw = tid % LPR, nw = tid / LPR;
    const unsigned char* const w_src = wbase + nw * rb + CPB * cw;
    const long long w_step = RPI * rb;

    // stage s of the K axis into buffer buf: blocks s KB .. s KB + KB - 1
    auto load_stage = [&](int s, int buf) {
        unsigned char* base = smem + buf * S_BYTES;
#pragma unroll
        for (int it = 0; it < BT / EPI; ++it) {
            const int e = ea + EPI * it;
            if (e < n_ent) cp16(base + e * AST + 16 * ca, arow_p[e] + s * KB * 32 + 16 * ca);
        }
        constexpr int C_S = KB / 4;  // 16-byte pieces of an entry's block scales (and sums) a stage
        float* ad_s = (float*)(base + A_BYTES + W_BYTES);
        int* as_s = (int*)(ad_s + BT * KB);
        if (tid < n_ent * C_S) {  // BT C_S <= 128: one piece a thread at most
            const int e = tid / C_S, c = tid % C_S;
            const long long o = (long long)arow_s[e] * NB + s * KB + 4 * c;
            cp16(ad_s + e * KB + 4 * c, AD + o);
#if Q4K
            cp16(as_s + e * KB + 4 * c, AS + o);
#endif
        }
#if Q6K
        // super-block s sits at byte 210 s of the row: copied from the word at or below it (STAGE = 212
        // bytes; an even stage's 2 extra bytes are the next super-block's, inside the row: rows hold an even
        // count)
        const long long w_off = (210LL * s) & ~3LL;
#else
        const long long w_off = (long long)s * KB * BB;
#endif
        // CPB-byte pieces of a row's stage (16; 8 where a stage of 4 Q8_0 / Q4_0 blocks is 136 / 72 bytes; 4
        // for Q6_K's 2-byte aligned super-blocks)
        if (cw < C_W) {
            unsigned char* dst = base + A_BYTES + nw * WST + CPB * cw;
            const unsigned char* src = w_src + w_off;
#pragma unroll
            for (int it = 0; it < BN / RPI; ++it) {
                if (CPB == 16) cp16(dst, src); else if (CPB == 8) cp8(dst, src); else cp4(dst, src);
                dst += RPI * WST;
                src += w_step;
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[mi][ni][v] = 0.0f;

    // FULL: the lane's ldmatrix row of the warp's first m16 tile in stage buffer 0 as a shared-window
    // address, the loop adding constants to it (a generic pointer converted every stage: ~30 instructions)
#if FULL
    const unsigned a_addr = (unsigned)__cvta_generic_to_shared(smem) + (EM * wm + (lane & 15)) * AST
                            + 16 * (lane >> 4);
#endif
    load_stage(0, 0);
    for (int s = 0; s < NSTAGE; ++s) {
        if (s + 1 < NSTAGE) {
            load_stage(s + 1, (s + 1) & 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        const unsigned char* base = smem + (s & 1) * S_BYTES;
        const unsigned char* w_s = base + A_BYTES;
        const float* ad_s = (const float*)(base + A_BYTES + W_BYTES);
        const int* as_s = (const int*)(ad_s + BT * KB);
        const int sh = Q6K ? (210 * s) & 3 : 0;  // the super-block's first byte in its staged row (0 or 2)
        // a stage's MMAs: full (every m16 tile of the warp's holds entries: no check a tile, ~10% fewer
        // instructions a stage) or not, each call a form of its own once the lambda is inlined. Q4_0 / Q8_0
        // only (FULL): with both forms the K-quants take 168 registers, Q6_K's down form spilling 112 bytes.
        // Session 55 ran the bits of FULL_TILES 1 (18 GPU tests); its time is not measured yet, so it is off
        auto compute = [&](const bool full) {
#pragma unroll
            for (int j = 0; j < KB; ++j) {
                // B fragments: row RN wn + 8 ni + gid's codes k = 4 tig.. (b0) and 16 + 4 tig.. (b1); the
                // epilogue's scales are those of rows RN wn + 8 ni + 2 tig, + 1 (the C fragment's columns)
                unsigned b[NI][2];
                float wd[NI][2];
#if Q4K
                float wm_[NI][2];
                int sc[NI][2], mn[NI][2];
#elif Q6K
                int sc[NI][2][2];  // the scales of the block's two halves, a row
#endif
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) {
                    const unsigned char* wr = w_s + (RN * wn + 8 * ni + gid) * WST;
#if Q80
                    b[ni][0] = word_at(wr, 34 * j + 2 + 4 * tig);
                    b[ni][1] = word_at(wr, 34 * j + 18 + 4 * tig);
#elif Q4K
                    const unsigned q = *(const unsigned*)(wr + 16 + 32 * (j >> 1) + 4 * tig);
                    const unsigned q2 = *(const unsigned*)(wr + 32 + 32 * (j >> 1) + 4 * tig);
                    b[ni][0] = (q >> (4 * (j & 1))) & 0x0F0F0F0Fu;
                    b[ni][1] = (q2 >> (4 * (j & 1))) & 0x0F0F0F0Fu;
#elif Q6K
                    // block j = 4 h + r: ql bytes 64 h + 32 (r % 2).., qh bytes 128 + 32 h..
                    const int h6 = j >> 2, r6 = j & 3, lo6 = sh + 64 * h6 + 32 * (r6 & 1) + 4 * tig;
                    const int hi6 = sh + 128 + 32 * h6 + 4 * tig;
                    b[ni][0] = q6_codes(word_at(wr, lo6), word_at(wr, hi6), r6);
                    b[ni][1] = q6_codes(word_at(wr, lo6 + 16), word_at(wr, hi6 + 16), r6);
#else
                    const unsigned q = word_at(wr, 18 * j + 2 + 4 * tig);
                    b[ni][0] = signed_nibbles(q & 0x0F0F0F0Fu);
                    b[ni][1] = signed_nibbles((q >> 4) & 0x0F0F0F0Fu);
#endif
#pragma unroll
                    for (int v = 0; v < 2; ++v) {
                        const unsigned char* sr = w_s + (RN * wn + 8 * ni + 2 * tig + v) * WST;
#if Q4K
                        const unsigned* hw = (const unsigned*)sr;  // d dmin, then the 12 scale bytes
                        wd[ni][v] = half_bits(hw[0] & 0xFFFFu);
                        wm_[ni][v] = half_bits(hw[0] >> 16);
                        const int sh = 8 * (j & 3);
                        const unsigned s_lo = (hw[1] >> sh) & 0xFFu, s_mid = (hw[2] >> sh) & 0xFFu;
                        const unsigned s_hi = (hw[3] >> sh) & 0xFFu;
                        sc[ni][v] = j < 4 ? s_lo & 63 : (s_hi & 0xF) | ((s_lo >> 6) << 4);
                        mn[ni][v] = j < 4 ? s_mid & 63 : (s_hi >> 4) | ((s_mid >> 6) << 4);
#elif Q6K
                        // sc[2 j], sc[2 j + 1]
                        const unsigned s2 = *(const unsigned short*)(sr + sh + 192 + 2 * j);
                        sc[ni][v][0] = (int)(signed char)(s2 & 0xFFu);
                        sc[ni][v][1] = (int)(signed char)(s2 >> 8);
                        wd[ni][v] = half_bits(*(const unsigned short*)(sr + sh + 208));
#else
                        wd[ni][v] = half_bits(*(const unsigned short*)(sr + BB * j));
#endif
                    }
                }
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    if (!full && mi > 0 && EM * wm + 16 * mi >= n_ent) break;
                    const int e0 = EM * wm + 16 * mi + gid;  // C rows e0 (v 0, 1) and e0 + 8 (v 2, 3)
                    unsigned a[4];
#if FULL
                    a_frag(a, a_addr + (s & 1) * S_BYTES + 16 * mi * AST + 32 * j);
#else
                    const unsigned char* a_row = base + (EM * wm + 16 * mi + (lane & 15)) * AST;
                    a_frag(a, (unsigned)__cvta_generic_to_shared(a_row + 32 * j + 16 * (lane >> 4)));
#endif
                    const float ad[2] = {ad_s[e0 * KB + j], ad_s[(e0 + 8) * KB + j]};
#if Q4K
                    const int asum[2] = {as_s[e0 * KB + j], as_s[(e0 + 8) * KB + j]};
#endif
#pragma unroll
                    for (int ni = 0; ni < NI; ++ni) {
                        int c[4];
#if Q6K
                        int c_hi[4];
                        mma_s8_k16(c, a[0], a[1], b[ni][0]);     // elements 0..15
                        mma_s8_k16(c_hi, a[2], a[3], b[ni][1]);  // elements 16..31
#elif Q4K
                        mma_s8(c, a, b[ni], 0);
#else
                        mma_s8(c, a, b[ni], I2F_BIAS);  // c = the block dot + I2F_BIAS
#endif
#pragma unroll
                        for (int v = 0; v < 4; ++v) {
                            const int h = v >> 1, col = v & 1;
#if Q6K
                            // |I| < 2^24: the plain conversion (exact), as the contract's Q6_K term
                            const int isum = sc[ni][col][0] * c[v] + sc[ni][col][1] * c_hi[v];
                            acc[mi][ni][v] = acc[mi][ni][v] + (float)isum * (wd[ni][col] * ad[h]);
#elif Q4K
                            const float t1 = i2f(c[v] * sc[ni][col]) * (wd[ni][col] * ad[h]);
                            const float t2 = i2f(mn[ni][col] * asum[h]) * (wm_[ni][col] * ad[h]);
                            acc[mi][ni][v] = acc[mi][ni][v] + (t1 - t2);
#else
                            acc[mi][ni][v] = acc[mi][ni][v] + biased_f(c[v]) * (wd[ni][col] * ad[h]);
#endif
                        }
                    }
                }
            }
        };
        if (FULL && EM * wm + EM <= n_ent) {
            compute(true);
        } else if (EM * wm < n_ent) {  // the warp has entries (m16 tiles past the tile's are skipped)
            compute(false);
        }
        __syncthreads();  // the buffer is the stage after next's
    }

    // rows RN wn + 8 ni + 2 tig, + 1 of entries e0, e0 + 8: two consecutive floats
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int e = EM * wm + 16 * mi + gid + 8 * h;
            if (e >= n_ent) continue;
            const long long ent = ORDER[start + e];
            float* orow = OUT + (TWO ? (ent * 2 + which) : ent) * R + rr0;
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                const int n = RN * wn + 8 * ni + 2 * tig;
                *(float2*)(orow + n) = make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
            }
        }
    }
}
"""

BT = 64  # entries a tile (the prompt tiles of expert_gpu.tile_entries)
BN = 64  # rows a CTA
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_K: 18}  # bytes a 32-block (Q4_K: its super-block's 144 over 8)
Q6_STAGE = 212  # bytes of a row copied a Q6_K stage: a 210-byte super-block from the word at or below it
# on: STRATA_PROMPT_MMA overrides (config refuses values other than 0 / 1). stage_blocks: 32-blocks a stage by
# type (bits do not depend on it; Q4_K and Q6_K stage whole super-blocks: 8); fewer make a smaller CTA
# (shared memory: two stages), so more of them fit an SM (session 18: Q8_0 870 -> 700 us with 4, Q4_0 713 ->
# 674).
# warp_entries: a warp's tile, 32 entries x 32 rows (2 x 4 MMA tiles) or 64 x 16 (4 x 2: each weight fragment
# and its scales made once for the tile's 64 entries rather than by two warps; the activation fragments twice
# as often; 92-96 registers for Q4_0 / Q8_0, 5 CTAs an SM, against 107-128; the K-quants 128-140 against 168
# with spills). Session 54 on an H100 (bench_kernels, 4096 tokens x top-10 over 256 experts, the MMA launches
# of a layer, 32 -> 64, the same bits): Q4_0 1.64 -> 1.47 ms, Q8_0 1.67 -> 1.59, Q4_K 3.15 -> 2.87, Q6_K 2.89
# -> 2.46. The bits do not depend on it.
# full_tiles (STRATA_MMA_FULL_TILES over it): a warp whose m16 tiles all hold entries runs a stage's MMAs
# with no check a tile (Q4_0 / Q8_0; the K-quants' registers would not hold both forms), and the A fragments'
# shared addresses are made once a CTA: offline (ptxas, sm_90) ~11% fewer instructions a stage, at 125-128
# registers (4 CTAs an SM) against 91-95 (5). Session 55: the same bits (the MMA GPU bit tests). Session 58 on
# an H100 (bench_kernels --mma-full-tiles 0,1,0,1, 4096 tokens x top-10 over 256 experts, ms a layer): Q4_0
# 1.76 / 1.72 / 1.75 / 1.70, Q8_0 1.88 / 1.79 / 1.87 / 1.77: on, 2-3% and 5% faster in both pairs
MMA = dict(on=True, stage_blocks={Q8_0: 4, Q4_0: 4, Q4_K: 8, Q6_K: 8}, warp_entries=64, full_tiles=True)
WARP_TILES = {32: (2, 4), 64: (4, 2)}  # warp_entries -> (MI, NI): m16 tiles of entries, n8 tiles of rows


class Geometry(NamedTuple):
    nb: int  # 32-blocks a row
    kb: int  # 32-blocks a stage
    bb: int  # bytes a 32-block (Q6_K: 0, its stages are whole super-blocks)
    stage: int  # bytes of a row copied a stage
    cpb: int  # bytes a copy (16, 8 or 4): the weights' rows and slots must be aligned to it
    ast: int  # bytes a staged activation row (padded)
    wst: int  # bytes a staged weight row (padded)


def _padded(n: int) -> int:
    """A staged row's bytes: n rounded up to 16 bytes, then to a stride of 4, 12, 20 or 28 words mod 32 banks,
    so a warp's fragment reads (8 rows x 4 words) fall on 32 different banks."""
    s = -(-n // 16) * 16
    while (s // 4) % 8 != 4:
        s += 16
    return s


def geometry(k: int, wtype: int) -> Geometry | None:
    """The kernel's geometry for rows of k values of type wtype at MMA["stage_blocks"], or None where it has
    no form for them."""
    return _geometry(k, wtype, MMA["stage_blocks"].get(wtype, 0))


@functools.cache
def _geometry(k: int, wtype: int, kb: int) -> Geometry | None:
    if k % 32:
        return None
    nb = k // 32
    if wtype == Q6_K:  # whole super-blocks a stage, an even count a row (no copy reads past a row)
        if kb != 8 or nb % 16:
            return None
        return Geometry(nb, 8, 0, Q6_STAGE, 4, _padded(256), _padded(Q6_STAGE))
    if wtype not in BLOCK_BYTES or kb not in (4, 8) or (wtype == Q4_K and kb != 8) or nb % kb:
        return None
    bb = BLOCK_BYTES[wtype]
    stage = bb * kb
    return Geometry(nb, kb, bb, stage, 16 if stage % 16 == 0 else 8, _padded(32 * kb), _padded(stage))


def shared_bytes(geo: Geometry) -> int:
    """Dynamic shared memory of a CTA: two stages of activations, weights, block scales and sums."""
    return 2 * (BT * geo.ast + BN * geo.wst + 2 * BT * geo.kb * 4)


def mma_on() -> bool:
    """STRATA_PROMPT_MMA, else MMA["on"]; off where cupy is not installed (the Triton prompt tile then)."""
    on = os.environ.get("STRATA_PROMPT_MMA", "")
    return (on == "1" if on else bool(MMA["on"])) and nvrtc.has_cupy()


def mma_serves(k: int, r: int, wtype: int, bt: int) -> bool:
    """Whether the kernel takes a prompt launch: its types, rows of k values it stages whole, R rows a matrix
    in whole CTAs, tiles of at most BT entries."""
    return geometry(k, wtype) is not None and r % BN == 0 and 1 <= bt <= BT


def build_options(geo: Geometry, two: bool, wtype: int, min_ctas: int = 1,
                  warp_entries: int | None = None) -> tuple[str, ...]:
    """NVRTC's options for that form (scripts/cuda_resources.py compiles the same ones offline); min_ctas > 1:
    registers capped so that many CTAs fit an SM (only where asked: the default code is the compiler's);
    warp_entries None: MMA's."""
    return ("--fmad=false", *defines(geo, two, wtype, warp_entries), *nvrtc.min_ctas_option(min_ctas))


KQUANT_CTAS = 3  # the K-quant forms' CTAs an SM where STRATA_MMA_KQUANT_CTAS is unset (see min_ctas)


def min_ctas(wtype: int, kquant_ctas: int | None = None) -> int:
    """kquant_ctas where given, else STRATA_MMA_KQUANT_CTAS (1-4; 1: the compiler's choice; default
    KQUANT_CTAS), for Q4_K / Q6_K; 1 for the other types.
    Left to the compiler, the K-quant forms take 244-255 registers, so an SM holds 2 of their CTAs (8 warps)
    against 4 for Q4_0 / Q8_0 (128 registers). 3 caps them at 168 registers with 4-12 bytes of spills (ptxas,
    session 31; 4 spills ~470 bytes and shared memory allows 3 anyway): on an H100 at 4096 tokens over 256
    experts that took Q4_K 4.10 -> 3.78-3.81 ms a layer and Q6_K 4.10-4.11 -> 3.71-3.73 (session 53,
    interleaved). Since session 54's copies the 32-entry tile's Q4_K takes 168 uncapped and Q6_K 174; the
    64-entry tile (the default) 128-140 with or without the cap, 3 CTAs an SM by shared memory, so the cap
    is the measured form's and no longer what bounds it. The bits do not depend on it (register allocation
    only)."""
    if wtype not in (Q4_K, Q6_K):
        return 1
    if kquant_ctas is not None:
        return kquant_ctas
    raw = os.environ.get("STRATA_MMA_KQUANT_CTAS", "")
    return int(raw) if raw else KQUANT_CTAS


def full_tiles() -> bool:
    """STRATA_MMA_FULL_TILES (0 / 1), else MMA["full_tiles"]."""
    raw = os.environ.get("STRATA_MMA_FULL_TILES", "")
    return raw == "1" if raw else bool(MMA["full_tiles"])


def defines(geo: Geometry, two: bool, wtype: int, warp_entries: int | None = None) -> tuple[str, ...]:
    """The kernel's -D options for that geometry, type and warp tile (warp_entries None: MMA's), the full
    tiles' form as full_tiles() says."""
    we = MMA["warp_entries"] if warp_entries is None else warp_entries
    if we not in WARP_TILES:
        raise KernelError(f"MMA warp_entries must be one of {sorted(WARP_TILES)}, not {we}")
    mi, ni = WARP_TILES[we]
    return (f"-DNB={geo.nb}", f"-DKB={geo.kb}", f"-DBB={geo.bb}", f"-DSTAGE={geo.stage}", f"-DCPB={geo.cpb}",
            f"-DAST={geo.ast}", f"-DWST={geo.wst}", f"-DTWO={int(two)}", f"-DQ80={int(wtype == Q8_0)}",
            f"-DQ4K={int(wtype == Q4_K)}", f"-DQ6K={int(wtype == Q6_K)}", f"-DFULL_TILES={int(full_tiles())}",
            f"-DMI={mi}", f"-DNI={ni}")


@functools.cache
def _kernel(k: int, two: bool, device: int, wtype: int, kb: int, ctas: int = 1, warp_entries: int = 32,
            full: bool = False):  # full: full_tiles() at the call, a key only (build_options reads it)
    geo = _geometry(k, wtype, kb)
    kern = nvrtc.build(_SOURCE, "expert_mma", build_options(geo, two, wtype, ctas, warp_entries), device)
    import cupy

    with cupy.cuda.Device(device):
        kern.max_dynamic_shared_size_bytes = shared_bytes(geo)
    return kern


def engine_options(k: int, two: bool, wtype: int, kquant_ctas: int | None = None,
                   warp_entries: int | None = None) -> tuple[str, ...]:
    """NVRTC's options for the form the engine launches for that shape (MMA's stage and warp tile,
    min_ctas' cap), or with the K-quants' cap (kquant_ctas) or the warp tile given: what
    scripts/cuda_resources.py compiles offline."""
    return build_options(geometry(k, wtype), two, wtype, min_ctas(wtype, kquant_ctas), warp_entries)


def mma_kernel(k: int, two: bool, device: int, wtype: int):
    """The compiled kernel, or None where it cannot be built here (the Triton prompt tile then, same bits)."""
    key = (k, two, device, wtype, geometry(k, wtype).kb, min_ctas(wtype), MMA["warp_entries"], full_tiles())
    return nvrtc.build_or_none(("expert_mma", *key), lambda: _kernel(*key), "prompt expert rows",
                               "the Triton prompt tile takes their launches (the same bits)")


def _aligned(align: int, *tensors) -> bool:
    """Copies of `align` bytes need aligned bases and strides (the slots' rows, the activation rows)."""
    for t in tensors:
        if t.data_ptr() % align or any((s * t.element_size()) % align for s in t.stride()[:-1]):
            return False
    return True


def launch_mma_rows(act, act_row, plan, w1, w2, out, r: int, k: int, two: bool, wtype: int) -> bool:
    """OUT [M, 2, R] (two: gate rows of w1, up rows of w2) or [M, R] (w1's rows) over the plan's prompt
    tiles (order, sorted_slot, tile_start, bt) on the current torch stream; act_row None: each entry's own
    activation row. False (nothing launched) where the kernel cannot take the launch or cannot be built
    here."""
    order, sorted_slot, tile_start, bt = plan[:4]
    aq, ad, asum = act[:3]
    if not mma_serves(k, r, wtype, bt):
        raise KernelError(f"the MMA prompt rows do not serve rows of {k} values of type {wtype} ({r} a "
                          f"matrix, tiles of {bt})")
    geo = geometry(k, wtype)
    if not (_aligned(16, aq, ad, asum) and _aligned(geo.cpb, w1, w2)):
        return False
    dev = nvrtc.device_index(aq)
    kern = mma_kernel(k, two, dev, wtype)
    if kern is None:
        return False
    n_rows = 2 * r if two else r
    grid = (n_rows // BN, tile_start.numel())
    if grid[1] > 65535:
        raise KernelError(f"too many entry tiles in one launch ({grid[1]})")
    ptrs = [nvrtc.ptr(aq), nvrtc.ptr(ad), nvrtc.ptr(asum), nvrtc.ptr_or_null(act_row),  # None: own rows
            *(nvrtc.ptr(t) for t in (order, sorted_slot, tile_start, w1, w2))]
    args = (*ptrs, np.int64(w1.stride(0)), np.int64(w2.stride(0)), np.int64(w1.stride(1)),
            np.int64(w2.stride(1)), nvrtc.ptr(out), np.int32(r), np.int32(order.numel()))
    nvrtc.launch(kern, grid, 128, args, dev, shared_mem=shared_bytes(geo))
    return True
