"""Model hyperparameters, read only from the GGUF (never from defaults that the file should carry)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHS = ("qwen3next", "qwen3moe")


class ModelFormatError(Exception):
    """A model file this engine cannot run. The message is one line meant for the user."""


@dataclass(frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int  # trunk layers = block_count - nextn_predict_layers
    n_nextn: int  # MTP/nextn layers stored after the trunk (0 when absent)
    n_head: int
    n_head_kv: int
    head_dim: int  # attention.key_length
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int  # 0 for qwen3moe (no shared expert)
    rms_eps: float
    rope_freq_base: float
    n_rot: int  # rotary dims (partial rotary for qwen3next)
    context_length: int
    # Gated DeltaNet (qwen3next only; zeros for qwen3moe)
    ssm_conv_kernel: int = 0
    ssm_d_state: int = 0  # dk = dv
    ssm_n_group: int = 0  # nk (key heads)
    ssm_dt_rank: int = 0  # nv (value heads)
    ssm_d_inner: int = 0  # nv * dv
    # per trunk layer: True = Gated DeltaNet (recurrent), False = full attention
    recurrent: tuple[bool, ...] = ()

    @property
    def block_count(self) -> int:
        return self.n_layer + self.n_nextn

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent) and self.recurrent[layer]

    @property
    def has_mtp(self) -> bool:
        return self.n_nextn > 0

    @property
    def ssm_head_v_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_dt_rank if self.ssm_dt_rank else 0

    @staticmethod
    def from_fields(fields: Mapping[str, Any]) -> HParams:
        """Build from GGUF key/values (python values). Raises ModelFormatError naming a missing key."""
        arch = fields.get("general.architecture")
        if arch is None:  # was "unsupported model architecture None"
            raise ModelFormatError("missing GGUF key general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ModelFormatError(
                f"unsupported model architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )

        def need(key: str) -> Any:
            """The key's number (a per-layer array must be uniform); ModelFormatError otherwise."""
            full = f"{arch}.{key}"
            if full not in fields:
                raise ModelFormatError(f"missing GGUF key {full}")
            v = fields[full]
            if isinstance(v, (list, tuple)):  # per-layer arrays: engine needs them uniform
                if not v or any(x != v[0] for x in v):
                    raise ModelFormatError(f"GGUF key {full} varies per layer; not supported")
                v = v[0]
            if not isinstance(v, (int, float)):
                raise ModelFormatError(f"GGUF key {full} is {v!r}, not a number")
            return v

        def opt(key: str, default: Any) -> Any:
            return need(key) if f"{arch}.{key}" in fields else default

        def positive(key: str) -> int:
            v = int(need(key))
            if v <= 0:
                raise ModelFormatError(f"GGUF key {arch}.{key} is {v}; it must be positive")
            return v

        block_count = positive("block_count")
        n_nextn = int(opt("nextn_predict_layers", 0))
        n_layer = block_count - n_nextn
        if not 0 <= n_nextn < block_count:
            raise ModelFormatError(
                f"GGUF key {arch}.nextn_predict_layers is {n_nextn}: no trunk left of {block_count} blocks"
            )
        n_embd = positive("embedding_length")
        n_head = positive("attention.head_count")
        head_dim = int(opt("attention.key_length", n_embd // n_head))
        tokens = fields.get("tokenizer.ggml.tokens")
        n_vocab = int(opt("vocab_size", len(tokens) if tokens is not None else 0))
        if n_vocab <= 0:
            raise ModelFormatError("missing GGUF key tokenizer.ggml.tokens (vocabulary)")

        common = dict(
            arch=arch,
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            n_nextn=n_nextn,
            n_head=n_head,
            n_head_kv=positive("attention.head_count_kv"),
            head_dim=head_dim,
            n_expert=positive("expert_count"),
            n_expert_used=positive("expert_used_count"),
            n_ff_exp=positive("expert_feed_forward_length"),
            n_ff_shexp=int(opt("expert_shared_feed_forward_length", 0)),
            rms_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_freq_base=float(opt("rope.freq_base", 10000.0)),
            n_rot=int(opt("rope.dimension_count", head_dim)),
            context_length=positive("context_length"),  # 0 failed every prompt, after the load
        )
        if not 0 <= common["n_rot"] <= head_dim:  # more rotary dims than a head has failed in the first step
            raise ModelFormatError(
                f"GGUF key {arch}.rope.dimension_count is {common['n_rot']}; a head has {head_dim} dims"
            )
        if common["n_expert_used"] > common["n_expert"]:
            raise ModelFormatError(
                f"GGUF key {arch}.expert_used_count is {common['n_expert_used']}, more than the "
                f"{common['n_expert']} experts"
            )
        if arch == "qwen3moe":
            return HParams(**common)

        if f"{arch}.attention.recurrent_layers" in fields:
            rec = tuple(bool(x) for x in fields[f"{arch}.attention.recurrent_layers"])[:n_layer]
            if len(rec) != n_layer:
                raise ModelFormatError(
                    f"GGUF key {arch}.attention.recurrent_layers is shorter than block_count"
                )
        else:
            has_interval = f"{arch}.full_attention_interval" in fields
            interval = positive("full_attention_interval") if has_interval else 4
            rec = tuple((i + 1) % interval != 0 for i in range(n_layer))
        return HParams(
            **common,
            ssm_conv_kernel=positive("ssm.conv_kernel"),
            ssm_d_state=positive("ssm.state_size"),
            ssm_n_group=positive("ssm.group_count"),
            ssm_dt_rank=positive("ssm.time_step_rank"),
            ssm_d_inner=positive("ssm.inner_size"),
            recurrent=rec,
        )
