from dataclasses import replace

import gguf
import numpy as np
import pytest

from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.gguf_writer import ModelWriter, _add_field, byte_level_tokenizer_spec
from strata_ray.model.hparams import ModelFormatError
from strata_ray.model.synth import synth_type
from strata_ray.model.synth_presets import preset_hparams
from strata_ray.model.tensor_layout import check_tensors, is_expert_tensor, keeps_float, tensor_layout

T = gguf.GGMLQuantizationType


def _names(hp):
    return dict(tensor_layout(hp))


@pytest.mark.parametrize(
    ("arch", "preset"), [("qwen3next", "tiny"), ("qwen3moe", "tiny"), ("qwen3next", "80b-a3b")]
)
def test_names_are_unique(arch, preset):
    layout = tensor_layout(preset_hparams(arch, preset))
    assert len({n for n, _ in layout}) == len(layout)


def test_qwen3next_80b_counts_match_real_files():
    hp = preset_hparams("qwen3next", "80b-a3b")
    # model-format §2.5: a real 80B-A3B file without MTP holds 843 tensors
    assert len(tensor_layout(replace(hp, n_nextn=0))) == 843
    mtp = [n for n, _ in tensor_layout(hp) if n.startswith("blk.48.")]
    assert len(mtp) == 20
    assert not any(n.startswith("blk.49.") for n, _ in tensor_layout(hp))


def test_qwen3next_80b_shapes():
    t = _names(preset_hparams("qwen3next", "80b-a3b"))
    assert t["token_embd.weight"] == (151936, 2048)
    # layer 0 is Gated DeltaNet, layer 3 full attention
    assert t["blk.0.attn_qkv.weight"] == (8192, 2048)
    assert t["blk.0.attn_gate.weight"] == (4096, 2048)
    assert t["blk.0.ssm_ba.weight"] == (64, 2048)
    assert t["blk.0.ssm_conv1d.weight"] == (8192, 4)
    assert t["blk.0.ssm_a"] == (32,) and t["blk.0.ssm_dt.bias"] == (32,)
    assert t["blk.0.ssm_norm.weight"] == (128,)
    assert t["blk.0.ssm_out.weight"] == (2048, 4096)
    assert "blk.0.attn_q.weight" not in t and "blk.3.attn_qkv.weight" not in t
    assert t["blk.3.attn_q.weight"] == (8192, 2048)  # query + gate per head
    assert t["blk.3.attn_k.weight"] == (512, 2048)
    assert t["blk.3.attn_output.weight"] == (2048, 4096)
    assert t["blk.3.attn_q_norm.weight"] == (256,)
    assert t["blk.5.ffn_gate_exps.weight"] == (512, 512, 2048)
    assert t["blk.5.ffn_down_exps.weight"] == (512, 2048, 512)
    assert t["blk.5.ffn_gate_inp.weight"] == (512, 2048)
    assert t["blk.5.ffn_gate_inp_shexp.weight"] == (2048,)
    assert t["blk.5.ffn_down_shexp.weight"] == (2048, 512)
    assert "blk.5.post_attention_norm.weight" in t and "blk.5.ffn_norm.weight" not in t


def test_qwen3next_mtp_block():
    t = _names(preset_hparams("qwen3next", "tiny"))
    L, E = 4, 256
    assert t[f"blk.{L}.nextn.eh_proj.weight"] == (E, 2 * E)
    for n in ("enorm", "hnorm", "shared_head_norm"):
        assert t[f"blk.{L}.nextn.{n}.weight"] == (E,)
    assert f"blk.{L}.attn_q.weight" in t and f"blk.{L}.attn_qkv.weight" not in t  # full attention
    assert f"blk.{L}.ffn_up_exps.weight" in t and f"blk.{L}.ffn_up_shexp.weight" in t


