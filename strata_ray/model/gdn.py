"""Gated DeltaNet (linear attention) block of qwen3next, in GGUF tensor terms (model-format.md §3.4)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

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
              pos0: int) -> tuple[Tensor, GDNState]:
    """Gated DeltaNet of normed input x [T, E] -> ([T, E], new layer state)."""
    p = f"blk.{layer}"
    T = x.shape[0]
    nk, nv, dk = hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state
    dv, r = hp.ssm_head_v_dim, hp.ssm_dt_rank // hp.ssm_n_group
    key_dim = nk * dk

    mixed = ops.linear(x, w[f"{p}.attn_qkv.weight"])  # [T, conv_dim], channels q | k | v
    z = ops.linear(x, w[f"{p}.attn_gate.weight"]).view(T, nv, dv)
    ba = ops.linear(x, w[f"{p}.ssm_ba.weight"]).view(T, nk, 2 * r)  # grouped per k-head: [b (r), a (r)]
    b, a = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)

    y, conv = ops.causal_conv1d(mixed, w[f"{p}.ssm_conv1d.weight"], st.conv)
    q = y[:, :key_dim].view(T, nk, dk)
    k = y[:, key_dim : 2 * key_dim].view(T, nk, dk)
    v = y[:, 2 * key_dim :].view(T, nv, dv)

    beta = torch.sigmoid(b)
    g = w[f"{p}.ssm_a"] * F.softplus(a + w[f"{p}.ssm_dt.bias"])  # log decay, ssm_a = -exp(A_log)
    # v-head j reads k-head j // r (repeat_interleave, not tiling)
    q = (ops.l2_norm(q) * dk**-0.5).repeat_interleave(r, dim=1)
    k = ops.l2_norm(k).repeat_interleave(r, dim=1)

    o, S = delta_rule(q, k, v, g, beta, st.S, pos0)  # [T, nv, dv]
    o = ops.gated_rms_norm(o, z, w[f"{p}.ssm_norm.weight"], hp.rms_eps).reshape(T, nv * dv)
    return ops.linear(o, w[f"{p}.ssm_out.weight"]), GDNState(S, conv)
