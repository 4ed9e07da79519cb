"""The Gated DeltaNet's recurrent step in two or three launches (decode and verify windows on CUDA).

After its three projections a GDN layer runs, per token: a depthwise causal conv + SiLU over the q|k|v
channels, L2 norms of q and k, the gates beta = sigmoid(b) and g = ssm_a * softplus(a + dt_bias), the
delta rule on the state S [nv, dk, dv], and a gated RMSNorm of the output. In torch ops that is ~50
kernels a layer, each a few microseconds of a one-token decode step. Here:

- `_conv_body`: one program per head-sized block of channels (a q or k head, or dk channels of v): the
  conv over the previous K-1 inputs and the new ones, SiLU, and for q and k the L2 norm (q also scaled by
  dk^-0.5); it writes the new conv state (each channel has one owner, so it is written in place safely).
- `_delta_body`: one program per value head and block of its value columns (`gdn_columns`), its state slice
  S [dk, columns] in registers for all T tokens: decay, delta-rule correction, output read;
- `_gated_norm_body`: one program per head and token, the gated RMSNorm of the output over the head's
  columns (with the whole head in one delta program, the setting's other form, the norm is inside it).

`gdn_step` returns new tensors for the output and both states (the model's states are functional: a
rejected speculative window falls back to the old ones). `gdn_step_reference` is the same computation in
the torch ops of the reference forward (model/ops.py), the oracle of the tests; the fused kernels agree
with it to rounding (their sums run in other orders), deterministically, and a token's result does not
depend on how many tokens share the call's earlier part (the tokens run in order inside each program).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .env_knob import env_knob
from .lazy_triton import jit_bodies
from .pdl import pdl_args

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch
gated_norm = None  # _gated_norm jitted, bound by _kernels()


@dataclass(frozen=True)
class GDNDims:
    """Head counts and sizes: nk k-heads of dk, nv v-heads of dv (v-head j reads k-head j // (nv / nk))."""

    nk: int
    nv: int
    dk: int
    dv: int

    @property
    def key_dim(self) -> int:
        return self.nk * self.dk


def gdn_step_reference(mixed: Tensor, z: Tensor, ba: Tensor, S: Tensor, conv: Tensor, conv_w: Tensor,
                       ssm_a: Tensor, dt_bias: Tensor, norm_w: Tensor, dims: GDNDims, eps: float,
                       pos0: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The GDN core in the reference's torch ops: mixed [T, 2*key_dim + nv*dv] (q|k|v projections), z
    [T, nv*dv], ba [T, nk*2r] -> (o [T, nv*dv] gated-normed, new S [nv, dk, dv], new conv [K-1, C])."""
    from strata_ray.model import ops
    from strata_ray.model.gdn import delta_rule

    T = mixed.shape[0]
    nk, nv, dk, dv = dims.nk, dims.nv, dims.dk, dims.dv
    r = nv // nk
    ba = ba.view(T, nk, 2 * r)  # grouped per k-head: [b (r), a (r)]
    b, a = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)
    y, conv = ops.causal_conv1d(mixed, conv_w, conv)
    q = y[:, : dims.key_dim].view(T, nk, dk)
    k = y[:, dims.key_dim : 2 * dims.key_dim].view(T, nk, dk)
    v = y[:, 2 * dims.key_dim :].view(T, nv, dv)
    beta = torch.sigmoid(b)
    g = ssm_a * F.softplus(a + dt_bias)  # log decay, ssm_a = -exp(A_log)
    # v-head j reads k-head j // r (repeat_interleave, not tiling)
    q = (ops.l2_norm(q) * dk**-0.5).repeat_interleave(r, dim=1)
    k = ops.l2_norm(k).repeat_interleave(r, dim=1)
    o, S = delta_rule(q, k, v, g, beta, S, pos0)  # [T, nv, dv]
    o = ops.gated_rms_norm(o, z.view(T, nv, dv), norm_w, eps).reshape(T, nv * dv)
    return o, S, conv


def _conv_body(MIX, STATE, W, Y, NEW_STATE, T, C, key_dim, q_scale, BC: tl.constexpr, KW: tl.constexpr,
               PDL: tl.constexpr):
    # MIX f32 [T, C], STATE / NEW_STATE f32 [KW-1, C], W f32 [C, KW], Y f32 [T, C]. Program: channels BC.
    # PDL: the program starts early, then waits (kernels/pdl.py; its weights load in the loop)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    c0 = tl.program_id(0) * BC
    c = c0 + tl.arange(0, BC)
    is_qk = c0 < 2 * key_dim  # a whole q or k head (BC = dk)
    scale = tl.where(c0 < key_dim, q_scale, 1.0)
    for t in range(T):
        acc = tl.zeros((BC,), tl.float32)
        for j in tl.static_range(KW):
            row = c * 0 + (t + j)  # [BC] (a vector: masks must be), the row in cat(state, new inputs)
            old = tl.load(STATE + row * C + c, mask=row < KW - 1, other=0.0)
            new = tl.load(MIX + (row - (KW - 1)) * C + c, mask=row >= KW - 1, other=0.0)
            acc += tl.load(W + c * KW + j) * tl.where(row < KW - 1, old, new)
        y = acc / (1.0 + tl.exp(-acc))  # SiLU
        norm = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) + 1e-6)  # ops.l2_norm's eps
        y = tl.where(is_qk, y * norm * scale, y)
        tl.store(Y + t * C + c, y)
    for i in tl.static_range(KW - 1):  # the new state: the last KW-1 rows of cat(state, new inputs)
        row = c * 0 + (T + i)  # [BC]
        old = tl.load(STATE + row * C + c, mask=row < KW - 1, other=0.0)
        new = tl.load(MIX + (row - (KW - 1)) * C + c, mask=row >= KW - 1, other=0.0)
        tl.store(NEW_STATE + i * C + c, tl.where(row < KW - 1, old, new))


def _delta_body(Y, BA, Z, S_IN, A, DT_BIAS, NORM_W, O, S_OUT, T, C, key_dim, r, eps,
                DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr):
    # Y f32 [T, C] (normed q | k | v), BA f32 [T, nk*2r], Z / O f32 [T, nv*DV], S_IN / S_OUT f32 [nv, DK, DV],
    # A / DT_BIAS f32 [nv], NORM_W f32 [DV]. Program: value head j, its value columns c*BV .. c*BV+BV-1 (a
    # column's state, correction and output need no other column), every token in order. BV == DV: the whole
    # head, and the gated norm here too; else O gets the raw outputs and _gated_norm_body follows.
    # PDL: the weights (A, DT_BIAS, NORM_W) load while the kernel before finishes, the state after the wait
    # (kernels/pdl.py)
    n_col = DV // BV
    j = tl.program_id(0) // n_col
    nv = tl.num_programs(0) // n_col
    kh = j // r
    i = j % r
    kk = tl.arange(0, DK)
    vv = (tl.program_id(0) % n_col) * BV + tl.arange(0, BV)
    s_off = j.to(tl.int64) * DK * DV + kk[:, None] * DV + vv[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    a_log = tl.load(A + j)
    dt_b = tl.load(DT_BIAS + j)
    w = tl.load(NORM_W + vv)  # [BV] (read by the whole-head form's norm alone)
    if PDL:
        tl.extra.cuda.gdc_wait()
    S = tl.load(S_IN + s_off)  # [DK, BV]
    for t in range(T):
        q = tl.load(Y + t * C + kh * DK + kk)
        k = tl.load(Y + t * C + key_dim + kh * DK + kk)
        v = tl.load(Y + t * C + 2 * key_dim + j * DV + vv)
        b = tl.load(BA + t * 2 * nv + kh * 2 * r + i)
        a = tl.load(BA + t * 2 * nv + kh * 2 * r + r + i) + dt_b
        beta = 1.0 / (1.0 + tl.exp(-b))
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))  # torch's threshold
        S = S * tl.exp(a_log * softplus)
        u = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BV] delta-rule correction
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * q[:, None], axis=0)  # [BV]
        if BV == DV:
            o = gated_norm(o, tl.load(Z + t * nv * DV + j * DV + vv), w, eps, DV)
        tl.store(O + t * nv * DV + j * DV + vv, o)
    tl.store(S_OUT + s_off, S)


def _gated_norm(o, zt, w, eps, DV: tl.constexpr):
    # one head's output [DV]: RMSNorm(o) * w * silu(zt) (ops.gated_rms_norm)
    return o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps) * w * (zt / (1.0 + tl.exp(-zt)))


def _gated_norm_body(O, Z, NORM_W, eps, DV: tl.constexpr, PDL: tl.constexpr):
    # O / Z f32 [T * nv, DV]: the raw outputs, normed in place. Program: one head of one token. PDL: the
    # weights load while the kernel before finishes (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64) * DV
    vv = tl.arange(0, DV)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(NORM_W + vv)
    if PDL:
        tl.extra.cuda.gdc_wait()
    o = gated_norm(tl.load(O + row + vv), tl.load(Z + row + vv), w, eps, DV)
    tl.store(O + row + vv, o)


@functools.cache
def _kernels():
    global gated_norm
    (gated_norm,) = jit_bodies(_gated_norm)  # the two bodies below call it
    # T unspecialized: a 1-token and a 16-token call run the same binaries
    return jit_bodies(_conv_body, _delta_body, _gated_norm_body, do_not_specialize=["T"])


def gdn_columns(dv: int) -> int:
    """The value columns a delta program takes (STRATA_GDN_COLUMNS, env only; config.py refuses a bad
    value): 32 by default, the whole head (one program a head, the gated norm inside: the form before) where
    the setting is at least dv. One program a head left 32 programs for the 80b-a3b's 32 heads, each loading
    and storing a 64 KiB state: 6.7 us a layer on the H100 (session 40 trace), a quarter of the SMs busy."""
    cols = env_knob("STRATA_GDN_COLUMNS", gdn_columns_value, 32)
    return dv if cols >= dv else cols


def gdn_columns_value(raw: str) -> int:
    v = int(raw) if raw.isascii() and raw.isdigit() else 0  # "\u00b2".isdigit(), yet int() refuses it
    if not (16 <= v <= 1024 and _pow2(v)):
        raise ValueError("a power of two from 16 to 1024")
    return v


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def gdn_step_supports(dims: GDNDims) -> bool:
    """The fused step's shapes: dk = dv, a power of two (a head's channels are one program's block)."""
    return _pow2(dims.dk) and dims.dk == dims.dv and dims.nv % dims.nk == 0


def gdn_step(mixed: Tensor, z: Tensor, ba: Tensor, S: Tensor, conv: Tensor, conv_w: Tensor, ssm_a: Tensor,
             dt_bias: Tensor, norm_w: Tensor, dims: GDNDims, eps: float,
             state_out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """gdn_step_reference (all tokens in the recurrent form) in two or three launches (gdn_columns); new
    tensors out, or the new
    states into state_out = (S', conv'), which may be S and conv themselves (a program reads its head's
    state, or its channels' rows, before it writes them: in place is safe; the decode graphs' buffers).
    CUDA-graph capturable (no host sync, no data-dependent shapes)."""
    T, C = mixed.shape
    nk, nv, dk, dv = dims.nk, dims.nv, dims.dk, dims.dv
    kw = conv_w.shape[1]
    if not gdn_step_supports(dims) or C != 2 * dims.key_dim + nv * dv:
        raise ValueError(f"gdn_step: unsupported dims {dims} for {C} channels (dk = dv, powers of two)")
    mixed, z, ba = mixed.contiguous(), z.contiguous(), ba.contiguous()
    y = torch.empty_like(mixed)
    o = torch.empty_like(z)
    if state_out is None:
        new_S, new_conv = torch.empty_like(S), torch.empty_like(conv)
    else:
        new_S, new_conv = state_out
        if new_S.shape != S.shape or new_conv.shape != conv.shape or not (new_S.is_contiguous()
                                                                          and new_conv.is_contiguous()):
            raise ValueError("gdn_step: state_out must be contiguous tensors of the states' shapes")
    if T == 0:
        return z.new_zeros(z.shape), new_S.copy_(S), new_conv.copy_(conv)
    conv_k, delta_k, norm_k = _kernels()
    pdl = pdl_args(mixed)
    conv_k[(C // dk,)](mixed, conv.contiguous(), conv_w.contiguous(), y, new_conv, T, C, dims.key_dim,
                       dk**-0.5, BC=dk, KW=kw, num_warps=4, **pdl)
    bv = gdn_columns(dv)
    delta_k[(nv * (dv // bv),)](y, ba, z, S.contiguous(), ssm_a.contiguous(), dt_bias.contiguous(),
                                norm_w.contiguous(), o, new_S, T, C, dims.key_dim, nv // nk, eps, DK=dk,
                                DV=dv, BV=bv, num_warps=8 if bv == dv else 4, **pdl)
    if bv < dv:
        norm_k[(T * nv,)](o, z, norm_w.contiguous(), eps, DV=dv, num_warps=4, **pdl)
    return o, new_S, new_conv
