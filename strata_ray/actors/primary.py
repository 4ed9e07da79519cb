"""Primary: the process that owns the model (GPU 0 of its node, or the CPU). A thin shell over Engine.

launch.py runs it as the Ray actor `strata:primary` with max_concurrency=2, so `stop()` can reach a
generation that `generate_stream()` is producing. Streaming uses Ray's streaming generators: each yielded
item is one TokenBatch (a few tokens, ~20 ms of work), then one GenerationSummary.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from strata_ray.actors.launch import PRIMARY_NAME, LaunchError
from strata_ray.config import EngineConfig
from strata_ray.engine.engine import Engine, GenerationRequest, GenerationStopped, GenerationSummary
from strata_ray.engine.progress import LoadProgress

log = logging.getLogger("ray")


BUSY = (f"the kept engine ({PRIMARY_NAME}) is generating for another run (it serves one at a time); wait for "
        "it to end, or use --address local")


class EngineBusy(LaunchError):
    """Another run's generation holds this primary (kept actors serve one run at a time): the user's to wait
    for, one line and exit 2, not an actor's failure."""


class Primary:
    def __init__(self, config: EngineConfig, coordinator=None, switches: dict[str, str] | None = None):
        self.config = config
        self.coordinator = coordinator  # a Ray actor handle, or None outside Ray
        self._switches = dict(switches or {})  # the launching driver's STRATA_* switches (launch.launch)
        self.engine: Engine | None = None
        self._busy = threading.Lock()
        self._owner: str | None = None  # the run whose generation holds _busy (stop's check)
        self._progress = LoadProgress()  # read by load_progress() while load() runs

    def load(self) -> dict[str, Any]:
        """Load the model (idempotent); returns its description. Errors reach the caller as task errors."""
        if self.engine is None:
            if self.config.device != "cuda":
                use_all_cores()
            self.engine = Engine(self.config, progress=self._progress)  # bars are the driver's
            info = self.engine.info()
            log.info("strata primary: loaded %s", {k: v for k, v in info.items() if k != "expert_cache"})
            if info["expert_cache"]:
                log.info("strata primary: %s", info["expert_cache"])  # the driver says it unless --verbose
            if self.coordinator is not None:
                self.coordinator.model_loaded.remote(info)
                tiers = getattr(self.engine, "tiers", None)
                if tiers is not None:  # adaptive rounds are decided by the coordinator, off the critical path
                    tiers.use_coordinator(self.coordinator, self.config.adapt_every)
        return self.engine.info()

    def load_progress(self) -> dict[str, Any]:
        """Where load() is (LoadProgress.snapshot()); the driver polls it to draw its progress bars."""
        return self._progress.snapshot()

    def generate_stream(self, request: GenerationRequest, owner: str | None = None) -> Iterator:
        """Yields TokenBatch items then one GenerationSummary (run as a Ray streaming generator). owner: the
        calling run's id, which stop() must name to end this generation."""
        if self.engine is None:
            self.load()
        if not self._busy.acquire(blocking=False):
            raise EngineBusy(BUSY)
        self._owner = owner
        try:
            summary = None
            for item in self.engine.stream(request):
                if isinstance(item, GenerationSummary):
                    summary = item
                yield item
            self._report(summary)
        except GenerationStopped:
            raise
        except Exception as e:
            if self.coordinator is not None:
                self.coordinator.record_failure.remote(f"{type(e).__name__}: {e}")
            raise
        finally:
            self._owner = None
            self._busy.release()

    def stop(self, owner: str | None = None) -> None:
        """End the generation in progress; with owner, only that run's (a kept engine's Ctrl-C'd run whose own
        generation was refused as busy stopped the other run's)."""
        if self.engine is not None and (owner is None or owner == self._owner):
            self.engine.stop()

    def switches(self) -> dict[str, str]:
        """The STRATA_* switches its driver launched it with (a kept engine is reused only with the same)."""
        return self._switches

    def busy(self) -> bool:
        """Whether a generation holds the engine (--replace-actors never kills one that does)."""
        return self._busy.locked()

    def ping(self) -> bool:
        return True

    def _report(self, s: GenerationSummary | None) -> None:
        if s is not None and self.coordinator is not None:
            self.coordinator.record_generation.remote(
                s.prompt_tokens, len(s.token_ids), s.prompt_seconds, s.decode_seconds, s.decode_forwards
            )


def use_all_cores() -> None:
    """Ray sets OMP_NUM_THREADS to the actor's CPU share (1); a CPU engine (the primary, a serve replica)
    computes with every core."""
    import torch

    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, n))
