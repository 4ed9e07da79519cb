"""The decode step's short elementwise chains as one launch each: RMSNorm and the MoE combine.

A one-token decode step is latency-bound: in the captured graphs every tiny torch op is a kernel of its own
(~2 us of GPU time each on the H200, mostly launch and ramp), and a layer had ~105 of them. Two chains ran
in every layer:

- `rms_norm`: pow, mean, add, rsqrt, mul, mul (six kernels) -> `rms_norm_fused`, one program per row.
  Its sum runs in another order than torch's, so its bits differ from ops.rms_norm at rounding level. It
  is used on CUDA for calls of at most FUSED_MAX_TOKENS tokens (decode and verify windows), so those
  calls stay batch invariant among themselves (one program per row, the tiles fixed by the row length).
- the combine of a layer's routed rows, `h_mid + (sum_k rows[k] * w[k] in k order + shared)`: 2K + 1
  kernels -> `combine_fused`. Launched without FMA contraction, it performs the very roundings of the torch
  ops (one multiply, then one add, per k) and gives their bits exactly.
- the mixer's residual add and the MoE's RMSNorm after it: `add_rms_norm_fused` (the sum written too), the
  kernel of `rms_norm_fused` with the add in front.
- the shared expert's activation `silu(g) * u * sigmoid(x . w_gate)` (silu, mul, the gate's GEMV, sigmoid
  and the output's scaling: five kernels) -> `shared_act_fused`, one program a token. The gate scales h
  before the down projection instead of the projection's output: the same product up to rounding, and the
  shared expert is three launches (gate+up GEMV, this, down GEMV) where it was seven (session 40's trace:
  its chain ended ~8 us after the routed rows in every layer of an all-resident 8K decode).

The references are the torch forms (ops.rms_norm, combine_reference, add_rms_norm_reference,
shared_act_reference). Triton is imported on first use
only (CI machines have none): the kernel bodies are plain functions handed to `triton.jit` by `_kernels()`
after binding the module global `tl`; TRITON_INTERPRET=1 runs them on the CPU (tests).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from .lazy_triton import jit_bodies
from .pdl import pdl_args
from .tile_plan import next_pow2

FUSED_MAX_TOKENS = 16  # = dense_q8.GEMV_MAX_TOKENS: decode and verify windows take the fused kernels

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


def needs_grad(*ts) -> bool:
    """Whether autograd would track any of these (tensors, or weights of other kinds: never): the fused
    kernels have no backward, so such a call keeps the torch ops."""
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in ts)


def plain_f32(*ts) -> bool:
    """Whether these are float32 tensors that autograd does not track: what every fused form takes (they
    have no backward; inputs of another dtype keep the torch ops rather than raise)."""
    return all(isinstance(t, Tensor) and t.dtype == torch.float32 for t in ts) and not needs_grad(*ts)


def fused_call(x: Tensor, n_tokens: int) -> bool:
    """Whether a call of n_tokens tokens may take a fused kernel on any device: a decode or verify window
    (at most FUSED_MAX_TOKENS), STRATA_FUSED_DECODE not 0 (A/B runs), and no grad (the kernels have no
    backward)."""
    return (n_tokens <= FUSED_MAX_TOKENS and not needs_grad(x)
            and os.environ.get("STRATA_FUSED_DECODE", "1") != "0")


def fused_enabled(x: Tensor, n_tokens: int) -> bool:
    """Whether a call of n_tokens tokens on x's device takes the fused Triton kernels: a fused_call on
    CUDA."""
    return x.is_cuda and fused_call(x, n_tokens)  # is_cuda: 0.1 us where device.type is 0.6 (CPU decode)


# ---- RMSNorm --------------------------------------------------------------------------------------------


def _rms_norm_body(X, D, W, SUM, OUT, n, eps, BLOCK: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    # X, OUT f32 [rows, n] contiguous, W f32 [n]. One program = one row, whole (BLOCK >= n). ADD: the row is
    # X + D (D f32 [rows, n]), stored into SUM as well (add_rms_norm_fused); else D and SUM are unread.
    # PDL: the weights load while the kernel before finishes (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < n
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(W + cols, mask=live, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + row * n + cols, mask=live, other=0.0)
    if ADD:
        x = x + tl.load(D + row * n + cols, mask=live, other=0.0)
        tl.store(SUM + row * n + cols, x, mask=live)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    tl.store(OUT + row * n + cols, x * r * w, mask=live)


def rms_norm_fused(x: Tensor, w: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """ops.rms_norm in one launch: x float32 [..., n], w [n] -> [..., n] (into `out`, a contiguous float32
    tensor of x's shape, when given: no copy after). CUDA-graph capturable."""
    n = x.shape[-1]
    if w.shape != (n,) or x.dtype != torch.float32 or w.dtype != torch.float32:
        raise ValueError(f"rms_norm_fused: x {x.dtype} {list(x.shape)} and w {w.dtype} {list(w.shape)}")
    if out is not None and (out.shape != x.shape or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"rms_norm_fused: out must be contiguous float32 {list(x.shape)}")
    x2 = x.reshape(-1, n).contiguous()  # [rows, n]
    y = torch.empty_like(x2) if out is None else out
    if x2.shape[0]:
        block = next_pow2(n)
        _kernels()[0][(x2.shape[0],)](x2, x2, w.contiguous(), y, y, n, eps, BLOCK=block, ADD=False,
                                      num_warps=4 if block <= 1024 else 8, **pdl_args(x2))
    return y.view(x.shape) if out is None else out


# ---- the MoE combine ------------------------------------------------------------------------------------


def combine_reference(h_mid: Tensor, rows: Tensor, weights: Tensor, shared: Tensor | None) -> Tensor:
    """h_mid [N, E] + (rows [N, K, E] weighted by weights [N, K] in k order (+ shared [N, E])): the torch ops
    of moe.combine_rows and the decode graph's residual, whose bits combine_fused reproduces."""
    routed = rows[:, 0] * weights[:, 0:1]
    for k in range(1, rows.shape[1]):
        routed = routed + rows[:, k] * weights[:, k : k + 1]
    return h_mid + (routed if shared is None else routed + shared)


def gather_rows(rows: Tensor, cpu_rows: Tensor, hit: Tensor, inv: Tensor) -> Tensor:
    """Each entry's row from the tier that computed it: rows [N, K, E] where hit [N, K] != 0, else
    cpu_rows[inv] (cpu_rows [M, E], inv [N, K] int32): the decode tiers' form (torch ops, exact copies)."""
    picked = cpu_rows.index_select(0, inv.reshape(-1)).view(rows.shape)
    return torch.where(hit[..., None] != 0, rows, picked)


def _combine_body(H, ROWS, WTS, SHARED, CPU, HIT, INV, OUT, E, K: tl.constexpr, HAS_SHARED: tl.constexpr,
                  GATHER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # H, SHARED, OUT f32 [N, E]; ROWS f32 [N, K, E]; WTS f32 [N, K]; with GATHER, entry (t, k) reads
    # CPU f32 [M, E] row INV[t, k] where HIT[t, k] == 0 (int32 [N, K]). Program (token, column block).
    # K unrolled: every row's load is issued at once (CPU rows may be read over PCIe, page-locked memory).
    # PDL: every input is the chain's, so the program only starts early (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < E
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK,), tl.float32)
    for k in tl.static_range(K):
        src = ROWS + (t * K + k) * E
        if GATHER:
            cpu_row = CPU + tl.load(INV + t * K + k).to(tl.int64) * E
            src = tl.where(tl.load(HIT + t * K + k) != 0, src, cpu_row)
        prod = tl.load(src + cols, mask=live, other=0.0) * tl.load(WTS + t * K + k)
        acc = tl.where(k == 0, prod, acc + prod)  # rows[0] * w[0], then + rows[k] * w[k]: torch's roundings
    if HAS_SHARED:
        acc = acc + tl.load(SHARED + t * E + cols, mask=live, other=0.0)
    h = tl.load(H + t * E + cols, mask=live, other=0.0)
    tl.store(OUT + t * E + cols, h + acc, mask=live)


