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
