"""GGUF file -> load_dense_weights -> Model: the tiny transformers models round-tripped through real files."""

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from strata_ray.model.forward import Model
from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.gguf_writer import ModelWriter, byte_level_tokenizer_spec
from strata_ray.model.hparams import ModelFormatError
from strata_ray.model.quants import dequantize, quantize
from strata_ray.model.weights import load_dense_weights
from tests.model import hf_reference as ref

T = gguf.GGMLQuantizationType
PROMPT = torch.randint(0, ref.VOCAB, (40,), generator=torch.Generator().manual_seed(9)).tolist()


def _write(path, hp, weights, types=None):
    mw = ModelWriter(path, hp, byte_level_tokenizer_spec().padded(hp.n_vocab))
    for name, t in weights.items():
        a = t.numpy()
        mw.add(name, a.shape, (types or {}).get(name, T.F32), lambda a=a: a)
    mw.write()
    return path


def _logits(model):
    with torch.inference_mode():
        return model.forward(PROMPT, model.new_state())


def _assert_same_logits(a, b):
    """The trunk's logits, then the MTP head's over a's hidden states, bit for bit."""
    assert torch.equal(_logits(a), _logits(b))
    with torch.inference_mode():
        _, hidden = a.forward(PROMPT[:-1], a.new_state(), return_hidden=True)
        assert torch.equal(a.mtp_logits(hidden, PROMPT[1:], a.new_state()),
                           b.mtp_logits(hidden, PROMPT[1:], b.new_state()))


@pytest.fixture(scope="module")
def next_model():
    hf_model = ref.tiny_qwen3next(seed=2)
    hp = dataclasses.replace(ref.hparams_of(hf_model), n_nextn=1)
    weights = ref.gguf_weights(hf_model)
    weights.update(ref.mtp_weights(hp, seed=3))
    return hp, weights


def test_qwen3next_f32_file_gives_identical_logits(next_model, tmp_path):
    hp, weights = next_model
    file = GGUFFile(_write(tmp_path / "next.gguf", hp, weights))
    assert dataclasses.replace(file.hparams, rms_eps=hp.rms_eps) == hp  # eps is stored as f32
    loaded = load_dense_weights(file, "cpu", include_experts=True)
    assert loaded.keys() == weights.keys()
    _assert_same_logits(Model(hp, loaded), Model(hp, weights))


def test_qwen3moe_q8_0_experts_dequantized_on_load(tmp_path):
    hf_model = ref.tiny_qwen3moe(seed=3)
    hp, weights = ref.hparams_of(hf_model), ref.gguf_weights(hf_model)
    types = {n: T.Q8_0 for n in weights if n.endswith("_exps.weight")}
    file = GGUFFile(_write(tmp_path / "moe.gguf", hp, weights, types))
    loaded = load_dense_weights(file, "cpu", include_experts=True)
    rounded = dict(weights)
    for n in types:
        blocks = quantize(weights[n].numpy(), T.Q8_0)
        rounded[n] = torch.from_numpy(dequantize(blocks, T.Q8_0, weights[n].shape))
    for name in weights:
        assert torch.equal(loaded[name], rounded[name]), name
    got, expected = _logits(Model(hp, loaded)), ref.hf_logits(hf_model, PROMPT)
    assert not torch.equal(got, expected)  # the experts really were quantized
    assert (got - expected).abs().mean() < 0.02


def test_include_experts_false_skips_expert_stacks(next_model, tmp_path):
    hp, weights = next_model
    file = GGUFFile(_write(tmp_path / "next.gguf", hp, weights))
    dense = load_dense_weights(file, "cpu", include_experts=False)
    assert not any(n.endswith("_exps.weight") for n in dense)
    assert set(dense) == {n for n in weights if not n.endswith("_exps.weight")}