def combine_fused(h_mid: Tensor, rows: Tensor, weights: Tensor, shared: Tensor | None,
                  gather: tuple[Tensor, Tensor, Tensor] | None = None, out: Tensor | None = None) -> Tensor:
    """combine_reference in one launch, the same bits (no FMA contraction). CUDA-graph capturable.
    gather = (cpu_rows, hit, inv): the rows are gather_rows(rows, *gather), read in place (cpu_rows and inv
    may be page-locked host tensors: the pipelined decode's worker writes them there). out: a contiguous
    float32 tensor of h_mid's shape to write (a decode graph's buffer), else a new one."""
    n, k, e = rows.shape
    if h_mid.shape != (n, e) or weights.shape != (n, k) or (shared is not None and shared.shape != (n, e)):
        raise ValueError(f"combine_fused: h_mid {list(h_mid.shape)}, rows {list(rows.shape)}, weights "
                         f"{list(weights.shape)}, shared {None if shared is None else list(shared.shape)}")
    h_mid, rows, weights = h_mid.contiguous(), rows.contiguous(), weights.contiguous()
    cpu, hit, inv = gather if gather is not None else (rows, weights, weights)  # unread without GATHER
    if gather is not None and (hit.shape != (n, k) or inv.shape != (n, k) or cpu.shape[-1] != e):
        raise ValueError(f"combine_fused: gather hit {list(hit.shape)}, inv {list(inv.shape)}, cpu rows "
                         f"{list(cpu.shape)} for rows {list(rows.shape)}")
    if out is None:
        out = torch.empty_like(h_mid)
    elif out.shape != (n, e) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"combine_fused: out must be contiguous float32 [{n}, {e}]")
    if n:
        block = 1024
        sh = shared.contiguous() if shared is not None else h_mid  # unread without HAS_SHARED
        _kernels()[1][(n, -(-e // block))](h_mid, rows, weights, sh, cpu.contiguous(), hit.contiguous(),
                                           inv.contiguous(), out, e, K=k, HAS_SHARED=shared is not None,
                                           GATHER=gather is not None, BLOCK=block, num_warps=4,
                                           enable_fp_fusion=False, **pdl_args(out))
    return out


# ---- the residual add and the RMSNorm after it ----------------------------------------------------------


def add_rms_norm_reference(h: Tensor, d: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h + d, RMSNorm(h + d) * w) in torch ops (ops.rms_norm_reference over the sum): the reference twin of
    add_rms_norm_fused."""
    from strata_ray.model.ops import rms_norm_reference  # model.ops imports this module

    s = h + d
    return s, rms_norm_reference(s, w, eps)


def add_rms_norm_fused(h: Tensor, d: Tensor, w: Tensor, eps: float,
                       out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """add_rms_norm_reference in one launch: h, d float32 [rows, n], w [n] -> (h + d, its norm), into `out`
    (two contiguous float32 tensors of h's shape) when given. The sum has torch's bits (one add); the norm
    rms_norm_fused's (the same kernel body, ADD on). CUDA-graph capturable."""
    n = h.shape[-1]
    if (h.dim() != 2 or d.shape != h.shape or w.shape != (n,)
            or not h.dtype == d.dtype == w.dtype == torch.float32):
        raise ValueError(f"add_rms_norm_fused: h {h.dtype} {list(h.shape)}, d {d.dtype} {list(d.shape)}, "
                         f"w {w.dtype} {list(w.shape)}")
    if out is None:
        out = (torch.empty_like(h, memory_format=torch.contiguous_format),
               torch.empty_like(h, memory_format=torch.contiguous_format))
    elif any(o.shape != h.shape or o.dtype != torch.float32 or not o.is_contiguous() for o in out):
        raise ValueError(f"add_rms_norm_fused: out must be two contiguous float32 {list(h.shape)}")
    if h.shape[0]:
        block = next_pow2(n)
        _kernels()[0][(h.shape[0],)](h.contiguous(), d.contiguous(), w.contiguous(), out[0], out[1], n, eps,
                                     BLOCK=block, ADD=True, num_warps=4 if block <= 1024 else 8,
                                     **pdl_args(h))
    return out


# ---- the shared expert's activation ---------------------------------------------------------------------


def shared_act_reference(g: Tensor, u: Tensor, x: Tensor, w_gate: Tensor) -> Tensor:
    """silu(g) * u * sigmoid(x . w_gate) in torch ops: g, u [N, F], x [N, E], w_gate [E] -> [N, F]."""
    return F.silu(g) * u * torch.sigmoid(x @ w_gate.reshape(-1, 1))


SHARED_ACT_BF = 1024  # h values a step of shared_act's loop


def _shared_act_body(G, U, X, WG, OUT, nf, ne, sg, su, BE: tl.constexpr, BF: tl.constexpr,
                     PDL: tl.constexpr):
    # G, U f32 [N, nf] with row strides sg / su (views of the gate+up GEMV's output), X f32 [N, ne], WG f32
    # [ne], OUT f32 [N, nf] contiguous. One program a token: the gate's dot over the whole row, then h in
    # steps of BF. PDL: the gate's weights load while the kernel before finishes (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    live = e < ne
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    wg = tl.load(WG + e, mask=live, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + t * ne + e, mask=live, other=0.0)
    logit = tl.sum(x * wg, axis=0)
    s = 1.0 / (1.0 + tl.exp(-logit))
    for f0 in range(0, nf, BF):
        f = f0 + tl.arange(0, BF)
        lf = f < nf
        g = tl.load(G + t * sg + f, mask=lf, other=0.0)
        u = tl.load(U + t * su + f, mask=lf, other=0.0)
        tl.store(OUT + t * nf + f, g / (1.0 + tl.exp(-g)) * u * s, mask=lf)


def shared_act_fused(g: Tensor, u: Tensor, x: Tensor, w_gate: Tensor) -> Tensor:
    """shared_act_reference in one launch (float32; g and u may be row-strided views): -> [N, F] contiguous.
    CUDA-graph capturable."""
    n, f = g.shape
    e = x.shape[-1]
    if (u.shape != g.shape or x.shape != (n, e) or w_gate.numel() != e or g.stride(1) != 1 or u.stride(1) != 1
            or not g.dtype == u.dtype == x.dtype == w_gate.dtype == torch.float32):
        raise ValueError(f"shared_act_fused: g {g.dtype} {list(g.shape)}, u {list(u.shape)}, x {x.dtype} "
                         f"{list(x.shape)}, w_gate {w_gate.dtype} {list(w_gate.shape)}")
    out = torch.empty((n, f), dtype=torch.float32, device=g.device)
    if n:
        be = next_pow2(e)
        _kernels()[2][(n,)](g, u, x.contiguous(), w_gate.contiguous(), out, f, e, g.stride(0), u.stride(0),
                            BE=be, BF=min(SHARED_ACT_BF, next_pow2(f)), num_warps=4 if be <= 2048 else 8,
                            **pdl_args(out))
    return out


@functools.cache
def _kernels():
    return jit_bodies(_rms_norm_body, _combine_body, _shared_act_body)
