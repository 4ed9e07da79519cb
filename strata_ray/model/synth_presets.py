"""Model shapes for `synth`: test sizes and the real Qwen3-30B-A3B / Qwen3-Next-80B-A3B shapes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .hparams import HParams

ARCHS = ("qwen3next", "qwen3moe")
PRESETS = ("tiny", "small", "30b-a3b", "80b-a3b")
MAX_LAYERS = 1024  # --layers' bound: the real families have 48-94 layers
FULL_ATTENTION_INTERVAL = 4  # qwen3next: layer i is full attention iff (i + 1) % 4 == 0

# values as stored in the file (float32), so HParams read back from the GGUF compare equal
RMS_EPS = float(np.float32(1e-6))


class SynthError(Exception):
    """A bad synth request (preset, arch, flag). The message is one line."""


def recurrent_pattern(n_layer: int, interval: int = FULL_ATTENTION_INTERVAL) -> tuple[bool, ...]:
    return tuple((i + 1) % interval != 0 for i in range(n_layer))


def _next(**kw) -> HParams:
    n_layer = kw.pop("n_layer")
    return HParams(
        arch="qwen3next",
        n_layer=n_layer,
        recurrent=recurrent_pattern(n_layer),
        rms_eps=RMS_EPS,
        **kw,
    )


def _moe(**kw) -> HParams:
    return HParams(arch="qwen3moe", n_nextn=0, n_ff_shexp=0, rms_eps=RMS_EPS, **kw)


# Row widths are multiples of 256 everywhere so every preset can hold K-quant experts (Q4_K / Q6_K blocks).
# fmt: off
_PRESETS: dict[tuple[str, str], HParams] = {
    ("qwen3next", "tiny"): _next(
        n_vocab=288, n_embd=256, n_layer=4, n_nextn=1, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
        n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, rope_freq_base=1e7, context_length=4096,
        ssm_conv_kernel=4, ssm_d_state=32, ssm_n_group=2, ssm_dt_rank=4, ssm_d_inner=128,
    ),
    ("qwen3moe", "tiny"): _moe(
        n_vocab=288, n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_rot=64,
        n_expert=8, n_expert_used=2, n_ff_exp=256, rope_freq_base=1e6, context_length=4096,
    ),
    ("qwen3next", "small"): _next(
        n_vocab=2048, n_embd=512, n_layer=8, n_nextn=1, n_head=8, n_head_kv=2, head_dim=128, n_rot=32,
        n_expert=64, n_expert_used=4, n_ff_exp=256, n_ff_shexp=256, rope_freq_base=1e7, context_length=32768,
        ssm_conv_kernel=4, ssm_d_state=64, ssm_n_group=4, ssm_dt_rank=8, ssm_d_inner=512,
    ),
    ("qwen3moe", "small"): _moe(
        n_vocab=2048, n_embd=512, n_layer=8, n_head=8, n_head_kv=2, head_dim=64, n_rot=64,
        n_expert=64, n_expert_used=4, n_ff_exp=256, rope_freq_base=1e6, context_length=32768,
    ),
    ("qwen3moe", "30b-a3b"): _moe(
        n_vocab=151936, n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128, n_rot=128,
        n_expert=128, n_expert_used=8, n_ff_exp=768, rope_freq_base=1e6, context_length=40960,
    ),
    ("qwen3next", "80b-a3b"): _next(
        n_vocab=151936, n_embd=2048, n_layer=48, n_nextn=1, n_head=16, n_head_kv=2, head_dim=256, n_rot=64,
        n_expert=512, n_expert_used=10, n_ff_exp=512, n_ff_shexp=512, rope_freq_base=1e7,
        context_length=262144, ssm_conv_kernel=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32,
        ssm_d_inner=4096,
    ),
}
# fmt: on


def preset_arch(preset: str) -> str | None:
    """The arch a real-shape preset implies (None for tiny/small, which exist for both)."""
    archs = [a for a in ARCHS if (a, preset) in _PRESETS]
    return archs[0] if len(archs) == 1 else None


def preset_hparams(arch: str | None, preset: str, layers: int | None = None) -> HParams:
    """HParams of a preset; layers overrides the trunk depth (MTP layer kept)."""
    if preset not in PRESETS:
        raise SynthError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    implied = preset_arch(preset)
    arch = arch or implied
    if arch is None:
        raise SynthError(f"preset {preset} needs --arch ({' or '.join(ARCHS)})")
    if arch not in ARCHS:
        raise SynthError(f"unknown arch {arch!r} (choose from {', '.join(ARCHS)})")
    if (arch, preset) not in _PRESETS:
        raise SynthError(f"preset {preset} is a {implied} shape; use --arch {implied}")
    hp = _PRESETS[(arch, preset)]
    if layers is not None:
        if not 1 <= layers <= MAX_LAYERS:  # a huge count built its tensor list for minutes before any check
            raise SynthError(f"--layers must be from 1 to {MAX_LAYERS} (got {layers})")
        hp = replace(hp, n_layer=layers, recurrent=recurrent_pattern(layers) if hp.recurrent else ())
    return hp