def test_qwen3moe_30b_layout():
    hp = preset_hparams("qwen3moe", "30b-a3b")
    t = _names(hp)
    assert len(t) == 3 + 48 * 12
    assert t["blk.0.attn_q.weight"] == (4096, 2048)
    assert t["blk.0.attn_k.weight"] == (512, 2048)
    assert t["blk.0.attn_output.weight"] == (2048, 4096)
    assert t["blk.47.ffn_gate_exps.weight"] == (128, 768, 2048)
    assert t["blk.47.ffn_down_exps.weight"] == (128, 2048, 768)
    assert "blk.0.ffn_norm.weight" in t and "blk.0.post_attention_norm.weight" not in t
    assert not any("shexp" in n or "ssm" in n or "nextn" in n for n in t)


def test_layers_override_keeps_mtp_after_trunk():
    t = _names(preset_hparams("qwen3next", "80b-a3b", layers=2))
    assert (
        "blk.1.attn_qkv.weight" in t
        and "blk.2.nextn.eh_proj.weight" in t
        and "blk.3.attn_norm.weight" not in t
    )


def test_float_and_expert_rules():
    assert keeps_float("blk.0.attn_norm.weight", (64,))
    assert keeps_float("blk.0.ffn_gate_inp.weight", (8, 64))
    assert keeps_float("blk.0.ssm_conv1d.weight", (256, 4))
    assert keeps_float("blk.0.ssm_a", (4,)) and keeps_float("blk.0.ssm_dt.bias", (4,))
    assert keeps_float("blk.4.nextn.enorm.weight", (64,))
    assert not keeps_float("blk.0.attn_qkv.weight", (256, 64))
    assert not keeps_float("blk.4.nextn.eh_proj.weight", (64, 128))
    assert is_expert_tensor("blk.0.ffn_down_exps.weight")
    assert not is_expert_tensor("blk.0.ffn_down_shexp.weight")


# ---- check_tensors: a GGUF's tensors against the layout, from its header ----------------------------------


def layout_tensors(hp, expert_type=T.Q4_K) -> dict[str, tuple[tuple[int, ...], int]]:
    """{name: (numpy shape, ggml type)} of every tensor of hp, typed as synth types them."""
    return {name: (shape, synth_type(name, shape, expert_type)) for name, shape in tensor_layout(hp)}


