"""--prefill auto and the prompt chunk's memory, which the CUDA expert cache leaves free."""

from dataclasses import replace

from strata_ray.config import EngineConfig
from strata_ray.engine.prefill import PREFILL_CPU, PREFILL_CUDA, chunk_bytes, prefill_chunk
from strata_ray.model.ops import ATTENTION_MAX_SCORES
from strata_ray.model.synth_presets import preset_hparams


def test_auto_chunk_per_device_and_the_flag_wins():
    cfg = EngineConfig()
    assert prefill_chunk(cfg, "cpu") == PREFILL_CPU == 512
    assert prefill_chunk(cfg, "cuda") == PREFILL_CUDA == 4096
    assert prefill_chunk(replace(cfg, prefill=1024), "cuda") == 1024
    assert prefill_chunk(replace(cfg, prefill=8192), "cpu") == 8192


def test_chunk_bytes_of_the_80b_grow_with_the_chunk():
    hp = preset_hparams("qwen3next", "80b-a3b")
    fixed = 3 * ATTENTION_MAX_SCORES * 4  # one query block of scores
    per_token = (chunk_bytes(hp, 2048) - chunk_bytes(hp, 1024)) / 1024
    assert chunk_bytes(hp, 0) == fixed
    # 10 routed rows twice (rows + kernel output) of 2048 floats dominate: 160 KB; all in ~360 KB a token
    assert 300_000 < per_token < 420_000
    assert 1.5e9 < chunk_bytes(hp, 4096) < 2.0e9  # what auto keeps free on CUDA besides the reserve
