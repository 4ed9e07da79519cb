from dataclasses import replace

import pytest

from strata_ray.model.synth_presets import preset_hparams
from strata_ray.model.tensor_layout import is_expert_tensor, keeps_float, tensor_layout


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
