"""Full attention: qwen3next gated attention (partial rotary, sigmoid output gate) and qwen3moe attention."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from strata_ray.kernels.fused_small import fused_enabled, plain_f32
from strata_ray.kernels.fused_small_cpu import norm_rope_cpu, norm_rope_cpu_serves
from strata_ray.kernels.norm_rope import norm_rope_fused, norm_rope_supported, rotates
from strata_ray.model import ops
from strata_ray.model.hparams import HParams
from strata_ray.model.state import KVCache


def _projections(hp: HParams, w: Mapping[str, Tensor], p: str, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q (with the output gate rows for qwen3next), k, v projections; accepts a fused attn_qkv too."""
    if f"{p}.attn_q.weight" in w:
        q, k, v = ops.linear_rows(x, [w[f"{p}.attn_{n}.weight"] for n in "qkv"])
        return q, k, v
    qkv = ops.linear(x, w[f"{p}.attn_qkv.weight"])  # rows [q(+gate) | k | v]
    kv_dim = hp.n_head_kv * hp.head_dim
    q_dim = qkv.shape[-1] - 2 * kv_dim
    return qkv[:, :q_dim], qkv[:, q_dim : q_dim + kv_dim], qkv[:, q_dim + kv_dim :]


def attention_inputs(hp: HParams, w: Mapping[str, Tensor], layer: int, x: Tensor, pos: Tensor,
                     tables: tuple[Tensor, Tensor] | None = None
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Normed input x [T, E] at positions pos [T] (int64, on x's device) -> q [T, H, D], k and v [T, Hkv, D]
    (normed and rotated, ready for the cache) and the output gate [T, H*D] (qwen3next) or None. tables: the
    positions' ops.rope_tables when the caller holds them (the decode graphs: once a token, not a layer)."""
    p = f"blk.{layer}"
    T = x.shape[0]
    H, Hkv, D = hp.n_head, hp.n_head_kv, hp.head_dim
    qg, k, v = _projections(hp, w, p, x)
    gated = qg.shape[-1] == 2 * H * D  # qwen3next: per head [q (D) | gate (D)]
    cos, sin = tables if tables is not None else ops.rope_tables(pos, hp.n_rot, hp.rope_freq_base)
    heads = (qg.view(T, H, qg.shape[-1] // H), k.view(T, Hkv, D))  # [T, H, D or 2D], [T, Hkv, D]
    norms = w[f"{p}.attn_q_norm.weight"], w[f"{p}.attn_k_norm.weight"]
    plain = plain_f32(*heads, *norms)  # what the fused forms take
    if plain and fused_enabled(x, T) and norm_rope_supported(D, hp.n_rot):  # CUDA, decode / verify: a launch
        q, k, gate = norm_rope_fused(*heads, *norms, hp.rms_eps, cos, sin)
        return q, k, v.view(T, Hkv, D), gate
    if plain and norm_rope_cpu_serves(x, T) and rotates(D, hp.n_rot):  # CPU, decode / verify: one numba call
        q, k, gate = norm_rope_cpu(*heads, *norms, hp.rms_eps, cos, sin)
        return q, k, v.view(T, Hkv, D), gate
    if gated:
        qg = qg.view(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
    else:
        q, gate = qg.view(T, H, D), None
    q = ops.rms_norm(q, w[f"{p}.attn_q_norm.weight"], hp.rms_eps)
    k = ops.rms_norm(k.view(T, Hkv, D), w[f"{p}.attn_k_norm.weight"], hp.rms_eps)
    v = v.view(T, Hkv, D)
    return ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin), v, gate


def attention_output(w: Mapping[str, Tensor], layer: int, o: Tensor, gate: Tensor | None) -> Tensor:
    """Attention result o [T, H, D] -> gated (qwen3next) output projection [T, E]."""
    o = o.reshape(o.shape[0], o.shape[1] * o.shape[2])  # [T, H*D] (T may be 0)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return ops.linear(o, w[f"blk.{layer}.attn_output.weight"])


def attention_block(hp: HParams, w: Mapping[str, Tensor], layer: int, x: Tensor, cache: KVCache,
                    pos0: int) -> Tensor:
    """Attention of normed input x [T, E] at absolute positions pos0.. -> [T, E]; appends k, v to cache."""
    pos = torch.arange(pos0, pos0 + x.shape[0], device=x.device)
    q, k, v, gate = attention_inputs(hp, w, layer, x, pos)
    k_all, v_all = cache.append(k, v)
    o = ops.attention(q, k_all, v_all, pos0, hp.head_dim**-0.5)  # [T, H, D]
    return attention_output(w, layer, o, gate)
