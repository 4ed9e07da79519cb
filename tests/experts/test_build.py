"""load_tiered_model: float experts keep the plain float path (no tiers) on the file it opened."""

import gguf
import pytest
import torch

from strata_ray.config import EngineConfig
from strata_ray.experts.build import load_tiered_model
from strata_ray.model.gguf_writer import ModelWriter, byte_level_tokenizer_spec
from strata_ray.model.loader import load_model
from tests.model import hf_reference as ref


def float_experts_file(path):
    """A tiny qwen3moe from transformers with every tensor F32 (so float experts: no tiers)."""
    hf_model = ref.tiny_qwen3moe(seed=1)
    hp = ref.hparams_of(hf_model)
    mw = ModelWriter(path, hp, byte_level_tokenizer_spec().padded(hp.n_vocab))
    for name, t in ref.gguf_weights(hf_model).items():
        a = t.numpy()
        mw.add(name, a.shape, gguf.GGMLQuantizationType.F32, lambda a=a: a)
    mw.write()
    return path


def test_float_experts_load_without_tiers(tmp_path):
    path = float_experts_file(tmp_path / "float.gguf")
    loaded, tiers = load_tiered_model(EngineConfig(model=str(path), device="cpu"), "cpu")
    assert tiers is None
    assert loaded.path == path and loaded.file.path == path
    plain = load_model(path)
    prompt = ref.random_prompt(12)
    with torch.inference_mode():
        got = loaded.model.forward(prompt, loaded.model.new_state())
        want = plain.model.forward(prompt, plain.model.new_state())
    assert torch.equal(got, want)


def test_auto_pinning_leaves_memory_for_everything_else():
    from strata_ray.experts.build import auto_pin_gib
    from strata_ray.experts.prefault import SPARE_LEAVE_GIB, available_memory

    gib = auto_pin_gib()
    assert 0.0 <= gib <= max(0.0, available_memory() / 2**30 - SPARE_LEAVE_GIB + 1e-6)


def test_ring_slots_fill_ring_bytes_within_bounds(monkeypatch):
    from strata_ray.experts.build import RING_BYTES, RING_SLOTS, ring_slots

    monkeypatch.delenv("STRATA_RING_SLOTS", raising=False)
    assert ring_slots(False, 1_769_472, 512) == RING_SLOTS  # no overlap: the plain ring
    assert ring_slots(True, 1_769_472, 512) == 606  # 80b-a3b blobs: what RING_BYTES holds, even
    big = ring_slots(True, 10 << 20, 128)  # a 10 MiB blob
    assert big == 102 and big * (10 << 20) <= RING_BYTES
    assert ring_slots(True, 1 << 20, 128) == 256  # at most a layer's experts a half
    assert ring_slots(True, 1 << 30, 512) == 32  # never fewer than two halves of 16
    assert ring_slots(True, 4096, 8) == 32  # a tiny model: two halves of its 8 experts, at least 32
    monkeypatch.setenv("STRATA_RING_SLOTS", "6")
    assert ring_slots(True, 1_769_472, 512) == 6
    from strata_ray.config import ConfigError, config_from_args
    from strata_ray.run import build_generate_parser

    for bad in ("7", "0", "x", "+4", " 4", "1_0", "\u00b2"):  # refused by config before Ray starts, and here
        # alike ('\u00b2' is a digit to str.isdigit(), not to int(): the line says what is allowed)
        monkeypatch.setenv("STRATA_RING_SLOTS", bad)
        with pytest.raises(ConfigError, match="STRATA_RING_SLOTS"):
            ring_slots(True, 1_769_472, 512)
        with pytest.raises(ConfigError, match=r"STRATA_RING_SLOTS: .*\(allowed: an even count >= 2\)$"):
            config_from_args(build_generate_parser().parse_args([]), {"STRATA_RING_SLOTS": bad})
    monkeypatch.setenv("STRATA_RING_SLOTS", "")  # empty: unset, as config reads it
    assert ring_slots(True, 1 << 30, 512) == 32


def test_the_ring_is_lent_where_the_cache_holds_some_experts_but_not_with_it_all():
    from types import SimpleNamespace

    from strata_ray.experts.build import loan_slots

    hp = SimpleNamespace(n_layer=4, n_expert=16)  # 64 pairs
    on, off = EngineConfig(model="m"), EngineConfig(model="m", ring_loan=False)
    assert loan_slots(on, 10, 32, hp) == 32
    assert loan_slots(off, 10, 32, hp) == 0
    assert loan_slots(on, 0, 32, hp) == 0  # --expert-cache 0: every expert on the CPU, as asked
    assert loan_slots(on, 32, 32, hp) == 0  # the two hold every pair: no all-resident switch
    assert loan_slots(on, 31, 32, hp) == 32 and loan_slots(on, 10, 0, hp) == 0


def test_tier_flags_on_float_experts_are_named_as_unused(tmp_path, capsys):
    """run / serve check the file before Ray starts: tier flags on a model without tiers get one line."""
    from strata_ray.run import check_model_file

    path = str(float_experts_file(tmp_path / "float.gguf"))
    check_model_file(EngineConfig(model=path))
    assert capsys.readouterr().err == ""
    check_model_file(EngineConfig(model=path, expert_cache=4, expert_profile_save=str(tmp_path / "p.strp")))
    assert capsys.readouterr().err == (
        "strata_ray: float.gguf: its routed experts are not all Q8_0 / Q4_0 / Q4_K / Q6_K, so they load with "
        "the dense weights and have no tiers: --expert-cache, --expert-profile-save have no effect\n")
