"""Expert-tier counters: plain numbers always, mirrored to ray.util.metrics when running inside Ray.

Decode windows only (prompt chunks are counted apart): hits per tier, CPU entries, swaps, and the host
and CPU-pool time per generated token. Ray metrics are pushed every FLUSH_WINDOWS windows, not per layer,
and at the end of each request (ExpertTiers.finish).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

FLUSH_WINDOWS = 16


@dataclass
class TierCounts:
    windows: int = 0  # decode windows (one decode step each)
    tokens: int = 0  # tokens those windows computed
    slot_hits: int = 0  # (token, k) entries computed from the cache slots
    cpu_entries: int = 0  # entries computed by the CPU pool from the host store
    pcie_entries: int = 0  # entries the GPU computed from the page-locked host store over PCIe
    # of those, entries whose expert was copied ahead from a predicted routing (STRATA_DECODE_PREFETCH), and
    # the experts copied ahead (ahead_entries / ahead_copies: how often a prediction was right)
    ahead_entries: int = 0
    ahead_copies: int = 0
    # the CPU entries the decode worker read ahead from a predicted routing (STRATA_DECODE_WARM), and of them
    # the entries the routing then gave the CPU (warm_hits / warm_entries: how often its reads were used)
    warm_entries: int = 0
    warm_hits: int = 0
    prompt_entries: int = 0  # entries of prompt chunks (any tier)
    swaps: int = 0  # adaptive swaps issued
    loaned: int = 0  # pairs copied into the ring's slots lent to the decode (tiered: a loan)
    rounds: int = 0  # adaptive rounds whose swaps were applied
    host_seconds: float = 0.0  # host-side planning, gathers and launches of decode windows
    cpu_seconds: float = 0.0  # wall time of the CPU pool's decode work
    # decode windows: time the host waited for the device at each layer's routing sync (the dense work
    # before the experts, as far as it is not hidden behind the host's own work)
    wait_seconds: float = 0.0
    # the pipelined decode: host time from one token's end (its worker joined) to the next token's launch,
    # while the device has nothing queued but the previous token's head (the gap between two tokens)
    gap_seconds: float = 0.0

    @property
    def entries(self) -> int:
        return self.slot_hits + self.cpu_entries + self.pcie_entries

    @property
    def hit_rate(self) -> float:
        return self.slot_hits / self.entries if self.entries else 0.0

    def tier_rates(self) -> dict[str, float]:
        """The share of decode entries each tier computed: the cache slots, the CPU, the GPU over PCIe."""
        n = self.entries
        return {"cache": self.hit_rate, "cpu": self.cpu_entries / n if n else 0.0,
                "pcie": self.pcie_entries / n if n else 0.0}

    def per_token_ms(self, seconds: float) -> float:
        return 1e3 * seconds / self.tokens if self.tokens else 0.0

    def minus(self, before: TierCounts) -> TierCounts:
        """The counts since `before` (an earlier copy of these): one request's, where the tiers outlive it."""
        now, then = asdict(self), asdict(before)
        return TierCounts(**{name: now[name] - then[name] for name in now})


class TierMetrics:
    def __init__(self):
        self.counts = TierCounts()
        self._flushed = TierCounts()
        self._ray = _RayTierMetrics.create()

    def window_done(self) -> None:
        if self._ray is not None and self.counts.windows % FLUSH_WINDOWS == 0:
            self.flush()

    def flush(self) -> None:
        if self._ray is None:
            return
        self._ray.push(self.counts, self._flushed)
        self._flushed = self.snapshot()

    def snapshot(self) -> TierCounts:
        """A copy of the counts now, for summary / line(since=...) at a request's end."""
        return TierCounts(**asdict(self.counts))

    def summary(self, since: TierCounts | None = None) -> dict:
        """The counts and their rates, since load or since a snapshot (one request's: kept actors serve
        many requests, and a run's summary must not add up the runs before it)."""
        c = self.counts if since is None else self.counts.minus(since)
        return {
            **asdict(c),
            "hit_rate": c.hit_rate,
            "tier_rates": c.tier_rates(),
            "host_ms_per_token": c.per_token_ms(c.host_seconds),
            "cpu_ms_per_token": c.per_token_ms(c.cpu_seconds),
            "wait_ms_per_token": c.per_token_ms(c.wait_seconds),
            "gap_ms_per_token": c.per_token_ms(c.gap_seconds),
        }

    def line(self, since: TierCounts | None = None) -> str:
        c = self.counts if since is None else self.counts.minus(since)
        # the routing sync's wait exists on CUDA only: a CPU run would print a zero
        wait_ms = c.per_token_ms(c.wait_seconds)
        wait = f", waiting for the GPU {wait_ms:.2f} ms/token" if c.wait_seconds else ""
        if c.gap_seconds:  # the pipelined decode's host time between two tokens
            wait += f", between tokens {c.per_token_ms(c.gap_seconds):.2f} ms/token"
        pcie = f", {c.pcie_entries} read over PCIe" if c.pcie_entries else ""
        if c.ahead_copies:  # the copies ahead of the routing: how many of them it used
            pcie += f" ({c.ahead_entries} of {c.ahead_copies} copied ahead used)"
        cpu = f" ({c.warm_hits} of {c.warm_entries} read ahead used)" if c.warm_entries else ""
        return (
            f"experts: {100 * c.hit_rate:.1f}% cache hits, {c.cpu_entries} CPU entries{cpu}{pcie}, "
            f"{c.swaps} swaps, " + (f"{c.loaned} loaned into the ring, " if c.loaned else "") +
            f"host {c.per_token_ms(c.host_seconds):.2f} ms/token, "
            f"CPU pool {c.per_token_ms(c.cpu_seconds):.2f} ms/token{wait}"
        )


