"""Gated DeltaNet (linear attention) block of qwen3next, in GGUF tensor terms (model-format.md §3.4)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from strata_ray.kernels.fused_small import fused_enabled, plain_f32
from strata_ray.kernels.gdn_step import GDNDims, gdn_step, gdn_step_reference, gdn_step_supports
from strata_ray.kernels.gdn_step_cpu import cpu_step_serves, gdn_step_cpu
from strata_ray.model import ops
from strata_ray.model.hparams import HParams
from strata_ray.model.state import GDNState


def delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor,
               pos0: int) -> tuple[Tensor, Tensor]:
    """Gated delta rule over tokens at absolute positions pos0.. (arguments as ops.gdn_recurrent).

    Chunks are aligned to absolute positions: every complete 64-token window [64n, 64n+64) runs the chunked
    form, the partial windows at either end run the recurrent form. A token's result therefore depends only
    on where call boundaries fall relative to the 64-grid: prompt chunks that are multiples of 64 followed by
    one-token decode give the same bits as any other such split.
    """
    T, C = q.shape[0], ops.GDN_CHUNK
    head = min(T, (-pos0) % C)  # tokens before the first aligned window
    body = (T - head) // C * C  # complete aligned windows
    pieces = []
    spans = ((0, head, ops.gdn_recurrent), (head, head + body, ops.gdn_chunked),
             (head + body, T, ops.gdn_recurrent))
    whole = [fn for start, end, fn in spans if (start, end) == (0, T)]
    if T and whole:  # one form covers every token (a decode step): no slicing, no cat
        return whole[0](q, k, v, g, beta, S)
    for start, end, fn in spans:
        if end > start:
            o, S = fn(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], S)
            pieces.append(o)
    o = torch.cat(pieces) if pieces else v
    return o, S


def gdn_block(hp: HParams, w: Mapping[str, Tensor], layer: int, x: Tensor, st: GDNState,
              pos0: int, state_out: GDNState | None = None) -> tuple[Tensor, GDNState]:
    """Gated DeltaNet of normed input x [T, E] -> ([T, E], new layer state).

    After the projections, the core (conv, norms, gates, delta rule, gated norm) runs as two fused kernels
    on CUDA for decode and verify windows (kernels/gdn_step), as one numba kernel on the CPU for those of
    small states (kernels/gdn_step_cpu), else in the reference's torch ops.
    state_out: where the new state goes (it may be `st` itself: the decode graphs update their buffers in
    place, the fused kernels without a copy)."""
    p = f"blk.{layer}"
    T = x.shape[0]
    dims = GDNDims(hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_head_v_dim)
    # [T, conv_dim] channels q | k | v; [T, nv * dv]; [T, nk * 2r] grouped per k-head: [b (r), a (r)]
    mixed, z, ba = ops.linear_rows(x, [w[f"{p}.{n}.weight"] for n in ("attn_qkv", "attn_gate", "ssm_ba")])
    step_w = [w[f"{p}.{n}"] for n in ("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias", "ssm_norm.weight")]
    plain = plain_f32(mixed, z, ba, st.S, st.conv, *step_w)  # what the fused steps take
    core = gdn_step_reference
    if plain and T and fused_enabled(x, T) and gdn_step_supports(dims):
        core = gdn_step
    elif plain and cpu_step_serves(x, T, dims):
        core = gdn_step_cpu
    fused = core is not gdn_step_reference
    extra = {} if fused else {"pos0": pos0}  # the fused steps are recurrent only (T <= 16 < 64)
    if fused and state_out is not None:
        extra["state_out"] = (state_out.S, state_out.conv)
    o, S, conv = core(mixed, z, ba, st.S, st.conv, *step_w, dims, hp.rms_eps, **extra)
    if state_out is not None and S is not state_out.S:  # the reference's new tensors
        S, conv = state_out.S.copy_(S), state_out.conv.copy_(conv)
    return ops.linear(o, w[f"{p}.ssm_out.weight"]), GDNState(S, conv)
