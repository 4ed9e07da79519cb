"""Tiny random transformers Qwen3Next / Qwen3Moe models and their GGUF-named float weights (test helper).

The conversion is the forward map of model-format.md §2.3/§2.4 (the inverse of §2.6): +1 on zero-centred
norms, ssm_a = -exp(A_log), attn_qkv / attn_gate split from in_proj_qkvz per key-head group, experts from the
fused gate_up_proj.
"""

from __future__ import annotations

import math

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

from strata_ray.model.hparams import HParams

VOCAB = 300
HIDDEN = 64


def next_config() -> Qwen3NextConfig:
    cfg = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts_per_tok=2, num_experts=8,
        norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=1024,
    )
    cfg._attn_implementation = "eager"
    return cfg


def moe_config() -> Qwen3MoeConfig:
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        moe_intermediate_size=32, num_experts_per_tok=2, num_experts=8, norm_topk_prob=True,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=1024,
    )
    cfg._attn_implementation = "eager"
    return cfg


def _randomize(model: torch.nn.Module, zero_centred_norms: bool, seed: int) -> None:
    """Weights with O(1) activations and decisive routing (HF's init is too small to test anything)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape, std):
        return torch.randn(shape, generator=gen) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # gated norm: plain weight around 1
                p.copy_(1 + randn(p.shape, 0.1))
            elif name.endswith("norm.weight"):
                p.copy_(randn(p.shape, 0.1) + (0 if zero_centred_norms else 1))
            elif name.endswith("A_log"):
                p.copy_(torch.log(0.05 + torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(randn(p.shape, 0.5))
            elif "conv1d" in name:
                p.copy_(randn(p.shape, 0.5))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(randn(p.shape, 1.0))
            elif name.endswith("mlp.gate.weight"):  # router: logits std ~2 so top-k has clear gaps
                p.copy_(randn(p.shape, 2.0 / math.sqrt(p.shape[-1])))
            else:
                p.copy_(randn(p.shape, 1.0 / math.sqrt(p.shape[-1])))


def tiny_qwen3next(seed: int = 0) -> Qwen3NextForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(next_config()).eval()
    _randomize(model, zero_centred_norms=True, seed=seed)
    return model


def tiny_qwen3moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(moe_config()).eval()
    _randomize(model, zero_centred_norms=False, seed=seed)
    return model


def hparams_of(model) -> HParams:
    c = model.config
    is_next = c.model_type == "qwen3_next"
    head_dim = c.head_dim
    common = dict(
        arch="qwen3next" if is_next else "qwen3moe", n_vocab=c.vocab_size, n_embd=c.hidden_size,
        n_layer=c.num_hidden_layers, n_nextn=0, n_head=c.num_attention_heads, n_head_kv=c.num_key_value_heads,
        head_dim=head_dim, n_expert=c.num_experts, n_expert_used=c.num_experts_per_tok,
        n_ff_exp=c.moe_intermediate_size, n_ff_shexp=c.shared_expert_intermediate_size if is_next else 0,
        rms_eps=c.rms_norm_eps, rope_freq_base=float(c.rope_parameters["rope_theta"]),
        n_rot=int(head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0)),
        context_length=c.max_position_embeddings,
    )
    if not is_next:
        return HParams(**common)
    return HParams(
        **common, ssm_conv_kernel=c.linear_conv_kernel_dim, ssm_d_state=c.linear_key_head_dim,
        ssm_n_group=c.linear_num_key_heads, ssm_dt_rank=c.linear_num_value_heads,
        ssm_d_inner=c.linear_value_head_dim * c.linear_num_value_heads,
        recurrent=tuple(t == "linear_attention" for t in c.layer_types),
    )


def gguf_weights(model) -> dict[str, torch.Tensor]:
    """The HF state dict under GGUF names, float32, GGUF conventions applied."""
    c = model.config
    is_next = c.model_type == "qwen3_next"
    shift = 1.0 if is_next else 0.0  # zero-centred norms get their +1 folded in
    sd = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    out = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"] + shift,
        "output.weight": sd["lm_head.weight"],
    }
    for n in range(c.num_hidden_layers):
        hf, p = f"model.layers.{n}", f"blk.{n}"
        out[f"{p}.attn_norm.weight"] = sd[f"{hf}.input_layernorm.weight"] + shift
        post = "post_attention_norm" if is_next else "ffn_norm"
        out[f"{p}.{post}.weight"] = sd[f"{hf}.post_attention_layernorm.weight"] + shift
        if f"{hf}.self_attn.q_proj.weight" in sd:
            for hf_name, g_name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                    ("o_proj", "attn_output")):
                out[f"{p}.{g_name}.weight"] = sd[f"{hf}.self_attn.{hf_name}.weight"]
            out[f"{p}.attn_q_norm.weight"] = sd[f"{hf}.self_attn.q_norm.weight"] + shift
            out[f"{p}.attn_k_norm.weight"] = sd[f"{hf}.self_attn.k_norm.weight"] + shift
        else:
            out.update(_gdn_tensors(c, sd, hf, p))
        out[f"{p}.ffn_gate_inp.weight"] = sd[f"{hf}.mlp.gate.weight"]
        gate_up = sd[f"{hf}.mlp.experts.gate_up_proj"]  # [X, 2I, E], gate rows first
        inter = gate_up.shape[1] // 2
        out[f"{p}.ffn_gate_exps.weight"] = gate_up[:, :inter].contiguous()
        out[f"{p}.ffn_up_exps.weight"] = gate_up[:, inter:].contiguous()
        out[f"{p}.ffn_down_exps.weight"] = sd[f"{hf}.mlp.experts.down_proj"]  # [X, E, I]
        if is_next:
            for part in ("gate", "up", "down"):
                out[f"{p}.ffn_{part}_shexp.weight"] = sd[f"{hf}.mlp.shared_expert.{part}_proj.weight"]
            out[f"{p}.ffn_gate_inp_shexp.weight"] = sd[f"{hf}.mlp.shared_expert_gate.weight"].reshape(-1)
    return out


def _gdn_tensors(c, sd: dict, hf: str, p: str) -> dict[str, torch.Tensor]:
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    r, E = nv // nk, c.hidden_size
    la = f"{hf}.linear_attn"
    # in_proj_qkvz rows grouped per key head g: [q_g (dk) | k_g (dk) | v_g (r*dv) | z_g (r*dv)]
    qkvz = sd[f"{la}.in_proj_qkvz.weight"].view(nk, 2 * dk + 2 * r * dv, E)
    q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
    return {
        f"{p}.attn_qkv.weight": torch.cat([q.reshape(-1, E), k.reshape(-1, E), v.reshape(-1, E)]),
        f"{p}.attn_gate.weight": z.reshape(-1, E),
        f"{p}.ssm_ba.weight": sd[f"{la}.in_proj_ba.weight"],
        f"{p}.ssm_conv1d.weight": sd[f"{la}.conv1d.weight"].squeeze(1),
        f"{p}.ssm_dt.bias": sd[f"{la}.dt_bias"],
        f"{p}.ssm_a": -torch.exp(sd[f"{la}.A_log"]),
        f"{p}.ssm_norm.weight": sd[f"{la}.norm.weight"],
        f"{p}.ssm_out.weight": sd[f"{la}.out_proj.weight"],
    }


def mtp_weights(hp, seed: int = 0) -> dict[str, torch.Tensor]:
    """A hand-built blk.{n_layer}: nextn head + gated full attention + MoE with shared expert."""
    gen = torch.Generator().manual_seed(seed)
    E, H, Hkv, D = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim
    X, I, Is = hp.n_expert, hp.n_ff_exp, hp.n_ff_shexp

    def lin(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale / math.sqrt(shape[-1])

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=gen)

    p = f"blk.{hp.n_layer}"
    return {
        f"{p}.nextn.eh_proj.weight": lin(E, 2 * E), f"{p}.nextn.enorm.weight": norm(E),
        f"{p}.nextn.hnorm.weight": norm(E), f"{p}.nextn.shared_head_norm.weight": norm(E),
        f"{p}.attn_norm.weight": norm(E), f"{p}.post_attention_norm.weight": norm(E),
        f"{p}.attn_q.weight": lin(2 * H * D, E), f"{p}.attn_k.weight": lin(Hkv * D, E),
        f"{p}.attn_v.weight": lin(Hkv * D, E), f"{p}.attn_output.weight": lin(E, H * D),
        f"{p}.attn_q_norm.weight": norm(D), f"{p}.attn_k_norm.weight": norm(D),
        f"{p}.ffn_gate_inp.weight": lin(X, E, scale=2.0), f"{p}.ffn_gate_exps.weight": lin(X, I, E),
        f"{p}.ffn_up_exps.weight": lin(X, I, E), f"{p}.ffn_down_exps.weight": lin(X, E, I),
        f"{p}.ffn_gate_inp_shexp.weight": lin(E), f"{p}.ffn_gate_shexp.weight": lin(Is, E),
        f"{p}.ffn_up_shexp.weight": lin(Is, E), f"{p}.ffn_down_shexp.weight": lin(E, Is),
    }


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [T, V] from transformers (no cache)."""
    with torch.inference_mode():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers' own generate (its cache: chunked prefill, recurrent decode)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def random_prompt(n: int, seed: int = 1) -> list[int]:
    """n token ids drawn uniformly from the tiny vocabulary, fixed by seed."""
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def model_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from our Model: the prompt in one call, then one token per call."""
    with torch.inference_mode():
        state = model.new_state()
        logits = model.forward(ids, state)
        got = []
        for _ in range(n):
            got.append(int(logits[-1].argmax()))
            logits = model.forward([got[-1]], state)
    return got
