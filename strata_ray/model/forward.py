"""The reference forward pass (float32, any device) of qwen3next and qwen3moe over GGUF-named weights.

Weights are a plain Mapping[str, Tensor], so the same code runs inference (callers wrap it in
torch.inference_mode) and training through autograd (nothing here is in-place on tensors that need grad).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from strata_ray.model import ops
from strata_ray.model.attention import attention_block
from strata_ray.model.gdn import gdn_block
from strata_ray.model.hparams import HParams, ModelFormatError
from strata_ray.model.moe import ExpertBackend, FloatExperts, moe_block, route
from strata_ray.model.mtp import mtp_forward
from strata_ray.model.state import SequenceState, new_sequence_state


def _one_token(ids: Tensor | Sequence[int]) -> bool:
    return ids.dim() == 1 and ids.shape[0] == 1 if isinstance(ids, Tensor) else len(ids) == 1


class Model:
    """Trunk (+ optional MTP head) of one model. forward() appends to a SequenceState, so a prompt fed in
    chunks and then one token at a time gives the same logits as one full pass."""

    def __init__(self, hp: HParams, weights: Mapping[str, Tensor], experts: ExpertBackend | None = None):
        if "token_embd.weight" not in weights:
            raise ModelFormatError("missing tensor token_embd.weight")
        self.hp = hp
        self.weights = weights
        self.experts: ExpertBackend = experts if experts is not None else FloatExperts(weights)
        self.device = weights["token_embd.weight"].device
        self.decode_graphs = None  # a DecodeGraphs: one-token forwards replay captured segments
        # qwen3next calls the norm before the MoE post_attention_norm; qwen3moe calls it ffn_norm (§2.4)
        self.ffn_norm = "post_attention_norm" if hp.arch == "qwen3next" else "ffn_norm"

    def new_state(self) -> SequenceState:
        return new_sequence_state(self.hp, self.device)

    def use_decode_graphs(self, capture: bool | None = None) -> None:
        """Run one-token forwards (without autograd) through DecodeGraphs: CUDA graphs on CUDA, or the same
        segments uncaptured (capture=False, any device). Same bits as the plain forward."""
        from strata_ray.model.decode_graph import DecodeGraphs

        self.decode_graphs = DecodeGraphs(self, capture)

    def _as_ids(self, ids: Tensor | Sequence[int]) -> Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        if ids.dim() != 1:
            raise ValueError(f"token ids must be one-dimensional, got shape {tuple(ids.shape)}")
        return ids

    def route(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor]:
        """Router of `layer` for normed x [N, E] -> (ids [N, K] int64, weights [N, K] renormalised)."""
        return route(self.weights[f"blk.{layer}.ffn_gate_inp.weight"], x, self.hp.n_expert_used)

    def forward(self, ids: Tensor | Sequence[int], state: SequenceState | None = None, *,
                return_hidden: bool = False, last_only: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """ids [T] at positions state.pos.. -> logits [T, V] (and hidden [T, E] after the final norm).
        last_only: logits (and hidden) of the last token only, [1, V]: a prompt chunk needs no more, and
        all T rows of an 8K chunk are 5 GB of float32 at a 152K vocabulary."""
        hp, w = self.hp, self.weights
        graphs = self.decode_graphs
        if graphs is not None and state is not None and _one_token(ids) and not torch.is_grad_enabled():
            return graphs.step(ids, state, return_hidden)
        h = self.trunk(ids, state)
        if last_only:
            h = h[-1:]
        hidden = ops.rms_norm(h, w["output_norm.weight"], hp.rms_eps)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    __call__ = forward

    def trunk(self, ids: Tensor | Sequence[int], state: SequenceState | None = None) -> Tensor:
        """ids [T] at positions state.pos.. -> the residual stream h [T, E] after the last layer (before the
        final norm), the state advanced: forward's body (a prompt's scoring heads its rows in slices)."""
        hp, w = self.hp, self.weights
        ids = self._as_ids(ids)
        state = self.new_state() if state is None else state
        pos0, T = state.pos, ids.shape[0]
        h = ops.embedding(ids, w["token_embd.weight"])  # [T, E]
        clock = getattr(self.experts, "clock", None)  # a LayerClock timing this forward (bench_tiers)
        for layer in range(hp.n_layer):
            p = f"blk.{layer}"
            x = ops.rms_norm(h, w[f"{p}.attn_norm.weight"], hp.rms_eps)
            if hp.is_recurrent(layer):
                out, state.gdn[layer] = gdn_block(hp, w, layer, x, state.gdn[layer], pos0)
            else:
                out = attention_block(hp, w, layer, x, state.kv[layer], pos0)
            if clock is not None:
                clock.point(layer, "mixer")  # norm + attention / GDN; the router's part follows
            h, x = ops.add_rms_norm(h, out, w[f"{p}.{self.ffn_norm}.weight"], hp.rms_eps)
            h = h + moe_block(w, layer, x, hp.n_expert_used, self.experts)
        state.pos = pos0 + T
        return h

    def head(self, h: Tensor) -> Tensor:
        """The final norm and the LM head: h [T, E] (the trunk's) -> logits [T, V]."""
        hidden = ops.rms_norm(h, self.weights["output_norm.weight"], self.hp.rms_eps)
        return self.lm_head(hidden)

    def lm_head(self, hidden: Tensor) -> Tensor:
        """hidden [T, E] (after the final norm) -> logits [T, V]."""
        return ops.linear(hidden, self.weights.get("output.weight", self.weights["token_embd.weight"]))

    def mtp_logits(self, hidden: Tensor, next_ids: Tensor | Sequence[int], state: SequenceState) -> Tensor:
        """MTP head: hidden [T, E] (post-final-norm, trunk positions state.mtp_pos..) and next_ids [T] (the
        token that followed each) -> logits [T, V] for the token after that. Appends to the MTP layer's KV
        cache; calls must continue where the previous one stopped (mtp_pos)."""
        if not self.hp.has_mtp:
            raise ModelFormatError("this model has no MTP (nextn) layer")
        next_ids = self._as_ids(next_ids)
        if next_ids.shape[0] != hidden.shape[0]:
            raise ValueError(f"mtp_logits: {hidden.shape[0]} hidden states but {next_ids.shape[0]} next ids")
        pos0 = state.mtp_pos
        logits = mtp_forward(self.hp, self.weights, hidden, next_ids, state.mtp_kv, pos0, self.experts)
        state.mtp_pos = pos0 + next_ids.shape[0]
        return logits
