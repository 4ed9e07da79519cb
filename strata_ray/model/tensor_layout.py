"""Every tensor of a qwen3next / qwen3moe GGUF as (name, numpy shape): the one place tensor names live.

Shapes are numpy order (reversed ggml ne): a weight used as `x @ W^T` is [out, in]; stacked experts are
[X, out, in]. The MTP (nextn) block of qwen3next sits after the trunk at blk.{n_layer}.
"""

from __future__ import annotations

from .hparams import HParams

Shape = tuple[int, ...]


def tensor_layout(hp: HParams) -> list[tuple[str, Shape]]:
    """All tensors of the model, in file order: globals, then blk.0 .. blk.{block_count-1}."""
    E, V = hp.n_embd, hp.n_vocab
    out: list[tuple[str, Shape]] = [
        ("token_embd.weight", (V, E)),
        ("output_norm.weight", (E,)),
        ("output.weight", (V, E)),
    ]
    for layer in range(hp.n_layer):
        out += layer_tensors(hp, layer)
    for layer in range(hp.n_layer, hp.block_count):
        out += nextn_tensors(hp, layer)
    return out


def layer_tensors(hp: HParams, layer: int) -> list[tuple[str, Shape]]:
    """One trunk layer: mixer (attention or Gated DeltaNet) + MoE."""
    if hp.arch == "qwen3moe":
        return _prefixed(layer, _norm("attn_norm", hp) + _attention(hp) + _norm("ffn_norm", hp) + _moe(hp))
    mixer = _gated_deltanet(hp) if hp.is_recurrent(layer) else _attention(hp)
    return _prefixed(layer, _norm("attn_norm", hp) + mixer + _norm("post_attention_norm", hp) + _moe(hp))


def nextn_tensors(hp: HParams, layer: int) -> list[tuple[str, Shape]]:
    """The MTP block: fc over [embedding | hidden], its norms, then a full-attention + MoE decoder layer."""
    E = hp.n_embd
    head = [
        ("nextn.eh_proj.weight", (E, 2 * E)),  # input = cat([enorm(embed), hnorm(hidden)])
        ("nextn.enorm.weight", (E,)),
        ("nextn.hnorm.weight", (E,)),
        ("nextn.shared_head_norm.weight", (E,)),
    ]
    block = _norm("attn_norm", hp) + _attention(hp) + _norm("post_attention_norm", hp) + _moe(hp)
    return _prefixed(layer, head + block)


def is_expert_tensor(name: str) -> bool:
    """Stacked routed-expert weights ([X, out, in]); they carry the expert quant type."""
    return name.endswith(("_exps.weight",))


def keeps_float(name: str, shape: Shape) -> bool:
    """Tensors llama-quantize never quantizes (model-format §1.7): 1-D, norms, router, conv, ssm_a/dt."""
    return (
        len(shape) < 2
        or not name.endswith(".weight")
        or name.endswith("norm.weight")
        or name.endswith("ffn_gate_inp.weight")
        or name.endswith("ssm_conv1d.weight")
    )


def _prefixed(layer: int, items: list[tuple[str, Shape]]) -> list[tuple[str, Shape]]:
    return [(f"blk.{layer}.{name}", shape) for name, shape in items]


def _norm(name: str, hp: HParams) -> list[tuple[str, Shape]]:
    return [(f"{name}.weight", (hp.n_embd,))]


def _attention(hp: HParams) -> list[tuple[str, Shape]]:
    E, H, Hkv, D = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim
    # qwen3next: each head's q rows are followed by its output-gate rows -> [H * 2D]
    q_rows = 2 * H * D if hp.arch == "qwen3next" else H * D
    return [
        ("attn_q.weight", (q_rows, E)),
        ("attn_k.weight", (Hkv * D, E)),
        ("attn_v.weight", (Hkv * D, E)),
        ("attn_output.weight", (E, H * D)),
        ("attn_q_norm.weight", (D,)),
        ("attn_k_norm.weight", (D,)),
    ]


def _gated_deltanet(hp: HParams) -> list[tuple[str, Shape]]:
    E, nv, dk = hp.n_embd, hp.ssm_dt_rank, hp.ssm_d_state
    key_dim, value_dim = hp.ssm_n_group * dk, hp.ssm_d_inner
    conv_dim = 2 * key_dim + value_dim  # channels q | k | v
    return [
        ("attn_qkv.weight", (conv_dim, E)),
        ("attn_gate.weight", (value_dim, E)),  # z
        ("ssm_ba.weight", (2 * nv, E)),  # per k-head group [b(r), a(r)]
        ("ssm_conv1d.weight", (conv_dim, hp.ssm_conv_kernel)),
        ("ssm_dt.bias", (nv,)),
        ("ssm_a", (nv,)),  # -exp(A_log)
        ("ssm_norm.weight", (hp.ssm_head_v_dim,)),
        ("ssm_out.weight", (E, value_dim)),
    ]


def _moe(hp: HParams) -> list[tuple[str, Shape]]:
    E, X, I = hp.n_embd, hp.n_expert, hp.n_ff_exp
    out = [
        ("ffn_gate_inp.weight", (X, E)),  # router
        ("ffn_gate_exps.weight", (X, I, E)),
        ("ffn_up_exps.weight", (X, I, E)),
        ("ffn_down_exps.weight", (X, E, I)),
    ]
    if hp.n_ff_shexp:
        Is = hp.n_ff_shexp
        out += [
            ("ffn_gate_inp_shexp.weight", (E,)),  # scalar sigmoid gate per token
            ("ffn_gate_shexp.weight", (Is, E)),
            ("ffn_up_shexp.weight", (Is, E)),
            ("ffn_down_shexp.weight", (E, Is)),
        ]
    return out
