"""TierMetrics: per-token times and the summary line; the Ray side: every counter exported from the start
(the tiers' own values reaching Ray are exercised by the actor tests)."""

import json
import re
import subprocess
import sys
import time
import urllib.request

from strata_ray.experts.metrics import TierMetrics
from tests.actors.ray_head import REPO, auth_env, client_env, free_port, ray_head


def test_summary_and_line_give_per_token_times():
    m = TierMetrics()
    c = m.counts
    c.tokens, c.slot_hits, c.cpu_entries = 4, 30, 10
    c.host_seconds, c.cpu_seconds = 0.008, 0.1
    s = m.summary()
    assert s["hit_rate"] == 0.75 and s["host_ms_per_token"] == 2.0 and s["cpu_ms_per_token"] == 25.0
    assert s["wait_ms_per_token"] == 0.0
    line = m.line()
    assert "75.0% cache hits" in line and "CPU pool 25.00 ms/token" in line
    assert "waiting for the GPU" not in line  # no routing-sync wait (a CPU run): not printed
    c.wait_seconds = 0.02
    assert m.line().endswith("waiting for the GPU 5.00 ms/token")


def test_pcie_entries_are_a_tier_of_their_own():
    """Misses the GPU read over PCIe count as entries (not hits), in the tier rates and the line."""
    m = TierMetrics()
    c = m.counts
    c.tokens, c.slot_hits, c.cpu_entries = 1, 30, 10
    assert "PCIe" not in m.line()
    c.pcie_entries = 10
    s = m.summary()
    assert s["hit_rate"] == 0.6 and s["tier_rates"] == {"cache": 0.6, "cpu": 0.2, "pcie": 0.2}
    assert "60.0% cache hits, 10 CPU entries, 10 read over PCIe" in m.line()


def test_reads_ahead_are_counted_beside_the_cpu_entries():
    """The CPU entries read ahead from a predicted routing (STRATA_DECODE_WARM): how many, how many used."""
    m = TierMetrics()
    c = m.counts
    c.tokens, c.slot_hits, c.cpu_entries = 1, 30, 10
    assert "read ahead" not in m.line()
    c.warm_entries, c.warm_hits = 12, 9
    assert "10 CPU entries (9 of 12 read ahead used)" in m.line()
    assert m.summary()["warm_hits"] == 9


def test_the_gap_between_tokens_is_printed_where_measured():
    """The pipelined decode's host time between two tokens (gap_seconds): in the summary, and in the line
    after the wait when there is one."""
    m = TierMetrics()
    c = m.counts
    c.tokens, c.slot_hits, c.cpu_entries = 4, 30, 10
    assert "between tokens" not in m.line() and m.summary()["gap_ms_per_token"] == 0.0
    c.wait_seconds, c.gap_seconds = 0.02, 0.006
    assert m.summary()["gap_ms_per_token"] == 1.5
    assert m.line().endswith("waiting for the GPU 5.00 ms/token, between tokens 1.50 ms/token")


def test_a_request_counts_from_its_snapshot():
    """Kept actors and a server serve many requests on one TierMetrics: a request's summary and line count
    from the snapshot taken at its start, not since load."""
    m = TierMetrics()
    c = m.counts
    c.tokens, c.slot_hits, c.cpu_entries, c.swaps, c.host_seconds = 100, 700, 300, 40, 0.5
    before = m.snapshot()
    c.tokens, c.slot_hits, c.cpu_entries, c.swaps, c.host_seconds = 104, 736, 304, 41, 0.508
    s = m.summary(since=before)
    assert (s["tokens"], s["slot_hits"], s["cpu_entries"], s["swaps"]) == (4, 36, 4, 1)
    assert s["hit_rate"] == 0.9 and abs(s["host_ms_per_token"] - 2.0) < 1e-9
    assert m.line(since=before).startswith("experts: 90.0% cache hits, 4 CPU entries, 1 swaps, ")
    assert m.summary()["tokens"] == 104 and before.tokens == 100  # since load unchanged; the copy is a copy


# ---- the Ray side: every counter the engine defines is exported from its creation, at 0 ----------------

ZERO_SCRIPT = """
import json, sys, ray
ray.init(namespace="strata-test-metrics", logging_level="ERROR")

@ray.remote(num_cpus=0)
class Holder:  # the engine's metrics live in its actors: made here as the coordinator and the primary do
    def __init__(self):
        from ray.util.metrics import Counter
        from strata_ray.actors.coordinator import _RayMetrics
        from strata_ray.experts.metrics import _RayTierMetrics
        self.engine, self.tiers = _RayMetrics(), _RayTierMetrics()
        self.names = [c._name for m in (self.engine, self.tiers) for c in vars(m).values()
                      if isinstance(c, Counter)]
    def counters(self):
        return self.names
    def swap(self, n):
        self.tiers.swaps.inc(n)

holder = Holder.remote()
names = ray.get(holder.counters.remote())
ray.get(holder.swap.remote(3))
print(json.dumps(names), flush=True)
sys.stdin.read()  # the actor (and its series) lives until the test has read the node's metrics
"""


def _series(port: int) -> dict[str, list[float]]:
    """The node's Prometheus counters of ray.util.metrics ("ray_" + name + "_total"): name -> values."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[float]] = {}
    for m in re.finditer(r"^ray_(strata_\w+)_total\{.*\} (\S+)$", body, re.M):
        out.setdefault(m[1], []).append(float(m[2]))
    return out


def test_every_ray_counter_is_exported_at_zero_before_its_first_increment(tmp_path):
    """Ray exports a counter only once something is recorded, and Counter.inc refuses 0: a counter never
    incremented (no swaps, no PCIe tier, no adaptive rounds) had no series at all, so a dashboard's query for
    it found nothing instead of 0. Each counter of the coordinator and of the expert tiers is a 0 series as
    soon as it exists, and one incremented later reads its count."""
    port = free_port()
    with ray_head(tmp_path, metrics_port=port) as address:
        proc = subprocess.Popen([sys.executable, "-c", ZERO_SCRIPT], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env={**client_env(address), **auth_env()})
        try:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.poll() is not None else "no answer"
            names = json.loads(line)
            assert len(names) == 9 and {"strata_expert_pcie_entries", "strata_adaptive_rounds"} <= set(names)
            deadline = time.monotonic() + 30
            while True:  # the worker reports every 500 ms (ray_head's metrics_report_interval_ms)
                series = _series(port)
                if set(names) <= set(series) and series.get("strata_expert_swaps") == [3.0]:
                    break
                assert time.monotonic() < deadline, (sorted(names), series)
                time.sleep(0.5)
            assert {n: series[n] for n in names if n != "strata_expert_swaps"} == {
                n: [0.0] for n in names if n != "strata_expert_swaps"}
        finally:
            proc.stdin.close()
            proc.wait(timeout=60)
