"""MTP (nextn) head of qwen3next: predicts token t+2 from the trunk hidden state at t and token t+1 (§3.6)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from strata_ray.model import ops
from strata_ray.model.attention import attention_block
from strata_ray.model.hparams import HParams
from strata_ray.model.moe import ExpertBackend, moe_block
from strata_ray.model.state import KVCache


def mtp_layer_index(hp: HParams) -> int:
    """The MTP block is stored right after the trunk: blk.{n_layer}."""
    return hp.n_layer


def mtp_forward(hp: HParams, w: Mapping[str, Tensor], hidden: Tensor, next_ids: Tensor, cache: KVCache,
                pos0: int, experts: ExpertBackend) -> Tensor:
    """hidden [T, E] post-final-norm trunk states at positions pos0.., next_ids [T] the token after each
    -> logits [T, V] for the token after next. Uses and extends the MTP layer's own KV cache."""
    L = mtp_layer_index(hp)
    p = f"blk.{L}"
    embd = w.get(f"{p}.nextn.embed_tokens.weight", w["token_embd.weight"])
    e = ops.rms_norm(ops.embedding(next_ids, embd), w[f"{p}.nextn.enorm.weight"], hp.rms_eps)
    hh = ops.rms_norm(hidden, w[f"{p}.nextn.hnorm.weight"], hp.rms_eps)
    # eh_proj [E, 2E]: embedding columns first, hidden second
    h = ops.linear(torch.cat((e, hh), dim=-1), w[f"{p}.nextn.eh_proj.weight"])  # [T, E]

    x = ops.rms_norm(h, w[f"{p}.attn_norm.weight"], hp.rms_eps)
    h = h + attention_block(hp, w, L, x, cache, pos0)
    x = ops.rms_norm(h, w[f"{p}.post_attention_norm.weight"], hp.rms_eps)
    h = h + moe_block(w, L, x, hp.n_expert_used, experts)

    out = ops.rms_norm(h, w[f"{p}.nextn.shared_head_norm.weight"], hp.rms_eps)
    head = w.get(f"{p}.nextn.shared_head_head.weight", w.get("output.weight", w["token_embd.weight"]))
    return ops.linear(out, head)
