"""Every tensor of a qwen3next / qwen3moe GGUF as (name, numpy shape): the one place tensor names live.

Shapes are numpy order (reversed ggml ne): a weight used as `x @ W^T` is [out, in]; stacked experts are
[X, out, in]. The MTP (nextn) block of qwen3next sits after the trunk at blk.{n_layer}.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from .hparams import HParams, ModelFormatError

Shape = tuple[int, ...]
OPTIONAL = ("output.weight",)  # absent -> tied to token_embd
_BLOCK = re.compile(r"^blk\.(\d+)\.")


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


def check_tensors(hp: HParams, tensors: Mapping[str, Any]) -> None:
    """The file's tensors ({name: TensorInfo}, header only: no weight is read) against the layout: every
    tensor the engine reads is there at its shape, or the fused / legacy form the loaders split; every
    tensor is of a type the engine computes; no tensor lies past block_count. ModelFormatError naming the
    first problem, in one line.

    Checked where the header is parsed, so that a bad file fails before Ray starts: in the primary, after
    the load, a type showed only once its tensor was dequantized, a missing expert stack as a KeyError in
    decode, and expert stacks of another count than expert_count or layers past block_count not at all
    (the model ran, reading the wrong bytes or skipping layers)."""
    from .quants import SUPPORTED, type_name

    bad = [(name, t.ggml_type) for name, t in tensors.items() if t.ggml_type not in SUPPORTED]
    if bad:
        runs = ", ".join(x.name for x in SUPPORTED)
        kinds = sorted({type_name(t) for _, t in bad})
        if len(bad) == 1:
            raise ModelFormatError(f"tensor {bad[0][0]} is {kinds[0]}, a type this engine does not run "
                                   f"(it runs {runs})")
        raise ModelFormatError(f"{len(bad)} tensors are {' / '.join(kinds)}, which this engine does not run "
                               f"(the first: {bad[0][0]}; it runs {runs})")
    for name in tensors:
        m = _BLOCK.match(name)
        if m and int(m[1]) >= hp.block_count:  # the hparams say fewer layers than the file holds
            raise ModelFormatError(f"tensor {name} lies past the {hp.block_count} blocks of "
                                   f"{hp.arch}.block_count")
    for name, shape in tensor_layout(hp):
        if name in tensors:
            check_shape(hp, name, tuple(tensors[name].shape), shape)
            continue
        alt = _alternative(hp, name)
        if alt is not None and alt[0] in tensors:
            got = tuple(tensors[alt[0]].shape)
            if got != alt[1]:
                raise ModelFormatError(f"tensor {alt[0]} has shape {list(got)}, expected {list(alt[1])}")
        elif name not in OPTIONAL:
            raise ModelFormatError(f"missing tensor {name}")


def check_shape(hp: HParams, name: str, got: Shape, shape: Shape) -> None:
    """ModelFormatError where layout tensor `name` has shape `got`, not the layout's `shape`. The shared
    expert's gate may be a [1, E] matrix (some converters' files), read as its E values."""
    shexp_gate = name.endswith("ffn_gate_inp_shexp.weight") and math.prod(got) == hp.n_embd
    if tuple(got) != tuple(shape) and not shexp_gate:
        raise ModelFormatError(f"tensor {name} has shape {list(got)}, expected {list(shape)}")


def _alternative(hp: HParams, name: str) -> tuple[str, Shape] | None:
    """The tensor that stands for layout tensor `name` when it is absent (weights.load_dense_weights and
    the expert stores split it), with its shape; None where there is none."""
    prefix, _, short = name.rpartition(".")[0].rpartition(".")  # blk.N, attn_q
    E = hp.n_embd
    if short in ("ffn_gate_exps", "ffn_up_exps"):  # [X, 2I, E], gate rows first
        return f"{prefix}.ffn_gate_up_exps.weight", (hp.n_expert, 2 * hp.n_ff_exp, E)
    if not prefix.startswith("blk."):
        return None
    layer = int(prefix.split(".")[1])
    recurrent = layer < hp.n_layer and hp.is_recurrent(layer)
    if recurrent and short in ("attn_qkv", "attn_gate"):  # legacy ssm_in: per key head [q | k | v | z]
        return f"{prefix}.ssm_in.weight", (2 * hp.ssm_n_group * hp.ssm_d_state + 2 * hp.ssm_d_inner, E)
    if not recurrent and short in ("attn_q", "attn_k", "attn_v"):  # fused rows [q(+gate) | k | v]
        q_rows = _attention(hp)[0][1][0]
        return f"{prefix}.attn_qkv.weight", (q_rows + 2 * hp.n_head_kv * hp.head_dim, E)
    return None
