"""TierMetrics: per-token times and the summary line (the Ray side is exercised by the actor tests)."""

from strata_ray.experts.metrics import TierMetrics


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
