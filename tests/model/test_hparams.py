"""HParams.from_fields: both archs round-trip through hparams_fields; bad values are one-line errors."""

import re

import pytest

from strata_ray.model.gguf_writer import hparams_fields
from strata_ray.model.hparams import HParams, ModelFormatError
from strata_ray.model.synth_presets import preset_hparams


@pytest.mark.parametrize("arch", ["qwen3next", "qwen3moe"])
def test_round_trip(arch):
    hp = preset_hparams(arch, "tiny")
    assert HParams.from_fields(hparams_fields(hp)) == hp


def _refused(key, value) -> str:
    fields = hparams_fields(preset_hparams("qwen3next", "tiny"))
    fields.pop("qwen3next.attention.recurrent_layers")  # so that full_attention_interval is read
    fields[f"qwen3next.{key}"] = value
    with pytest.raises(ModelFormatError) as e:
        HParams.from_fields(fields)
    return str(e.value)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("attention.head_count", 0, "attention.head_count is 0; it must be positive"),
        ("embedding_length", "64", "embedding_length is '64', not a number"),
        ("expert_count", [[8]], "expert_count is [8], not a number"),
        ("block_count", [], "block_count varies per layer; not supported"),
        ("full_attention_interval", 0, "full_attention_interval is 0; it must be positive"),
        ("ssm.group_count", 0, "ssm.group_count is 0; it must be positive"),
        ("expert_used_count", 1000, "expert_used_count is 1000, more than the"),
        ("context_length", 0, "context_length is 0; it must be positive"),
        ("rope.dimension_count", 65, "rope.dimension_count is 65; a head has 64 dims"),
    ],
)
def test_bad_values_are_one_line_errors(key, value, message):
    assert re.match(re.escape(f"GGUF key qwen3next.{message}"), _refused(key, value))


def test_nextn_layers_must_leave_a_trunk():
    blocks = preset_hparams("qwen3next", "tiny").block_count
    msg = _refused("nextn_predict_layers", blocks)
    assert msg == f"GGUF key qwen3next.nextn_predict_layers is {blocks}: no trunk left of {blocks} blocks"


def test_a_file_without_an_architecture_key_is_told_so():
    fields = hparams_fields(preset_hparams("qwen3moe", "tiny"))
    fields.pop("general.architecture", None)
    with pytest.raises(ModelFormatError) as e:
        HParams.from_fields(fields)
    assert str(e.value) == "missing GGUF key general.architecture"  # was "unsupported ... architecture None"