def zeroed_counter(name: str, description: str):
    """A ray.util.metrics Counter whose series exists, at 0, from its creation: Ray exports a counter only
    once something is recorded, and its inc() refuses 0, so a counter never incremented (no swaps, no PCIe
    tier) had no series and a dashboard's query for it found nothing instead of 0. Counter.inc(v) records v
    through Metric._record, which the OpenTelemetry and the OpenCensus recorders both take at 0 (adding 0 to
    a counter is no event); a Ray without it keeps the counter as it was: exported from its first inc."""
    from ray.util.metrics import Counter

    counter = Counter(name, description=description)
    record = getattr(counter, "_record", None)
    if record is not None:
        record(0)
    return counter


class _RayTierMetrics:
    @staticmethod
    def create() -> _RayTierMetrics | None:
        try:
            import ray

            return _RayTierMetrics() if ray.is_initialized() else None
        except ImportError:
            return None

    def __init__(self):
        from ray.util.metrics import Gauge

        self.slot_hits = zeroed_counter("strata_expert_slot_hits", "decode entries computed from the cache")
        self.cpu_entries = zeroed_counter("strata_expert_cpu_entries", "decode entries computed by the CPU")
        self.pcie_entries = zeroed_counter("strata_expert_pcie_entries",
                                           "decode entries the GPU read from host memory over PCIe")
        self.swaps = zeroed_counter("strata_expert_swaps", "adaptive swaps issued")
        self.loaned = zeroed_counter("strata_expert_loaned",
                                     "pairs copied into the prompt ring's slots lent to the decode")
        self.hit_rate = Gauge("strata_expert_hit_rate", description="decode cache hit rate since start")
        self.tier_rate = Gauge(
            "strata_expert_tier_rate", tag_keys=("tier",),
            description="share of decode entries each tier computed since start (cache, cpu, pcie)")
        self.host_ms = Gauge("strata_expert_host_ms_per_token", description="host time per decode token")
        self.cpu_ms = Gauge("strata_expert_cpu_ms_per_token", description="CPU-pool time per decode token")
        self.wait_ms = Gauge("strata_expert_wait_ms_per_token",
                             description="time per decode token the host waited for the GPU at routing syncs")
        self.gap_ms = Gauge("strata_expert_gap_ms_per_token",
                            description="host time per decode token from one token's end to the next launch")

    def push(self, now: TierCounts, before: TierCounts) -> None:
        for name in ("slot_hits", "cpu_entries", "pcie_entries", "swaps", "loaned"):
            delta = getattr(now, name) - getattr(before, name)
            if delta > 0:
                getattr(self, name).inc(delta)
        self.hit_rate.set(now.hit_rate)
        for tier, rate in now.tier_rates().items():
            self.tier_rate.set(rate, tags={"tier": tier})
        self.host_ms.set(now.per_token_ms(now.host_seconds))
        self.cpu_ms.set(now.per_token_ms(now.cpu_seconds))
        self.wait_ms.set(now.per_token_ms(now.wait_seconds))
        self.gap_ms.set(now.per_token_ms(now.gap_seconds))
