"""The dense Q8_0 GEMV as a CUDA C kernel (NVRTC through cupy; STRATA_DENSE_CUDA): a decode token's
projections, ~2 GB of Q8_0 rows a token for the 80B-A3B.

The Triton GEMV (dense_q8._gemv_body) reads 35-49% of the H200's copy rate on the 80B's projections at one
token (76% on the LM head): short programs that load, wait, reduce and exit, with no say in which thread holds
which value. A first CUDA form of the same shape (a CTA's rows loaded, then computed) ran no faster
(session 14: latency- and instruction-bound under ncu). What helped is the schedule below: one wave of CTAs,
each warp walking its rows with the next rows' loads in flight (12352 x 2048: 13.0 -> 10.9 us, the LM head
103.7 -> 87.9 us, 89% of the copy rate). A row belongs to a warp and its codes to the lanes by 16-byte chunks
(half blocks), the same map for every row of a width K:

    lane l, chunk c = l + 32 j (j < CH = ceil(K / 512)): codes c*16 .. c*16+15, scale d[c / 2]
    per chunk:   s = fma(q[15], x[15], ... fma(q[1], x[1], q[0] * x[0]))  (codes to floats exactly:
                 0x4B0000xx - 2^23 - 128, a byte permute and a subtraction)
    per lane:    acc = fma(s_j, d_j, acc) over j in order
    per row:     acc summed over the warp by a butterfly (xor 16, 8, 4, 2, 1): every lane the same sum

The grid is one wave of CTAs (as many as the SMs hold). Each warp takes a contiguous run of row groups (RPW
rows, balanced across the warps to within one) and issues the next group's loads before the current group's
arithmetic; the CTA stages its tokens' activations in shared memory once (swizzled: a warp's float4 reads
hit every bank once) while the first loads come. Each row's chunks are applied to every token of the CTA
(TT, compiled in): a verify window reads the weights once for TT tokens.
A token's value depends on K alone (the lane map, the chunk and lane order), never on N, RPW, the warps or
how many tokens share the launch: the GEMV stays batch invariant (DESIGN section 7), and `gemv_reference`,
the kernel's twin in numpy (float32 fma emulated exactly), gives its bits.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from . import nvrtc
from .contract_c import HALF_SOURCE

CHUNK = 16  # codes a lane loads at once (16 bytes)
WARPS = 8  # warps a CTA
TT_MAX = 4  # tokens a CTA applies each row to (a verify window of 16 runs as 4 token groups)
X_SMEM_BYTES = 48 << 10  # activations staged a CTA: the default dynamic shared memory limit
LOADS_A_GROUP = 4  # 16-byte loads a lane a row group (RPW * CH); the next group's go before the arithmetic

_SOURCE = nvrtc.PDL_HOOKS + HALF_SOURCE + r"""
// 16 bytes read once: not kept in L1, and L2 told to fetch 256 bytes (the row's next chunks)
__device__ __forceinline__ uint4 load_stream(const signed char* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// byte k of a word of int8 codes -> float, exact: (q + 128) placed in the low byte of 2^23's float bits
__device__ __forceinline__ float code(unsigned biased, int k) {
    return __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7540 | k)) - 8388736.0f;
}

// K values a row; C16 = K / 16 chunks, CH chunks a lane, RPW rows a row group, WARPS warps, TT tokens a CTA
#define C16 (K / 16)
#define KB (K / 32)
#define FULL (C16 % 32 == 0)

// SCALED 1: a float32 scale a 16-code chunk (S [N, C16]; dense_scaled's exact Q4_K / Q6_K form) instead
// of a float16 one a block (D [N, KB]); OFFSET 1: and a float32 offset a chunk (B [N, C16]) subtracted
// from each of its values (Q4_K's mins): its share of a row, b * (the chunk's sum of x), taken after the
// chunk's product
struct Group {
    uint4 w[RPW][CH];
#if SCALED
    float s[RPW][CH];
#if OFFSET
    float b[RPW][CH];
#endif
#else
    unsigned short dh[RPW][CH];
#endif
};

