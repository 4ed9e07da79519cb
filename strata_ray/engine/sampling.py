"""Token sampling: greedy, or temperature with top-k / top-p / min-p filters, seeded and deterministic.

Filter order follows llama.cpp's default chain: top-k, top-p, min-p on the raw logits, then temperature.
Every step runs where the logits are (the GPU in the engine), so a draw needs no copy to the host.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

from strata_ray.config import SEED_MAX
from strata_ray.kernels.gumbel import draw_keys, gumbel_scores

# a temperature below this samples greedily, as vLLM's _SAMPLING_EPS: logits / T would overflow float32 as T
# nears its smallest normal value (+inf scores, a junk arg-max), and long before that the draw is the
# arg-max but for near-ties
GREEDY_BELOW = 1e-5


class SamplingError(ValueError):
    """Invalid sampling parameters. The message is one line."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); below GREEDY_BELOW taken as 0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off; 0 keeps only the most likely token (OpenAI's range is 0 to 1)
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None = a fresh random seed per Sampler

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)  # every path's greedy test reads 0
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.top_p <= 1:
            raise SamplingError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:  # the bound run and the API check too
            raise SamplingError(f"seed must be in [0, 2**64), got {self.seed}")


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits (ties at the k-th value kept too); the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p (at least one token: at
    p = 0 the most likely, the first in id order of the tied ones)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, stable=True)  # ties: id order, anywhere
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
    """Draws one token id per call from logits [V]; the same seed gives the same sequence of draws.

    A draw is the arg-max of the filtered logits / temperature plus Gumbel noise hashed from (seed, draw
    number, token id) (kernels/gumbel.py): a pure function of the logits, the seed and how many draws came
    before, computed where the logits are. So the chained decode draws on the device (`choose_into`, no host
    wait) and a step-by-step decode (`sample`) gives the same token from the same logits."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.seed = secrets.randbits(64) if self.params.seed is None else self.params.seed
        self.draws = 0  # draws taken so far: the next draw's number

    def filtered_logits(self, logits: Tensor) -> Tensor:
        """The logits [V] after top-k, top-p and min-p (float32, on their device), before the temperature."""
        p = self.params
        x = logits.detach().float()
        x = top_k_filter(x, p.top_k)
        x = top_p_filter(x, p.top_p)
        return min_p_filter(x, p.min_p)

    def choose(self, logits: Tensor) -> Tensor:
        """The next draw from logits [V] as a 0-d int64 tensor on their device, enqueued only (no host
        wait); greedy: the first of the largest logits."""
        if self.params.temperature == 0:
            return torch.argmax(logits)
        k1, k2 = draw_keys(self.seed, self.draws)
        self.draws += 1
        return torch.argmax(gumbel_scores(self.filtered_logits(logits), self.params.temperature, k1, k2))

    def choose_into(self, logits: Tensor, out: Tensor) -> None:
        """choose() into out [1] int64 (the chained decode's next input): no host wait."""
        out.copy_(self.choose(logits).reshape(1))

    def sample(self, logits: Tensor) -> int:
        """The next draw from logits [V] as a Python int (waits for the device)."""
        return int(self.choose(logits))