def write_header(path, hp, tensors) -> GGUFFile:
    """A GGUF with hp's keys and `tensors` ({name: (numpy shape, ggml type)}, zero bytes), written by the
    gguf library: it writes any ggml type, where the repo's writer stops at those the engine runs."""
    fields = ModelWriter(path, hp, byte_level_tokenizer_spec().padded(hp.n_vocab)).fields()
    w = gguf.GGUFWriter(str(path), hp.arch)
    for key, value in fields.items():
        if key != "general.architecture":
            _add_field(w, key, value)
    for name, (shape, t) in tensors.items():
        elems, size = gguf.GGML_QUANT_SIZES[T(t)]
        w.add_tensor(name, np.zeros((*shape[:-1], shape[-1] // elems * size), np.uint8), raw_dtype=T(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


def refusal(tmp_path, hp, tensors) -> str:
    f = write_header(tmp_path / "m.gguf", hp, tensors)
    with pytest.raises(ModelFormatError) as e:
        check_tensors(f.hparams, f.tensors)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("arch", ["qwen3next", "qwen3moe"])
@pytest.mark.parametrize("expert_type", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.F16, T.BF16, T.F32],
                         ids=lambda t: t.name)
def test_every_file_the_engine_runs_passes(tmp_path, arch, expert_type):
    hp = preset_hparams(arch, "tiny")
    f = write_header(tmp_path / "m.gguf", hp, layout_tensors(hp, expert_type))
    check_tensors(f.hparams, f.tensors)


def test_fused_and_legacy_forms_and_a_tied_output_pass(tmp_path):
    """The forms the loaders split (weights.load_dense_weights, the expert stores) stand for their parts."""
    hp = preset_hparams("qwen3next", "tiny")
    t = layout_tensors(hp)
    E, X, n_ff = hp.n_embd, hp.n_expert, hp.n_ff_exp
    del t["output.weight"]  # tied to token_embd
    assert hp.is_recurrent(0) and not hp.is_recurrent(3)
    del t["blk.0.attn_qkv.weight"], t["blk.0.attn_gate.weight"]
    t["blk.0.ssm_in.weight"] = ((2 * hp.ssm_n_group * hp.ssm_d_state + 2 * hp.ssm_d_inner, E), T.Q8_0)
    q_rows = t.pop("blk.3.attn_q.weight")[0][0]
    kv_rows = t.pop("blk.3.attn_k.weight")[0][0] + t.pop("blk.3.attn_v.weight")[0][0]
    t["blk.3.attn_qkv.weight"] = ((q_rows + kv_rows, E), T.Q8_0)
    del t["blk.1.ffn_gate_exps.weight"], t["blk.1.ffn_up_exps.weight"]
    t["blk.1.ffn_gate_up_exps.weight"] = ((X, 2 * n_ff, E), T.Q4_K)
    t["blk.2.ffn_gate_inp_shexp.weight"] = ((1, E), T.F32)
    f = write_header(tmp_path / "m.gguf", hp, t)
    check_tensors(f.hparams, f.tensors)

    t["blk.1.ffn_gate_up_exps.weight"] = ((X, n_ff, E), T.Q4_K)  # only one half
    assert refusal(tmp_path, hp, t) == (f"tensor blk.1.ffn_gate_up_exps.weight has shape {[X, n_ff, E]}, "
                                        f"expected {[X, 2 * n_ff, E]}")


def test_a_missing_expert_stack_is_named(tmp_path):
    """It showed as `strata:primary failed: KeyError: 2` after Ray and the load."""
    hp = preset_hparams("qwen3moe", "tiny")
    t = layout_tensors(hp)
    del t["blk.2.ffn_gate_exps.weight"]
    assert refusal(tmp_path, hp, t) == "missing tensor blk.2.ffn_gate_exps.weight"


def test_an_expert_stack_of_another_count_is_refused(tmp_path):
    """Six experts in one stack of an eight-expert model: the model ran, reading past the stack."""
    hp = preset_hparams("qwen3moe", "tiny")
    t = layout_tensors(hp)
    shape, kind = t["blk.1.ffn_up_exps.weight"]
    t["blk.1.ffn_up_exps.weight"] = ((6, *shape[1:]), kind)
    assert refusal(tmp_path, hp, t) == (f"tensor blk.1.ffn_up_exps.weight has shape {[6, *shape[1:]]}, "
                                        f"expected {list(shape)}")


def test_hparams_that_contradict_the_tensors_are_refused(tmp_path):
    hp = preset_hparams("qwen3moe", "tiny")
    t = layout_tensors(hp)
    more = replace(hp, n_expert=16)
    assert refusal(tmp_path, more, t) == ("tensor blk.0.ffn_gate_inp.weight has shape [8, 256], "
                                          "expected [16, 256]")
    fewer = replace(hp, n_layer=3)  # the fourth layer's tensors were skipped without a word
    assert refusal(tmp_path, fewer, t) == "tensor blk.3.attn_norm.weight lies past the 3 blocks of " \
                                          "qwen3moe.block_count"
    deeper = replace(hp, n_layer=6)
    assert refusal(tmp_path, deeper, t) == "missing tensor blk.4.attn_norm.weight"


def test_types_the_engine_does_not_run_are_refused_from_the_header(tmp_path):
    """Before, the first such tensor failed once it was dequantized in the primary, after Ray started."""
    hp = preset_hparams("qwen3moe", "tiny")
    t = layout_tensors(hp)
    runs = "F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K"
    one = dict(t, **{"blk.2.ffn_down_exps.weight": (t["blk.2.ffn_down_exps.weight"][0], T.Q5_0)})
    assert refusal(tmp_path, hp, one) == (f"tensor blk.2.ffn_down_exps.weight is Q5_0, a type this engine "
                                          f"does not run (it runs {runs})")
    many = {n: (shape, T.IQ4_XS if n.endswith("down_exps.weight") else T.Q5_K if is_expert_tensor(n) else k)
            for n, (shape, k) in t.items()}
    assert refusal(tmp_path, hp, many) == (f"12 tensors are IQ4_XS / Q5_K, which this engine does not run "
                                           f"(the first: blk.0.ffn_gate_exps.weight; it runs {runs})")
