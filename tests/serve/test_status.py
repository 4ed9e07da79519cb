"""ServeMetrics bookkeeping and the Prometheus text (no server)."""

from __future__ import annotations

from strata_ray.serve import status


def test_request_lifecycle_and_totals():
    m = status.ServeMetrics()
    m.state = "idle"
    rec = m.enqueue("r1", "/v1/completions")
    assert m.queued == 1 and m.live()["queued"] == 1
    m.begin(rec, prompt_tokens=10, max_tokens=5)
    assert m.queued == 0 and m.live()["state"] == "reading"
    for _ in range(3):
        m.token(rec)
    assert m.live()["state"] == "generating" and m.live()["generated"] == 3
    m.end(rec, "length", tiers={"cpu": {"experts": 4, "hits": 2, "lookups": 2, "hit_rate": 1.0}})
    assert m.live()["state"] == "idle" and m.totals.completed == 1 and m.totals.output_tokens == 3
    (doc,) = m.requests(all_kept=False)
    assert doc["timings"]["prompt_n"] == 10 and doc["timings"]["predicted_n"] == 3


def test_a_cancelled_request_ending_late_leaves_the_next_one_current():
    m = status.ServeMetrics()
    first, second = m.enqueue("a", "x"), m.enqueue("b", "x")
    m.begin(first, 1, 1)
    m.begin(second, 1, 1)  # the engine took the next request before the cancelled one's last token
    m.end(first, "cancelled")
    assert m.current is second and m.totals.cancelled == 1


def test_a_request_gone_while_queued_is_listed_and_counted_cancelled():
    m = status.ServeMetrics()
    running, gone = m.enqueue("a", "x"), m.enqueue("b", "x")
    m.begin(running, 1, 1)
    m.dequeue_unstarted(gone)
    assert m.queued == 0 and m.current is running and m.totals.cancelled == 1
    (doc,) = m.requests(all_kept=True)
    assert doc["id"] == "b" and doc["finish_reason"] == "cancelled" and doc["timings"]["prompt_n"] == 0
    m.end(running, "stop")
    t = m.totals
    assert t.requests == t.completed + t.cancelled + t.failed == 2


def test_tiers_accumulate():
    totals: dict = {}
    status.add_tiers(totals, {"gpu": {"experts": 8, "hits": 3, "lookups": 4}})
    status.add_tiers(totals, {"gpu": {"experts": 8, "hits": 1, "lookups": 4}})
    assert totals["gpu"] == {"experts": 8, "hits": 4, "lookups": 8, "hit_rate": 0.5}


def test_prometheus_text():
    m = status.ServeMetrics()
    doc = {"loaded": True, "uptime_s": 1.0, "totals": vars(m.totals), "live": m.live(),
           "tiers": {"cpu": {"experts": 4, "hits": 2, "lookups": 2}}, "hardware": status.hardware("cpu")}
    text = status.prometheus(doc)
    assert "# TYPE strata_requests_total counter" in text
    assert 'strata_tier_hits_total{tier="cpu"} 2' in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.split(" ")) == 2


def test_tier_counters_add_a_pcie_tier_once_the_gpu_read_misses():
    """The GPU's share of the misses (STRATA_PCIE_SHARE) is a tier of its own; the three tiers' hits sum to
    the lookups. (A plain namespace stands in for the engine: tier_counters reads four attributes.)"""
    from types import SimpleNamespace

    from strata_ray.experts.metrics import TierMetrics

    metrics = TierMetrics()
    tiers = SimpleNamespace(metrics=metrics, residency=SimpleNamespace(n_resident=6), n_layers=2, n_expert=8)
    engine = SimpleNamespace(tiers=tiers)
    c = metrics.counts
    c.slot_hits, c.cpu_entries = 5, 3
    assert set(status.tier_counters(engine)) == {"primary", "cpu"}
    c.pcie_entries = 2
    got = status.tier_counters(engine)
    assert got["pcie"] == {"experts": 10, "hits": 2, "lookups": 10}
    assert sum(t["hits"] for t in got.values()) == got["cpu"]["lookups"] == 10