def test_legacy_ssm_in_and_fused_gate_up_are_split(next_model, tmp_path):
    hp, weights = next_model
    variant = dict(weights)
    nk, dk, E = hp.ssm_n_group, hp.ssm_d_state, hp.n_embd
    rdv = hp.ssm_d_inner // nk
    for layer in (0, 1):  # legacy GDN layout: raw in_proj_qkvz grouped per key head
        p = f"blk.{layer}"
        q, k, v = variant.pop(f"{p}.attn_qkv.weight").split([nk * dk, nk * dk, nk * rdv])
        z = variant.pop(f"{p}.attn_gate.weight")
        groups = [x.reshape(nk, -1, E) for x in (q, k, v, z)]
        variant[f"{p}.ssm_in.weight"] = torch.cat(groups, dim=1).reshape(-1, E)
    p = "blk.2"
    variant[f"{p}.ffn_gate_up_exps.weight"] = torch.cat(
        [variant.pop(f"{p}.ffn_gate_exps.weight"), variant.pop(f"{p}.ffn_up_exps.weight")], dim=1)
    loaded = load_dense_weights(GGUFFile(_write(tmp_path / "legacy.gguf", hp, variant)), "cpu", True)
    for name in weights:
        assert torch.equal(loaded[name], weights[name]), name


def test_missing_and_misshapen_tensors_are_one_line_errors(next_model, tmp_path):
    hp, weights = next_model
    missing = {n: t for n, t in weights.items() if n != "blk.1.ssm_a"}
    with pytest.raises(ModelFormatError, match=r"^missing tensor blk\.1\.ssm_a$"):
        load_dense_weights(GGUFFile(_write(tmp_path / "a.gguf", hp, missing)), "cpu", True)
    bad = dict(weights)
    bad["blk.0.ssm_norm.weight"] = torch.ones(hp.ssm_head_v_dim + 1)
    with pytest.raises(ModelFormatError, match="blk.0.ssm_norm.weight has shape"):
        load_dense_weights(GGUFFile(_write(tmp_path / "b.gguf", hp, bad)), "cpu", True)


def test_loaded_tensors_are_writable_float32(next_model, tmp_path):
    hp, weights = next_model
    file = GGUFFile(_write(tmp_path / "c.gguf", hp, weights))
    t = load_dense_weights(file, "cpu", False)["blk.3.attn_q.weight"]
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    t[0, 0] = 123.0  # its own memory, not the file's read-only map
    assert not np.shares_memory(t.numpy(), file.tensor("blk.3.attn_q.weight").data)
    again = load_dense_weights(file, "cpu", False)["blk.3.attn_q.weight"]
    assert torch.equal(again, weights["blk.3.attn_q.weight"])


def test_dense_q8_0_kept_quantized_gives_the_dequantized_bits(next_model, tmp_path):
    """quantized=True keeps Q8_0 matrices as Q8Weight (what CUDA loads): on the CPU ops.linear and
    ops.embedding dequantize them, so the logits equal the float32 load's bit for bit, MTP head included."""
    from strata_ray.kernels.dense_q8 import Q8Weight
    from strata_ray.model.weights import ROW_GROUPS, keeps_q8

    hp, weights = next_model
    types = {n: T.Q8_0 for n, t in weights.items()
             if t.dim() == 2 and t.shape[0] > 1 and t.shape[-1] % 32 == 0 and "_exps" not in n
             and "ffn_gate_inp" not in n}
    assert "token_embd.weight" in types and "blk.0.attn_qkv.weight" in types
    file = GGUFFile(_write(tmp_path / "q8.gguf", hp, weights, types))
    flat = load_dense_weights(file, "cpu", include_experts=True)
    q8 = load_dense_weights(file, "cpu", include_experts=True, quantized=True)
    kept = {n for n, t in q8.items() if isinstance(t, Q8Weight)}
    assert kept == {n for n in types if keeps_q8(n, file.tensor(n))} and "token_embd.weight" in kept
    for n in kept:
        assert torch.equal(q8[n].dequantize(), flat[n]), n
    # the matrices a layer applies to one input are views of one matrix (one GEMV in a decode step)
    for layer in range(hp.n_layer):
        for group in ROW_GROUPS:
            ws = [q8.get(f"blk.{layer}.{n}.weight") for n in group]
            if all(isinstance(w, Q8Weight) for w in ws):
                assert len({id(w.fused[0]) for w in ws}) == 1, (layer, group)
    assert q8["blk.0.attn_qkv.weight"].fused is not None  # a GDN layer's q k v | z | b a
    _assert_same_logits(Model(hp, flat), Model(hp, q8))


