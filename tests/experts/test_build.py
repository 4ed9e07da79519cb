"""load_tiered_model: float experts keep the plain float path (no tiers) on the file it opened."""

import gguf
import torch

from strata_ray.config import EngineConfig
from strata_ray.experts.build import load_tiered_model
from strata_ray.model.gguf_writer import ModelWriter, byte_level_tokenizer_spec
from strata_ray.model.loader import load_model
from tests.model import hf_reference as ref


def test_float_experts_load_without_tiers(tmp_path):
    hf_model = ref.tiny_qwen3moe(seed=1)
    hp = ref.hparams_of(hf_model)
    path = tmp_path / "float.gguf"
    mw = ModelWriter(path, hp, byte_level_tokenizer_spec().padded(hp.n_vocab))
    for name, t in ref.gguf_weights(hf_model).items():
        a = t.numpy()
        mw.add(name, a.shape, gguf.GGMLQuantizationType.F32, lambda a=a: a)
    mw.write()

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
    from strata_ray.experts.build import PIN_LEAVE_GIB, auto_pin_gib
    from strata_ray.experts.prefault import available_memory

    gib = auto_pin_gib()
    assert 0.0 <= gib <= max(0.0, available_memory() / 2**30 - PIN_LEAVE_GIB + 1e-6)
