"""The prompt chunk (`--prefill`, default auto) and the device memory its temporaries need.

On CUDA every prompt chunk streams all non-resident experts through the ring once (DESIGN section 8), so
bigger chunks amortise that: on the H200 with a synthetic 80B-A3B at a 24 GiB budget, an 8K prompt took
30-50 s in 512-token chunks, 19.2 s in 2048-token chunks and 9.2 s in one 8192-token chunk. Auto is 4096
there. The chunk's temporaries are kept free when the expert cache is sized (`cache_slots`), on top of
--vram-reserve-mib, as the reference adds its prompt buffers to the reserve. On the CPU the chunk stays
512: nothing is streamed, and the working set stays in cache.
"""

from __future__ import annotations

from strata_ray.model.hparams import HParams
from strata_ray.model.ops import ATTENTION_MAX_SCORES

PREFILL_CPU = 512
PREFILL_CUDA = 4096
F32 = 4


def prefill_chunk(config, device: str) -> int:
    """The prompt chunk in tokens: --prefill, else auto for the device."""
    if config.prefill:
        return config.prefill
    return PREFILL_CUDA if str(device).startswith("cuda") else PREFILL_CPU


def chunk_bytes(hp: HParams, tokens: int) -> int:
    """Estimated peak device temporaries of one prompt chunk of `tokens` tokens, in bytes.

    Per token: the routed rows and the kernel's output for them (2 K E floats), the residual stream and
    its norms (8 E), the mixer's projections with their normed and rotated copies (3 x the widest
    projection). Plus one query block of attention scores (scores, mask, probabilities); the logits are
    the last token's only."""
    gdn_proj = 2 * hp.ssm_n_group * hp.ssm_d_state + 2 * hp.ssm_d_inner  # qkv (conv) + z
    attn_proj = (2 * hp.n_head + 2 * hp.n_head_kv) * hp.head_dim  # q + gate, k, v
    per_token = 2 * hp.n_expert_used * hp.n_embd + 8 * hp.n_embd + 3 * max(gdn_proj, attn_proj)
    return tokens * per_token * F32 + 3 * ATTENTION_MAX_SCORES * F32
