"""The Gated DeltaNet's recurrent step as one numba kernel: the CPU form of gdn_step's two Triton launches,
for decode and verify windows of models with small recurrent states.

On the CPU a one-token GDN core in the reference's torch ops is ~40 small ops a layer, ~160 us each call on
the 2-core VM for the embedded strata-tiny-next: a quarter of its decode time, spent on per-op overhead,
not arithmetic (its state is 4 heads of 32 x 32). Here every step of the core (conv + SiLU, the L2 norms
of q and k, the gates, the delta rule on S, the gated RMSNorm) runs in one compiled call, token after
token, head after head, in float32; the innermost loops run along the value axis, so they vectorize without
reordering any sum. It agrees with `gdn_step_reference` to rounding (its sums run in another order),
deterministically, and a token's result does not depend on the tokens after it.

Large states (the 80b-a3b: 32 heads of 128 x 128, 2 MB a layer) keep the reference's torch ops, whose
batched products use every core: `cpu_step_serves` takes states up to CPU_STEP_MAX_STATE floats.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from torch import Tensor

from .fused_small import fused_call
from .fused_small_cpu import as_array
from .gdn_step import GDNDims

CPU_STEP_MAX_STATE = 1 << 16  # floats of S (nv * dk * dv) up to which the numba step runs (256 KB)


@numba.njit(nogil=True, cache=True)
def _gdn_step_kernel(mixed, z, ba, S, conv, conv_w, ssm_a, dt_bias, norm_w, nk, dk, dv, eps, o, new_conv):
    """mixed f32 [T, C] (q | k | v projections), z / o f32 [T, nv * dv], ba f32 [T, nk * 2r], S f32 [nv,
    dk, dv] updated in place, conv / new_conv f32 [K-1, C] (may be one array: it is read first), conv_w f32
    [C, K], ssm_a / dt_bias f32 [nv], norm_w f32 [dv]."""
    T, C = mixed.shape
    K = conv_w.shape[1]
    nv = S.shape[0]
    r = nv // nk
    key_dim = nk * dk
    q_scale = np.float32(1.0 / math.sqrt(dk))
    one = np.float32(1.0)
    hist = np.empty((T + K - 1, C), np.float32)  # cat(conv state, new inputs)
    hist[: K - 1] = conv
    hist[K - 1 :] = mixed
    y = np.empty(C, np.float32)
    u = np.empty(dv, np.float32)
    out = np.empty(dv, np.float32)
    for t in range(T):
        for c in range(C):  # depthwise causal conv + SiLU
            acc = np.float32(0.0)
            for j in range(K):
                acc += conv_w[c, j] * hist[t + j, c]
            y[c] = acc / (one + np.exp(-acc))
        for h in range(2 * nk):  # L2 norms of the q heads (then scaled by dk^-0.5) and the k heads
            ss = np.float32(0.0)
            for i in range(dk):
                ss += y[h * dk + i] * y[h * dk + i]
            inv = one / np.sqrt(ss + np.float32(1e-6))
            if h < nk:
                inv = inv * q_scale
            for i in range(dk):
                y[h * dk + i] *= inv
        for j in range(nv):  # value head j reads k-head j // r
            kh = j // r
            b = ba[t, kh * 2 * r + j % r]
            a = ba[t, kh * 2 * r + r + j % r] + dt_bias[j]
            beta = one / (one + np.exp(-b))
            softplus = a if a > np.float32(20.0) else np.log1p(np.exp(a))  # torch's threshold
            decay = np.exp(ssm_a[j] * softplus)
            qo, ko, vo = kh * dk, key_dim + kh * dk, 2 * key_dim + j * dv
            for s in range(dv):
                u[s] = 0.0
            for p in range(dk):  # decay the state and read it with k
                kp = y[ko + p]
                for s in range(dv):
                    S[j, p, s] *= decay
                    u[s] += S[j, p, s] * kp
            for s in range(dv):  # delta-rule correction
                u[s] = (y[vo + s] - u[s]) * beta
            for s in range(dv):
                out[s] = 0.0
            for p in range(dk):  # write it, read with q
                kp, qp = y[ko + p], y[qo + p]
                for s in range(dv):
                    S[j, p, s] += kp * u[s]
                    out[s] += S[j, p, s] * qp
            ms = np.float32(0.0)
            for s in range(dv):
                ms += out[s] * out[s]
            inv = one / np.sqrt(ms / np.float32(dv) + eps)
            for s in range(dv):  # gated RMSNorm: w * rmsnorm(o) * silu(z)
                zs = z[t, j * dv + s]
                o[t, j * dv + s] = out[s] * inv * norm_w[s] * (zs / (one + np.exp(-zs)))
    new_conv[:] = hist[T:]


def cpu_step_serves(x: Tensor, n_tokens: int, dims: GDNDims) -> bool:
    """Whether a GDN core of n_tokens tokens on x's device takes the numba step: a fused_small.fused_call
    (decode or verify window, STRATA_FUSED_DECODE not 0, no grad) of at least one token on the CPU, a state
    of at most CPU_STEP_MAX_STATE floats."""
    return (x.device.type == "cpu" and n_tokens > 0 and fused_call(x, n_tokens)
            and dims.nv * dims.dk * dims.dv <= CPU_STEP_MAX_STATE and dims.nv % dims.nk == 0)


def gdn_step_cpu(mixed: Tensor, z: Tensor, ba: Tensor, S: Tensor, conv: Tensor, conv_w: Tensor, ssm_a: Tensor,
                 dt_bias: Tensor, norm_w: Tensor, dims: GDNDims, eps: float,
                 state_out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """gdn_step_reference with every token in the recurrent form, on CPU float32 tensors: (o [T, nv * dv],
    new S, new conv), new tensors, or the new states written into state_out = (S', conv') (which may be S
    and conv themselves)."""
    T, C = mixed.shape
    if C != 2 * dims.key_dim + dims.nv * dims.dv or dims.nv % dims.nk:
        raise ValueError(f"gdn_step_cpu: dims {dims} do not fit {C} channels")
    if state_out is None:
        new_S, new_conv = S.clone(), torch.empty_like(conv)
    else:
        new_S, new_conv = state_out
        if new_S.shape != S.shape or new_conv.shape != conv.shape or not (new_S.is_contiguous()
                                                                          and new_conv.is_contiguous()):
            raise ValueError("gdn_step_cpu: state_out must be contiguous tensors of the states' shapes")
        if new_S.data_ptr() != S.data_ptr():
            new_S.copy_(S)
    o = torch.empty_like(z)
    arrays = [as_array(t) for t in (mixed, z, ba)]
    weights = [as_array(t) for t in (conv_w, ssm_a, dt_bias, norm_w)]
    _gdn_step_kernel(*arrays, new_S.numpy(), as_array(conv), *weights, dims.nk, dims.dk, dims.dv,
                     np.float32(eps), o.numpy(), new_conv.numpy())
    return o, new_S, new_conv


def warm_up(dims: GDNDims, conv_kernel: int) -> None:
    """Compile the kernel (or load numba's cache of it) now, on zeros of these dims: the first decode step
    then runs it instead of waiting on numba (a second or two, once per machine)."""
    C = 2 * dims.key_dim + dims.nv * dims.dv
    z = torch.zeros(1, dims.nv * dims.dv)
    gates, heads = torch.zeros(dims.nv), torch.zeros(dims.dv)
    gdn_step_cpu(torch.zeros(1, C), z, torch.zeros(1, dims.nk * 2 * (dims.nv // dims.nk)),
                 torch.zeros(dims.nv, dims.dk, dims.dv), torch.zeros(conv_kernel - 1, C),
                 torch.zeros(C, conv_kernel), gates, gates, heads, dims, 1e-6)