// row group g's codes and scales (rows past N and chunks past C16 read as zeros)
__device__ __forceinline__ void load_group(Group& grp, const signed char* __restrict__ QS,
                                           const unsigned short* __restrict__ D,
                                           const float* __restrict__ S, const float* __restrict__ B,
                                           long long g, int N, int lane) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const long long row = g * RPW + r;
        const bool live = row < N;
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            const int c = lane + 32 * j;
            const bool ok = live && (FULL || c < C16);
            grp.w[r][j] = ok ? load_stream(QS + row * K + c * 16) : make_uint4(0u, 0u, 0u, 0u);
#if SCALED
            grp.s[r][j] = ok ? __ldg(S + row * C16 + c) : 0.0f;
#if OFFSET
            grp.b[r][j] = ok ? __ldg(B + row * C16 + c) : 0.0f;
#endif
#else
            grp.dh[r][j] = ok ? __ldg(D + row * KB + (c >> 1)) : (unsigned short)0;
#endif
        }
    }
}

// A CTA: token group tg (TT tokens, the fastest grid axis), its warps each a contiguous run of row groups
// (balanced to within one), the next group's loads issued before the current one's arithmetic.
// MIN_CTAS (STRATA_GEMV_MIN_CTAS): CTAs an SM the registers are capped for; unset, the compiler's choice
// (a 4096-wide row at one token: 124 registers, 2 CTAs an SM; scripts/cuda_resources.py)
#ifdef MIN_CTAS
#define GEMV_BOUNDS __launch_bounds__(WARPS * 32, MIN_CTAS)
#else
#define GEMV_BOUNDS __launch_bounds__(WARPS * 32)
#endif
extern "C" __global__ void GEMV_BOUNDS q8_gemv(
    const float* __restrict__ X, const signed char* __restrict__ QS, const unsigned short* __restrict__ D,
    const float* __restrict__ S, const float* __restrict__ B, float* __restrict__ OUT, int n_tok, int N,
    int n_tg)
{
    extern __shared__ float4 xs4[];  // [TT][C16][4]: float4 m of chunk c at c * 4 + (m ^ ((c >> 1) & 3));
                                     // OFFSET: then each token's chunk sums of x, float [TT][C16]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tg = blockIdx.x % n_tg;
    const long long n_warps = (long long)(gridDim.x / n_tg) * WARPS;
    const long long gw = (long long)(blockIdx.x / n_tg) * WARPS + warp;
    const long long n_groups = (N + RPW - 1) / RPW;
    const long long g_begin = gw * n_groups / n_warps, g_end = (gw + 1) * n_groups / n_warps;
    const int t0 = tg * TT;
    const int tt_n = min(TT, n_tok - t0);

    pdl_trigger();
    Group cur, nxt;
    if (g_begin < g_end) load_group(cur, QS, D, S, B, g_begin, N, lane);
    pdl_wait();  // the weights' first loads are out; X (and OUT) are the kernel before's (kernels/pdl.py)

    // while they come: the tokens' activations into shared memory (a ragged group's missing tokens as
    // zeros: computed, never stored), four floats a load where X is 16-byte aligned
    if ((reinterpret_cast<unsigned long long>(X) & 15) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(X + (long long)t0 * K);
        for (int i = threadIdx.x; i < TT * (K / 4); i += WARPS * 32) {
            const int tt = i / (K / 4), e4 = i - tt * (K / 4), c = e4 >> 2, m = e4 & 3;
            xs4[(tt * C16 + c) * 4 + (m ^ ((c >> 1) & 3))] =
                tt < tt_n ? x4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    } else {
        float* xs = reinterpret_cast<float*>(xs4);
        for (int i = threadIdx.x; i < TT * K; i += WARPS * 32) {
            const int tt = i / K, e = i - tt * K, c = e >> 4, m = (e >> 2) & 3;
            xs[tt * K + ((c * 4 + (m ^ ((c >> 1) & 3))) << 2) + (e & 3)] =
                tt < tt_n ? X[(long long)(t0 + tt) * K + e] : 0.0f;
        }
    }
    __syncthreads();
#if OFFSET
    // each token's chunk sums of x, its 16 values added in order (a token's sums never depend on the others)
    float* xsum = reinterpret_cast<float*>(xs4) + TT * K;
    for (int i = threadIdx.x; i < TT * C16; i += WARPS * 32) {
        const int c = i % C16;
        const float4* xc = xs4 + i * 4;
        float t = 0.0f;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const float4 v = xc[m ^ ((c >> 1) & 3)];
            t = t + v.x;
            t = t + v.y;
            t = t + v.z;
            t = t + v.w;
        }
        xsum[i] = t;
    }
    __syncthreads();
#endif
    // this lane's swizzle: (c >> 1) & 3 with c = lane + 32 j is (lane >> 1) & 3 for every j
    const float4* xl = xs4 + lane * 4;
    const int sw = (lane >> 1) & 3;

    for (long long g = g_begin; g < g_end; ++g) {
        if (g + 1 < g_end) load_group(nxt, QS, D, S, B, g + 1, N, lane);
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const long long row = g * RPW + r;
            float acc[TT];
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) acc[tt] = 0.0f;
#pragma unroll
            for (int j = 0; j < CH; ++j) {
                if (!FULL && lane + 32 * j >= C16) break;
                const uint4 wv = cur.w[r][j];
                const unsigned u[4] = {wv.x ^ 0x80808080u, wv.y ^ 0x80808080u, wv.z ^ 0x80808080u,
                                       wv.w ^ 0x80808080u};
                float q[16];
#pragma unroll
                for (int e = 0; e < 16; ++e) q[e] = code(u[e >> 2], e & 3);
#if SCALED
                const float d = cur.s[r][j];
#else
                const float d = half_bits(cur.dh[r][j]);
#endif
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) {
                    const float4* xc = xl + (tt * C16 + 32 * j) * 4;
                    float s = 0.0f;
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
                        const float4 xv = xc[m ^ sw];
                        s = fmaf(q[4 * m], xv.x, s);
                        s = fmaf(q[4 * m + 1], xv.y, s);
                        s = fmaf(q[4 * m + 2], xv.z, s);
                        s = fmaf(q[4 * m + 3], xv.w, s);
                    }
                    acc[tt] = fmaf(s, d, acc[tt]);
#if OFFSET
                    acc[tt] = fmaf(-cur.b[r][j], xsum[tt * C16 + lane + 32 * j], acc[tt]);
#endif
                }
            }
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) {
                float a = acc[tt];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) a = a + __shfl_xor_sync(0xffffffffu, a, off);
                if (lane == 0 && tt < tt_n && row < N) OUT[(long long)(t0 + tt) * N + row] = a;
            }
        }
        if (g + 1 < g_end) cur = nxt;
    }
}
"""


def chunks_a_lane(k: int) -> int:
    """CH: 16-code chunks a lane takes of a row of k values (lane l: chunks l, l + 32, ...)."""
    return -(-k // (32 * CHUNK))


def x_bytes(k: int, offset: bool = False) -> int:
    """Shared memory a token takes in a CTA: its K activations, and with offsets its K / 16 chunk sums."""
    return 4 * k + (4 * (k // CHUNK) if offset else 0)


def tokens_a_cta(k: int, n_tok: int = TT_MAX, offset: bool = False) -> int:
    """TT: tokens a CTA applies each row to, at most n_tok (their activations must fit X_SMEM_BYTES)."""
    return max(1, min(TT_MAX, n_tok, X_SMEM_BYTES // x_bytes(k, offset)))


def cuda_gemv_serves(k: int, offset: bool = False) -> bool:
    """Whether the CUDA form serves a matrix of width k (Q8_0, or dense_scaled's form): whole blocks, one
    token's activations (and chunk sums) within the shared memory staged a CTA."""
    return k > 0 and k % 32 == 0 and x_bytes(k, offset) <= X_SMEM_BYTES


def rows_a_group(n: int, k: int, sm_count: int) -> int:
    """RPW: rows a warp loads at once, LOADS_A_GROUP 16-byte loads a lane (twice that in flight with the next
    group's), fewer where the matrix has under 16 rows an SM (every warp of the wave gets some). A launch
    choice only: no bit depends on it."""
    return max(1, min(LOADS_A_GROUP // chunks_a_lane(k), n // (16 * sm_count)))


def ctas_an_sm(num_regs: int, shared_bytes: int) -> int:
    """CTAs of WARPS warps an SM holds (H100 / H200: 64K registers in 256-register units a warp, 228 KiB of
    shared memory with 1 KiB reserved a CTA, 64 warps): the grid is one such wave. On a GPU with less a
    grid of this size runs as a wave and a part: slower, the same bits."""
    regs_a_warp = -(-num_regs * 32 // 256) * 256
    return max(1, min(65536 // regs_a_warp // WARPS, 233472 // (shared_bytes + 1024), 64 // WARPS))


def build_options(k: int, rpw: int, tt: int, scaled: bool = False, offset: bool = False,
                  min_ctas: int = 1) -> tuple[str, ...]:
    """NVRTC's options for that form (scripts/cuda_resources.py compiles the same ones offline); min_ctas > 1:
    registers capped so that many CTAs fit an SM (only where asked: the default code is the compiler's)."""
    return ("--fmad=false", f"-DK={k}", f"-DCH={chunks_a_lane(k)}", f"-DRPW={rpw}", f"-DWARPS={WARPS}",
            f"-DTT={tt}", f"-DSCALED={int(scaled)}", f"-DOFFSET={int(offset)}",
            *nvrtc.min_ctas_option(min_ctas))


def min_ctas() -> int:
    """STRATA_GEMV_MIN_CTAS (1-4, default 1: the compiler's choice). A 4096-wide row at one token takes 124
    registers, 2 CTAs (16 warps) an SM, and that GEMV ran at 37% of the copy rate against 58.5% for the
    12352 x 2048 one at 3 CTAs (session 14). Offline (ptxas, session 31), 3 caps it at 80 registers with
    ~170 bytes of spills. An A/B switch until the GPU has timed it; the GEMV's bits do not depend on it."""
    raw = os.environ.get("STRATA_GEMV_MIN_CTAS", "")
    return int(raw) if raw else 1


@functools.cache
def _kernel(k: int, rpw: int, tt: int, device: int, scaled: bool = False, offset: bool = False,
            ctas: int = 1):
    return nvrtc.build(_SOURCE, "q8_gemv", build_options(k, rpw, tt, scaled, offset, ctas), device)


def cuda_gemv_kernel(k: int, rpw: int, tt: int, device: int, scaled: bool = False, offset: bool = False,
                     ctas: int | None = None):
    """The compiled kernel for width k, RPW rows a group and TT tokens a CTA on CUDA device `device` (scaled:
    float32 chunk scales, offset: and chunk offsets; ctas: the CTAs an SM its registers are capped for,
    default min_ctas()), or None where it cannot be built (the Triton GEMV or the dequantized linear then,
    after one warning)."""
    key = (k, rpw, tt, device, scaled, offset, min_ctas() if ctas is None else ctas)
    return nvrtc.build_or_none(("q8_gemv", *key), lambda: _kernel(*key), "dense GEMV",
                               "the Triton GEMV or the dequantized linear takes its launches")


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _wave(k: int, rpw: int, tt: int, device: int, scaled: bool = False, offset: bool = False,
          ctas: int = 1) -> int:
    """CTAs of one wave of that kernel (its registers asked of the driver once)."""
    kern = _kernel(k, rpw, tt, device, scaled, offset, ctas)
    return ctas_an_sm(kern.num_regs, x_bytes(k, offset) * tt) * _sm_count(device)


def launch_cuda_gemv(x2: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, out: torch.Tensor,
                     offset: torch.Tensor | None = None) -> bool:
    """out [T, N] = x2 [T, K] @ the matrix, on the current torch stream: a Q8_0 one (qs int8 [N, K], d float16
    [N, K / 32]) or dense_scaled's form (d float32 [N, K / 16], offset None or float32 [N, K / 16]); False
    (nothing launched) where the kernel cannot serve or be built here (the Triton GEMV then)."""
    n, k = qs.shape
    n_tok = x2.shape[0]
    scaled, has_b = d.dtype == torch.float32, offset is not None
    if has_b and not scaled:
        raise ValueError("launch_cuda_gemv: offsets go with float32 chunk scales")
    tensors = (qs, d) + ((offset,) if has_b else ())
    if not cuda_gemv_serves(k, has_b) or qs.data_ptr() % 16 or not all(t.is_contiguous() for t in tensors):
        return False
    dev = nvrtc.device_index(qs)
    rpw, tt = rows_a_group(n, k, _sm_count(dev)), tokens_a_cta(k, n_tok, has_b)
    ctas = min_ctas()  # one read a launch: the kernel and its wave agree
    kern = cuda_gemv_kernel(k, rpw, tt, dev, scaled, has_b, ctas)
    if kern is None:
        return False
    shared = x_bytes(k, has_b) * tt
    n_tg = -(-n_tok // tt)
    # one wave of CTAs (fewer for a small matrix: a warp a row group at least), shared by the token groups
    n_cta = max(1, min(-(-n // rpw) // WARPS, _wave(k, rpw, tt, dev, scaled, has_b, ctas) // n_tg))
    null = np.uint64(0)
    half, s_ptr = (null, nvrtc.ptr(d)) if scaled else (nvrtc.ptr(d), null)
    args = (nvrtc.ptr(x2), nvrtc.ptr(qs), half, s_ptr, nvrtc.ptr(offset) if has_b else null, nvrtc.ptr(out),
            np.int32(n_tok), np.int32(n), np.int32(n_tg))
    nvrtc.launch(kern, (n_tg * n_cta,), WARPS * 32, args, dev, shared_mem=shared, pdl=True)
    return True


def cuda_gemv_on() -> bool:
    """STRATA_DENSE_CUDA (default 1), off where cupy is not installed (the Triton GEMV then)."""
    return os.environ.get("STRATA_DENSE_CUDA", "1") == "1" and nvrtc.has_cupy()


# ---- the plain twin ---------------------------------------------------------------------------------------


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c) rounded once, as the GPU's FFMA: a * b is exact in float64, the sum is rounded to
    odd there (TwoSum's error moves an inexact even result one step toward the true value), and float64
    rounded to odd then to float32 is the correctly rounded float32 (Boldo and Melquiond, 2008)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def gemv_reference(x: np.ndarray, qs: np.ndarray, d: np.ndarray,
                   offset: np.ndarray | None = None) -> np.ndarray:
    """The kernel's arithmetic in numpy: x float32 [T, K], qs int8 [N, K], d float16 [N, K / 32] (Q8_0) or
    float32 [N, K / 16] with offset None or float32 [N, K / 16] (dense_scaled) -> float32 [T, N], lane by lane
    (the same chunks, chunk sums of x, fma order and butterfly)."""
    n, k = qs.shape
    c16 = k // CHUNK
    q = qs.reshape(n, c16, CHUNK).astype(np.float32)  # [N, C16, 16]
    xv = x.astype(np.float32).reshape(-1, 1, c16, CHUNK)  # [T, 1, C16, 16]
    s = np.zeros((xv.shape[0], n, c16), np.float32)  # [T, N, C16] chunk sums
    for e in range(CHUNK):
        s = fma32(q[None, :, :, e], xv[:, :, :, e], s)
    dq = d.astype(np.float32) if d.dtype == np.float32 else d.astype(np.float32)[:, np.arange(c16) // 2]
    xsum = np.zeros((xv.shape[0], 1, c16), np.float32)  # [T, 1, C16] each chunk's x added in order
    for e in range(CHUNK):
        xsum = (xsum + xv[:, :, :, e]).astype(np.float32)
    acc = np.zeros((xv.shape[0], n, 32), np.float32)  # [T, N, lanes]
    for j in range(chunks_a_lane(k)):
        c = np.arange(32) + 32 * j
        live = c < c16
        cc = np.minimum(c, c16 - 1)
        step = fma32(s[:, :, cc], np.broadcast_to(dq[:, cc], s[:, :, cc].shape), acc)
        if offset is not None:
            neg_b = np.broadcast_to(-offset.astype(np.float32)[:, cc], step.shape)
            step = fma32(neg_b, np.broadcast_to(xsum[:, :, cc], step.shape), step)
        acc = np.where(live, step, acc)
    lanes = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        acc = (acc + acc[:, :, lanes ^ off]).astype(np.float32)
    return acc[:, :, 0]
