"""Float32 weights of a GGUF file as the Mapping[str, Tensor] the reference forward reads (GGUF names)."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor

from strata_ray.model.hparams import HParams, ModelFormatError
from strata_ray.model.quants import T, dequantize_tensor
from strata_ray.model.tensor_layout import OPTIONAL, check_shape, is_expert_tensor, tensor_layout


def _to_torch(info, device: torch.device) -> Tensor:
    a = dequantize_tensor(info)
    if np.may_share_memory(a, info.data):  # F32 comes back as a view of the file map: own a copy, so that
        a = a.copy()  # training updates never write into (or see writes through) the mapping
    return torch.from_numpy(a).to(device)


def split_legacy_ssm_in(hp: HParams, ssm_in: Tensor) -> tuple[Tensor, Tensor]:
    """Legacy `ssm_in` (HF in_proj_qkvz, grouped per key head [q_g | k_g | v_g | z_g])
    -> (attn_qkv [q | k | v], attn_gate [z])."""
    nk, dk, E = hp.ssm_n_group, hp.ssm_d_state, hp.n_embd
    rdv = hp.ssm_d_inner // nk  # r * dv
    q, k, v, z = ssm_in.view(nk, 2 * dk + 2 * rdv, E).split([dk, dk, rdv, rdv], dim=1)
    return torch.cat([q.reshape(-1, E), k.reshape(-1, E), v.reshape(-1, E)]), z.reshape(-1, E)


def whole_matrix(name: str, info) -> bool:
    """A dense matrix of more than one row that the forward reads whole (not split at load, not an expert
    stack): what may stay quantized in one of the weight forms below."""
    return (len(info.shape) == 2 and info.shape[0] > 1 and not is_expert_tensor(name)
            and not name.endswith(".ssm_in.weight"))


def keeps_q8(name: str, info) -> bool:
    """Whether a dense tensor can stay Q8_0 on the device (kernels/dense_q8.Q8Weight): a Q8_0 whole_matrix."""
    return info.ggml_type == T.Q8_0 and whole_matrix(name, info)


def keeps_blocks(name: str, info) -> bool:
    """Whether a dense tensor can stay as its blocks on the CPU (kernels/dense_blocks.BlockMatrix): a
    whole_matrix of a contract type with a whole number of 32-row tiles."""
    from strata_ray.kernels.dense_blocks import TYPES

    return info.ggml_type in TYPES and info.shape[0] % 32 == 0 and whole_matrix(name, info)


def keeps_scaled(name: str, info) -> bool:
    """Whether a dense tensor can stay quantized on the device as a ScaledWeight (kernels/dense_scaled): a
    Q4_K or Q6_K whole_matrix."""
    from strata_ray.kernels.dense_scaled import TYPES

    return info.ggml_type in TYPES and whole_matrix(name, info)


def load_dense_weights(
    file, device: torch.device | str = "cpu", include_experts: bool = True, quantized: bool = False,
    blocks: bool = False,
) -> dict[str, Tensor]:
    """Dequantize every tensor of a GGUFFile to float32 on `device`, keyed by GGUF name.

    include_experts=False skips the routed-expert stacks (*_exps), which an ExpertBackend serves instead.
    quantized=True keeps Q8_0 matrices as they are in the file (a Q8Weight: a quarter of the float32 bytes
    in memory and read per token) and Q4_K / Q6_K ones as exact int8 codes with float32 chunk scales (a
    ScaledWeight: 1.5 / 1.25 bytes a weight); ops.linear and ops.embedding take every form. blocks=True
    (CPU) keeps every quantized matrix it can as its blocks in the file map (a BlockMatrix, computed by the
    expert contract's kernels in decode).
    Fused alternatives are split into the names the forward reads: ffn_gate_up_exps -> ffn_gate_exps +
    ffn_up_exps, legacy ssm_in -> attn_qkv + attn_gate. Raises ModelFormatError on missing/misshapen tensors.
    """
    hp: HParams = file.hparams
    device = torch.device(device)
    out: dict[str, Tensor] = {}
    for name, info in file.tensors.items():
        if is_expert_tensor(name) and not include_experts:
            continue
        if blocks and keeps_blocks(name, info):
            from strata_ray.kernels.dense_blocks import BlockMatrix

            n_rows, n_cols = info.shape
            out[name] = BlockMatrix(info.data, n_rows, n_cols, info.ggml_type)
            continue
        if quantized and keeps_q8(name, info):
            from strata_ray.kernels.dense_q8 import Q8Weight

            out[name] = Q8Weight.from_blocks(info.data, info.shape[0], info.shape[1], device)
            continue
        if quantized and keeps_scaled(name, info):
            from strata_ray.kernels.dense_scaled import ScaledWeight

            n_rows, n_cols = info.shape
            out[name] = ScaledWeight.from_blocks(info.data, n_rows, n_cols, info.ggml_type, device)
            continue
        t = _to_torch(info, device)
        if name.endswith(".ffn_gate_up_exps.weight"):  # [X, 2I, E], gate rows first
            p = name[: -len("ffn_gate_up_exps.weight")]
            inter = t.shape[1] // 2
            out[p + "ffn_gate_exps.weight"], out[p + "ffn_up_exps.weight"] = t[:, :inter], t[:, inter:]
        elif name.endswith(".ssm_in.weight"):
            p = name[: -len("ssm_in.weight")]
            out[p + "attn_qkv.weight"], out[p + "attn_gate.weight"] = split_legacy_ssm_in(hp, t)
        else:
            out[name] = t
    check_weights(hp, out, include_experts)
    if quantized:
        fuse_dense_rows(out)
        warn_without_scaled_gemv(out, device)
    return out


def warn_without_scaled_gemv(weights: dict, device: torch.device) -> bool:
    """On CUDA, one warning where Q4_K / Q6_K matrices stay quantized but the CUDA C GEMV that reads them is
    off (cupy missing, or STRATA_DENSE_CUDA=0): they have no Triton twin, so every decode step dequantizes
    each of them (kernels/dense_scaled), several times the GEMV's reads. Q8_0 has one. True: it warned."""
    from strata_ray.kernels.dense_q8_cuda import cuda_gemv_on
    from strata_ray.kernels.dense_scaled import ScaledWeight

    n = sum(isinstance(w, ScaledWeight) for w in weights.values())
    if device.type != "cuda" or not n or cuda_gemv_on():
        return False
    logging.getLogger("strata_ray.model").warning(
        "%d Q4_K / Q6_K dense matrices and no CUDA C GEMV for them (cupy missing or STRATA_DENSE_CUDA=0): "
        "each decode step dequantizes them (slow); install the cuda extra (pip install -e \".[cuda]\")", n)
    return True


# the matrices a layer applies to one input, in the order the forward reads them (kernels/dense_q8.fuse_rows)
ROW_GROUPS = (("attn_q", "attn_k", "attn_v"), ("attn_qkv", "attn_gate", "ssm_ba"),
              ("ffn_gate_shexp", "ffn_up_shexp"))


def fuse_dense_rows(weights: dict) -> None:
    """Every layer's ROW_GROUPS whose matrices are all quantized weights of one kind and width (Q8Weights, or
    ScaledWeights with or without offsets) become views of one matrix each (in place; the same names and
    bytes), so that a decode step reads each group in one GEMV launch."""
    from strata_ray.kernels.dense_q8 import QuantizedDense, fuse_rows

    layers = {name.split(".")[1] for name in weights if name.startswith("blk.")}
    for layer in layers:
        for group in ROW_GROUPS:
            names = [f"blk.{layer}.{n}.weight" for n in group]
            ws = [weights.get(n) for n in names]
            if not all(isinstance(w, QuantizedDense) for w in ws):
                continue
            kinds = {(type(w), w.shape[1], tuple(p is None for p in w.parts())) for w in ws}
            if len(kinds) == 1:
                weights.update(zip(names, fuse_rows(ws), strict=True))


def check_weights(hp: HParams, weights: dict[str, Tensor], include_experts: bool = True) -> None:
    """Every tensor the forward needs is present with its shape; one-line ModelFormatError otherwise."""
    for name, shape in tensor_layout(hp):
        if name in OPTIONAL or (is_expert_tensor(name) and not include_experts):
            continue
        if name not in weights:
            if name.endswith((".attn_q.weight", ".attn_k.weight", ".attn_v.weight")) and \
                    name.rsplit(".", 2)[0] + ".attn_qkv.weight" in weights:
                continue  # fused q|k|v of a full-attention layer
            raise ModelFormatError(f"missing tensor {name}")
        check_shape(hp, name, tuple(weights[name].shape), shape)