@pytest.mark.parametrize("dense_type", ["Q4_K", "Q6_K"])
def test_dense_k_quants_kept_quantized_give_the_dequantized_bits(tmp_path, dense_type):
    """A Q4_K_M-like file (synth --dense-type): quantized=True keeps its Q4_K / Q6_K matrices as
    ScaledWeights (what CUDA loads); on the CPU ops.linear and ops.embedding take the file's values, so the
    logits equal the float32 load's bit for bit, MTP head included."""
    from strata_ray.kernels.dense_scaled import ScaledWeight
    from strata_ray.model.synth import write_synth
    from strata_ray.model.weights import keeps_scaled

    path = tmp_path / "k.gguf"
    write_synth(path, arch="qwen3next", preset="tiny", layers=2, expert_type="Q4_0", progress=False,
                dense_type=dense_type)
    file = GGUFFile(path)
    kinds = {n: info.ggml_type for n, info in file.tensors.items()}
    assert kinds["token_embd.weight"] == T.Q8_0 and kinds["blk.0.attn_qkv.weight"] == T[dense_type]
    flat = load_dense_weights(file, "cpu", include_experts=True)
    kept = load_dense_weights(file, "cpu", include_experts=True, quantized=True)
    scaled = {n for n, t in kept.items() if isinstance(t, ScaledWeight)}
    assert scaled == {n for n in kinds if keeps_scaled(n, file.tensor(n))}
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_gate_shexp.weight", "output.weight"} <= scaled
    for n in scaled:
        assert torch.equal(kept[n].dequantize(), flat[n]), n
    assert kept["blk.0.ffn_gate_shexp.weight"].fused is not None  # gate | up: one GEMV in a decode step
    hp = file.hparams
    _assert_same_logits(Model(hp, flat), Model(hp, kept))


def test_k_quant_dense_without_the_cuda_gemv_is_warned_once_on_cuda(tmp_path, monkeypatch, caplog):
    """Q4_K / Q6_K matrices kept quantized have no Triton GEMV: on CUDA without the CUDA C one (cupy missing,
    STRATA_DENSE_CUDA=0) every decode step dequantizes them, which the load says in one warning. Q8_0 alone,
    the CPU, or the GEMV on: nothing."""
    import strata_ray.kernels.dense_q8_cuda as dense_q8_cuda
    from strata_ray.kernels.dense_scaled import ScaledWeight
    from strata_ray.model.synth import write_synth
    from strata_ray.model.weights import warn_without_scaled_gemv

    path = tmp_path / "k.gguf"
    write_synth(path, arch="qwen3next", preset="tiny", layers=2, expert_type="Q4_0", progress=False,
                dense_type="Q4_K")
    kept = load_dense_weights(GGUFFile(path), "cpu", include_experts=False, quantized=True)
    q8_only = {n: w for n, w in kept.items() if not isinstance(w, ScaledWeight)}
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for gemv_on in (False, True):
        monkeypatch.setattr(dense_q8_cuda, "cuda_gemv_on", lambda on=gemv_on: on)
        with caplog.at_level("WARNING", logger="strata_ray.model"):
            caplog.clear()
            assert warn_without_scaled_gemv(kept, cuda) is not gemv_on
            assert not warn_without_scaled_gemv(kept, cpu) and not warn_without_scaled_gemv(q8_only, cuda)
        assert (len(caplog.records) == 1 and "Q4_K / Q6_K dense matrices" in caplog.text) is not gemv_on
