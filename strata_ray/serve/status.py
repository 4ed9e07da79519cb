"""What the server knows about itself: live state, per-request timings, totals, expert tiers, memory.

`ServeMetrics` is fed by the runner (one generation at a time) and read by /health, /v1/status and /metrics
(JSON, or Prometheus text with ?format=prometheus). Timings use llama.cpp's names (prompt_n, prompt_ms,
predicted_per_second, ...) so existing dashboards and flashbench read them.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

KEPT_REQUESTS = 200  # per-request records kept for /metrics?requests=all
SHOWN_REQUESTS = 12  # records in a plain /metrics answer
TOK_S_WINDOW_S = 2.0  # live tok/s is measured over this window


@dataclass
class RequestRecord:
    id: str
    endpoint: str
    queued_at: float  # wall clock
    prompt_tokens: int = 0
    generated: int = 0
    max_tokens: int = 0
    queue_ms: float = 0.0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)

    def timings(self) -> dict[str, float]:
        return timings(self.prompt_tokens, self.prompt_ms, self.generated, self.decode_ms)


def timings(prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict[str, float]:
    return {
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000.0 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
    }


@dataclass
class Totals:
    since: float = field(default_factory=time.time)
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0


class ServeMetrics:
    def __init__(self):
        self.started = time.time()
        self.state = "loading"  # loading | idle | reading | generating | failed
        self.queued = 0  # requests waiting for the engine
        self.current: RequestRecord | None = None
        self.recent: deque[RequestRecord] = deque(maxlen=KEPT_REQUESTS)
        self.totals = Totals()
        self.last_request_at: float | None = None
        self._phase_start = 0.0  # monotonic: when the current request's prompt (then decode) began
        self._token_times: deque[float] = deque()
        self._decode_tokens = 0
        self._decode_seconds = 0.0

    # --- fed by the runner --------------------------------------------------------------------------------

    def enqueue(self, rid: str, endpoint: str) -> RequestRecord:
        self.queued += 1
        self.totals.requests += 1
        self.last_request_at = time.time()
        return RequestRecord(id=rid, endpoint=endpoint, queued_at=self.last_request_at)

    def begin(self, rec: RequestRecord, prompt_tokens: int, max_tokens: int) -> None:
        self.queued -= 1
        rec.queue_ms = 1000.0 * (time.time() - rec.queued_at)
        rec.prompt_tokens, rec.max_tokens = prompt_tokens, max_tokens
        self.current, self.state = rec, "reading"
        self._phase_start = time.monotonic()

    def dequeue_unstarted(self, rec: RequestRecord) -> None:
        """A queued request whose client left before the engine took it: listed and counted as cancelled,
        having read nothing (it was counted in totals.requests, and went nowhere else)."""
        self.queued -= 1
        rec.queue_ms = 1000.0 * (time.time() - rec.queued_at)
        rec.finish_reason = "cancelled"
        self.totals.cancelled += 1
        self.recent.appendleft(rec)

    def token(self, rec: RequestRecord) -> None:
        now = time.monotonic()
        if rec.generated == 0:
            rec.prompt_ms = 1000.0 * (now - self._phase_start)
            self._phase_start, self.state = now, "generating"
        rec.generated += 1
        rec.decode_ms = 1000.0 * (now - self._phase_start)
        self._token_times.append(now)

    def end(self, rec: RequestRecord, finish_reason: str, error: str | None = None,
            tiers: dict[str, dict[str, float]] | None = None) -> None:
        rec.finish_reason, rec.error, rec.tiers = finish_reason, error, tiers or {}
        if rec.generated == 0 and rec.prompt_ms == 0:
            rec.prompt_ms = 1000.0 * (time.monotonic() - self._phase_start)
        t = self.totals
        t.completed += finish_reason in ("stop", "length")
        t.cancelled += finish_reason == "cancelled"
        t.failed += finish_reason == "error"
        t.prompt_tokens += rec.prompt_tokens
        t.output_tokens += rec.generated
        t.prompt_ms += rec.prompt_ms
        t.decode_ms += rec.decode_ms
        self._decode_tokens += max(0, rec.generated - 1)  # the first token's time is part of the prompt
        self._decode_seconds += rec.decode_ms / 1000.0
        self.recent.appendleft(rec)
        if self.current is rec:  # a cancelled request may end after the next one began
            self.current, self.state = None, "idle"

    # --- read by the endpoints ----------------------------------------------------------------------------

    def tok_s(self) -> float:
        now = time.monotonic()
        while self._token_times and self._token_times[0] < now - TOK_S_WINDOW_S:
            self._token_times.popleft()
        if len(self._token_times) < 2:
            return 0.0
        return (len(self._token_times) - 1) / max(now - self._token_times[0], 1e-6)

    def live(self) -> dict[str, Any]:
        cur = self.current
        t = self.totals
        return {
            "state": self.state,
            "queued": self.queued,
            "request": cur.id if cur else None,
            "prompt_tokens": cur.prompt_tokens if cur else 0,
            "generated": cur.generated if cur else 0,
            "max_tokens": cur.max_tokens if cur else 0,
            "elapsed_s": (time.time() - cur.queued_at - cur.queue_ms / 1000.0) if cur else 0.0,
            "tok_s": self.tok_s(),
            "tok_s_window_s": TOK_S_WINDOW_S,
            "tok_s_mean": self._decode_tokens / self._decode_seconds if self._decode_seconds > 0 else 0.0,
            "prefill_tok_s_mean": 1000.0 * t.prompt_tokens / t.prompt_ms if t.prompt_ms > 0 else 0.0,
        }

    def last_timings(self) -> dict[str, float] | None:
        return self.recent[0].timings() if self.recent else None

    def requests(self, all_kept: bool) -> list[dict[str, Any]]:
        recs = list(self.recent) if all_kept else list(self.recent)[:SHOWN_REQUESTS]
        return [{**asdict(r), "timings": r.timings()} for r in recs]


# --- expert tiers and memory ------------------------------------------------------------------------------


def tier_counters(engine) -> dict[str, dict[str, int]] | None:
    """Cumulative expert counters per tier, {tier: {"experts", "hits", "lookups"}}, or None for an engine
    without tiers (float experts: see reference_tiers). An engine may report its own through
    `expert_tiers()`; otherwise they are read from its TieredExperts (`engine.tiers`): the primary cache
    computes its slot hits, the CPU pool every other routed entry of the decode windows, less those the GPU
    computed from the host store over PCIe (a "pcie" tier, once there are any)."""
    report = getattr(engine, "expert_tiers", None)
    if callable(report):
        return {name: dict(v) for name, v in report().items()}
    tiers = getattr(engine, "tiers", None)
    if tiers is None:
        return None
    c = tiers.metrics.counts
    resident = int(tiers.residency.n_resident)
    out = {
        "primary": {"experts": resident, "hits": c.slot_hits, "lookups": c.entries},
        "cpu": {"experts": tiers.n_layers * tiers.n_expert - resident, "hits": c.cpu_entries,
                "lookups": c.entries},
    }
    if c.pcie_entries:  # the GPU's share of the misses (STRATA_PCIE_SHARE): the host store's experts too
        out["pcie"] = {"experts": tiers.n_layers * tiers.n_expert - resident, "hits": c.pcie_entries,
                       "lookups": c.entries}
    return out


def reference_tiers(engine, tokens: int) -> dict[str, dict[str, float]]:
    """One request's tiers on the reference engine: it computes every routed expert where the model lives,
    so that device is the one tier, holding all experts, and every routed (token, expert) entry is a hit."""
    hp = engine.loaded.hp
    lookups = tokens * hp.n_layer * hp.n_expert_used
    return {engine.device: {"experts": hp.n_layer * hp.n_expert, "hits": lookups, "lookups": lookups,
                            "hit_rate": 1.0 if lookups else 0.0}}


def tier_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """One request's hits per tier from two tier_counters snapshots."""
    out = {}
    for name, now in after.items():
        was = before.get(name, {})
        hits = now.get("hits", 0) - was.get("hits", 0)
        lookups = now.get("lookups", 0) - was.get("lookups", 0)
        out[name] = {"experts": now.get("experts", 0), "hits": hits, "lookups": lookups,
                     "hit_rate": hits / lookups if lookups else 0.0}
    return out


