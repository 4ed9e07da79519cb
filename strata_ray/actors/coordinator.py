"""Coordinator: the engine's control-plane bookkeeping (config of record, run statistics, metrics).

A plain class; launch.py runs it as the Ray actor `strata:coordinator`. The primary reports once per
generation (never per token); with an adaptive expert cache it also plans the rounds from the counts the
primary sends at its round boundaries (`adapt_round`), off the primary's critical path, and counts them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from strata_ray.config import EngineConfig

log = logging.getLogger("ray")


@dataclass
class AdaptiveTotals:
    """The adaptive rounds this coordinator planned for the primary's cache."""

    rounds: int = 0  # rounds run (a due round skipped while the primary was busy is not counted)
    swaps: int = 0  # swaps those rounds returned
    windows: int = 0  # decode windows whose counts arrived


@dataclass
class RunTotals:
    generations: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_forwards: int = 0  # the one-token forwards decode_seconds holds (rates.TokenRates.decode_forwards)
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    failures: int = 0


class Coordinator:
    def __init__(self, config: EngineConfig, kept: bool = False):
        self.config = config
        self._kept = kept  # created by a --keep-actors run: later runs may reuse or replace the engine
        self.model_info: dict[str, Any] = {}
        self.totals = RunTotals()
        self.adaptive = AdaptiveTotals()
        self._rounds = None  # AdaptiveTier, once the primary's cache has adaptive rounds
        self.started_at = time.time()
        self._metrics = _RayMetrics.create()

    def get_config(self) -> EngineConfig:
        return self.config

    def kept(self) -> bool:
        """Whether this engine outlives the run that made it (--keep-actors); else it is that run's own,
        which no other run may reuse or remove."""
        return self._kept

    def model_loaded(self, info: dict[str, Any]) -> None:
        self.model_info = dict(info)
        shown = {k: v for k, v in info.items() if k != "expert_cache"}  # the primary logs that line itself
        log.info("strata coordinator: model loaded %s", shown)

    def record_generation(self, prompt_tokens: int, generated_tokens: int, prompt_seconds: float,
                          decode_seconds: float, decode_forwards: int | None = None) -> None:
        """decode_forwards: the forwards decode_seconds holds (None: generated_tokens, as before)."""
        forwards = generated_tokens if decode_forwards is None else decode_forwards
        t = self.totals
        t.generations += 1
        t.prompt_tokens += prompt_tokens
        t.generated_tokens += generated_tokens
        t.decode_forwards += forwards
        t.prompt_seconds += prompt_seconds
        t.decode_seconds += decode_seconds
        if self._metrics:
            self._metrics.record(prompt_tokens, generated_tokens, prompt_seconds, decode_seconds, forwards)

    def record_failure(self, reason: str) -> None:
        self.totals.failures += 1
        log.warning("strata coordinator: generation failed: %s", reason)

    def configure_rounds(self, n_layers: int, n_expert: int) -> None:
        """The primary's expert cache has adaptive rounds: keep their usage table here."""
        from strata_ray.experts.adaptive import AdaptiveTier

        c = self.config
        self._rounds = AdaptiveTier(n_layers, n_expert, c.adapt_every, c.adapt_swaps, c.adapt_decay)

    def adapt_round(self, due, resident, busy: bool) -> list[tuple[int, int, int, float]]:
        """The rounds due since the primary's last message, oldest first, as the routed-entry counts [L, X]
        of each one's adapt_every windows: each is run in turn against `resident` [L, X] (swaps in flight
        counted), as the reference runs one round a boundary. A round after one that returned swaps is
        skipped, as the reference skips a round while the last one's copies are pending (these have not
        even started: the primary has not seen them), so at most one round a message returns swaps.
        Returns them as (layer, candidate, victim, gain), best gain first."""
        tier = self._rounds
        if tier is None:
            return []
        swaps = []
        for counts in due:
            tier.record(counts)
            self.adaptive.windows += tier.adapt_every
            rnd = tier.run_round(resident, primary_busy=busy or bool(swaps))
            if rnd is None:
                continue
            swaps = rnd.primary
            self.adaptive.rounds += 1
            self.adaptive.swaps += len(swaps)
            if self._metrics:
                self._metrics.record_round(len(swaps))
        return [(s.layer, s.candidate, s.victim, s.gain) for s in swaps]

    def status(self) -> dict[str, Any]:
        t = self.totals
        return {
            "model": self.model_info,
            "uptime_seconds": time.time() - self.started_at,
            **asdict(t),
            "adaptive": asdict(self.adaptive),
            "prompt_tokens_per_second": t.prompt_tokens / t.prompt_seconds if t.prompt_seconds else 0.0,
            "decode_tokens_per_second": t.decode_forwards / t.decode_seconds if t.decode_seconds else 0.0,
        }


class _RayMetrics:
    """ray.util.metrics exported to the dashboard / Prometheus; absent when not running inside Ray."""

    @staticmethod
    def create() -> _RayMetrics | None:
        try:
            import ray

            if not ray.is_initialized():
                return None
            return _RayMetrics()
        except ImportError:
            return None

    def __init__(self):
        from ray.util.metrics import Gauge

        from strata_ray.experts.metrics import zeroed_counter

        # counters at 0 from the start (zeroed_counter): an engine without adaptive rounds still has their
        # series, 0, not none
        self.prompt_tokens = zeroed_counter("strata_prompt_tokens", "prompt tokens processed")
        self.generated_tokens = zeroed_counter("strata_generated_tokens", "tokens generated")
        self.prefill_tps = Gauge("strata_prefill_tokens_per_second", description="last prompt's tok/s")
        self.decode_tps = Gauge("strata_decode_tokens_per_second", description="last generation's tok/s")
        self.adapt_rounds = zeroed_counter("strata_adaptive_rounds", "adaptive rounds planned")
        self.adapt_swaps = zeroed_counter("strata_adaptive_round_swaps", "swaps the rounds planned")

    def record_round(self, swaps: int) -> None:
        self.adapt_rounds.inc()
        if swaps:
            self.adapt_swaps.inc(swaps)

    def record(self, prompt_tokens: int, generated_tokens: int, prompt_seconds: float, decode_seconds: float,
               decode_forwards: int):
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generated_tokens:
            self.generated_tokens.inc(generated_tokens)
        if prompt_seconds > 0:
            self.prefill_tps.set(prompt_tokens / prompt_seconds)
        if decode_seconds > 0:
            self.decode_tps.set(decode_forwards / decode_seconds)
