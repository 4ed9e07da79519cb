"""Token sampling: greedy, or temperature with top-k / top-p / min-p filters, seeded and deterministic.

Filter order follows llama.cpp's default chain: top-k, top-p, min-p on the raw logits, then temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


class SamplingError(ValueError):
    """Invalid sampling parameters. The message is one line."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None = a fresh random seed per Sampler

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits (ties at the k-th value kept too); the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p (at least one token)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
    drop_sorted = mass_before >= p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: Tensor, p: float) -> Tensor:
    """Drop tokens whose probability is below p times the most likely token's."""
    if p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p * probs.max(), float("-inf"))


class Sampler:
    """Draws one token id per call from logits [V]; the same seed gives the same sequence of draws."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.generator = torch.Generator()
        if self.params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.params.seed)

    def filtered_logits(self, logits: Tensor) -> Tensor:
        """The logits after top-k, top-p, min-p and temperature (float32, on CPU)."""
        p = self.params
        x = logits.detach().float().cpu()
        x = top_k_filter(x, p.top_k)
        x = top_p_filter(x, p.top_p)
        x = min_p_filter(x, p.min_p)
        return x / p.temperature if p.temperature > 0 else x

    def sample(self, logits: Tensor) -> int:
        if self.params.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(self.filtered_logits(logits), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