def add_tiers(totals: dict[str, dict[str, float]], delta: dict[str, dict[str, float]]) -> None:
    """Accumulate one request's tiers into the running totals (experts: the latest count)."""
    for name, d in delta.items():
        t = totals.setdefault(name, {"experts": 0, "hits": 0, "lookups": 0, "hit_rate": 0.0})
        t["experts"] = d.get("experts", t["experts"])
        t["hits"] += d.get("hits", 0)
        t["lookups"] += d.get("lookups", 0)
        t["hit_rate"] = t["hits"] / t["lookups"] if t["lookups"] else 0.0


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def hardware(device: str) -> dict[str, Any]:
    mem = _meminfo()
    gib = 1024**3
    ram = None
    if "MemTotal" in mem:
        used = mem["MemTotal"] - mem.get("MemAvailable", 0)
        ram = {"used_gib": used / gib, "total_gib": mem["MemTotal"] / gib}
    rss = _rss_bytes()
    return {
        "at": time.time(),
        "gpu": _gpu_memory() if device == "cuda" else None,
        "ram": ram,
        "process_rss_gib": rss / gib if rss is not None else None,
        "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _gpu_memory() -> list[dict[str, Any]] | None:
    try:
        import torch

        out = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out.append({"index": i, "name": torch.cuda.get_device_name(i), "used_mib": (total - free) / 2**20,
                        "total_mib": total / 2**20})
        return out
    except Exception:  # a GPU that cannot be read is shown as unknown, never a failed request
        return None


# --- Prometheus text --------------------------------------------------------------------------------------


def prometheus(doc: dict[str, Any]) -> str:
    """The /metrics JSON as Prometheus text exposition (version 0.0.4)."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP strata_{name} {help_text}")
        lines.append(f"# TYPE strata_{name} {kind}")
        lines.extend(f"strata_{name}{labels} {float(v):g}" for labels, v in samples)

    t, live = doc["totals"], doc["live"]
    metric("loaded", "gauge", "1 once the model is ready", [("", doc["loaded"])])
    metric("uptime_seconds", "gauge", "seconds since the server started", [("", doc["uptime_s"])])
    metric("requests_total", "counter", "requests received", [("", t["requests"])])
    metric("requests_completed_total", "counter", "requests finished normally", [("", t["completed"])])
    metric("requests_cancelled_total", "counter", "requests whose client went away", [("", t["cancelled"])])
    metric("requests_failed_total", "counter", "requests the engine failed", [("", t["failed"])])
    metric("prompt_tokens_total", "counter", "prompt tokens read", [("", t["prompt_tokens"])])
    metric("generated_tokens_total", "counter", "tokens generated", [("", t["output_tokens"])])
    metric("prompt_seconds_total", "counter", "time reading prompts", [("", t["prompt_ms"] / 1000)])
    metric("decode_seconds_total", "counter", "time generating", [("", t["decode_ms"] / 1000)])
    metric("queued_requests", "gauge", "requests waiting for the engine", [("", live["queued"])])
    metric("decode_tokens_per_second", "gauge", "generation speed over the last 2 s", [("", live["tok_s"])])
    tiers = doc["tiers"]
    metric("tier_experts", "gauge", "experts held per tier",
           [(f'{{tier="{n}"}}', v.get("experts", 0)) for n, v in tiers.items()])
    metric("tier_hits_total", "counter", "routed expert entries computed per tier",
           [(f'{{tier="{n}"}}', v.get("hits", 0)) for n, v in tiers.items()])
    metric("tier_lookups_total", "counter", "routed expert entries looked up per tier",
           [(f'{{tier="{n}"}}', v.get("lookups", 0)) for n, v in tiers.items()])
    hw = doc["hardware"]
    if hw.get("process_rss_gib") is not None:
        metric("process_resident_bytes", "gauge", "server replica resident memory",
               [("", hw["process_rss_gib"] * 1024**3)])
    if hw.get("gpu"):
        metric("gpu_memory_used_bytes", "gauge", "GPU memory in use",
               [(f'{{gpu="{g["index"]}"}}', g["used_mib"] * 2**20) for g in hw["gpu"]])
    return "\n".join(lines) + "\n"
