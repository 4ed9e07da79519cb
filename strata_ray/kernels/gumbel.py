"""Seeded sampling scores: logits / temperature + Gumbel noise, whose arg-max is a draw from the softmax.

A draw from softmax(z) is argmax_i(z_i + g_i) with g_i = -log(-log(u_i)), u_i uniform in (0, 1) (the
Gumbel-max trick). Taking u from a counter hash of (seed, draw number, token id) instead of a generator's
stream makes a draw a pure function of the logits, the seed and the draw's number: the device can choose
the next token inside the chained decode (model/decode_graph.decode_chain) with no host round trip, and a
step-by-step decode on the host gives the same token from the same logits.

    keys:   k1, k2 = two 31-bit words of splitmix64(seed, draw), on the host (exact Python integers)
    bits:   h = mix32(mix32(i ^ k1) ^ k2) for token id i (mix32: Wellons' lowbias32, a bijection of uint32)
    u:      (2 (h >> 9) + 1) 2^-24: 2^23 odd multiples of 2^-24, exact in float32, never 0 or 1
    noise:  g = float32(-log(-log(u))) computed in float64 and rounded once, so the last bits do not hang on
            one device's float32 log (both forms below: the same bits but at a float64 rounding boundary)
    score:  z / T + g in float32 (an IEEE division and addition, no FMA)

`gumbel_scores_reference` is the plain twin (numpy); `gumbel_scores` launches one Triton kernel on CUDA and
runs the twin elsewhere.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from .lazy_triton import jit_bodies

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch

MASK64 = (1 << 64) - 1
BLOCK = 1024  # token ids a program


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def draw_keys(seed: int, draw: int) -> tuple[int, int]:
    """The two 31-bit keys of draw number `draw` (0, 1, ...) of a sampler seeded with `seed` (0 <= seed <
    2**64). 31 bits: a Triton kernel takes them as int32 arguments."""
    if not 0 <= seed <= MASK64 or draw < 0:
        raise ValueError(f"seed must be in [0, 2**64) and draw >= 0, got {seed}, {draw}")
    x = _splitmix64(_splitmix64(seed) ^ draw)
    return x & 0x7FFFFFFF, (x >> 32) & 0x7FFFFFFF


def _mix32_np(h: np.ndarray) -> np.ndarray:
    """lowbias32 on uint32 (wrapping products)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> np.uint32(15))
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> np.uint32(16))


def gumbel_noise_reference(n: int, k1: int, k2: int) -> np.ndarray:
    """The noise of token ids 0..n-1 under keys (k1, k2): float32 [n]."""
    with np.errstate(over="ignore"):
        i = np.arange(n, dtype=np.uint32)
        h = _mix32_np(_mix32_np(i ^ np.uint32(k1)) ^ np.uint32(k2))
    u = ((h >> np.uint32(9)).astype(np.float64) * 2 + 1) * 2.0**-24  # exact
    return (-np.log(-np.log(u))).astype(np.float32)


def gumbel_scores_reference(logits: Tensor, temperature: float, k1: int, k2: int) -> Tensor:
    """logits [V] (float32, any device) -> scores [V] float32 on the same device: logits / T + noise."""
    noise = torch.from_numpy(gumbel_noise_reference(logits.shape[-1], k1, k2)).to(logits.device)
    t = torch.tensor(temperature, dtype=torch.float32, device=logits.device)
    return logits.float() / t + noise


def _scores_body(LOGITS, OUT, V, T, k1, k2, BLOCK: tl.constexpr):
    # LOGITS f32 [V] -> OUT f32 [V]; k1, k2 int32 (31-bit keys), T f32. A program: BLOCK token ids.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < V
    z = tl.load(LOGITS + i, mask=live, other=0.0)
    h = i.to(tl.uint32) ^ k1.to(tl.uint32)
    for r in tl.static_range(2):  # lowbias32, twice: h = mix32(mix32(i ^ k1) ^ k2)
        if r == 1:
            h = h ^ k2.to(tl.uint32)
        h = h ^ (h >> 16)
        h = h * tl.full((BLOCK,), 0x7FEB352D, tl.uint32)
        h = h ^ (h >> 15)
        h = h * tl.full((BLOCK,), 0x846CA68B, tl.uint32)
        h = h ^ (h >> 16)
    u = ((h >> 9).to(tl.float64) * 2.0 + 1.0) * (1.0 / 16777216.0)
    g = (-tl.log(-tl.log(u))).to(tl.float32)
    tl.store(OUT + i, tl.math.div_rn(z, T) + g, mask=live)


@functools.cache
def _kernel():
    return jit_bodies(_scores_body, do_not_specialize=["V", "T", "k1", "k2"])[0]


def gumbel_scores_triton(logits: Tensor, temperature: float, k1: int, k2: int,
                         out: Tensor | None = None) -> Tensor:
    """The Triton kernel on any tensors it can address (CUDA; CPU under TRITON_INTERPRET=1)."""
    logits = logits.float().contiguous()
    out = torch.empty_like(logits) if out is None else out
    n = logits.shape[0]
    _kernel()[(-(-n // BLOCK),)](logits, out, n, float(temperature), k1, k2, BLOCK=BLOCK)
    return out


def gumbel_scores(logits: Tensor, temperature: float, k1: int, k2: int, out: Tensor | None = None) -> Tensor:
    """logits [V] float32 -> scores [V] (into `out` when given): one kernel on CUDA, the twin elsewhere.
    Enqueued only (no host wait): the chained decode calls it between two tokens' graphs."""
    if logits.dim() != 1:
        raise ValueError(f"gumbel_scores takes one row of logits [V], got shape {tuple(logits.shape)}")
    if logits.device.type == "cuda":
        return gumbel_scores_triton(logits, temperature, k1, k2, out)
    scores = gumbel_scores_reference(logits, temperature, k1, k2)
    return scores if out is None else out.copy_(scores)
