"""LayerClock (strata_ray/experts/layer_clock.py): a forward's expert calls and the dense parts between."""

import time

import pytest
import torch

from strata_ray.config import EngineConfig
from strata_ray.experts.build import load_tiered_model
from strata_ray.experts.layer_clock import LayerClock


def test_spans_on_the_host_clock():
    clock = LayerClock(torch.device("cpu"))
    for layer, (dense, experts) in enumerate([(0.0, 0.02), (0.01, 0.03)]):
        time.sleep(dense)
        clock.start(layer)
        time.sleep(experts)
        clock.end(layer)
    clock.end(5)  # an end without its start is ignored
    s = clock.summary()
    first, second = s["calls"]
    assert first["dense"] is None and second["dense"] >= 10.0  # ms
    assert first["experts"] >= 20.0 and second["experts"] >= 30.0
    assert s["experts_ms_total"] == pytest.approx(first["experts"] + second["experts"])
    assert s["dense_ms_mean"] == pytest.approx(second["dense"])


def test_named_points_split_a_call_into_phases():
    clock = LayerClock(torch.device("cpu"))
    for layer in range(2):
        time.sleep(0.01)
        clock.point(layer, "mixer")
        clock.start(layer)
        time.sleep(0.02)
        clock.point(layer, "sync")
        time.sleep(0.005)
        clock.end(layer)
    first, second = clock.summary()["calls"]
    assert set(first["phases"]) == {"start", "sync", "end"}  # no mark before layer 0's mixer point
    assert set(second["phases"]) == {"mixer", "start", "sync", "end"}
    assert second["phases"]["mixer"] >= 10.0 and second["phases"]["sync"] >= 20.0
    parts = second["phases"]["mixer"] + second["phases"]["start"]
    assert parts == pytest.approx(second["dense"])  # the dense part = the phases before the call
    assert second["phases"]["sync"] + second["phases"]["end"] == pytest.approx(second["experts"])


def _forward_with_clock(model_path: str, device: str) -> dict:
    loaded, tiers = load_tiered_model(EngineConfig(model=model_path, device=device, expert_cache=10), device,
                                      progress=False)
    tiers.clock = LayerClock(tiers.device)
    with torch.inference_mode():
        loaded.model.forward(list(range(3, 27)), loaded.model.new_state())
    tiers.finish()
    return tiers.clock.summary(), loaded.hp


def test_a_forward_marks_every_layer(tiny_next_q4):
    s, hp = _forward_with_clock(tiny_next_q4, "cpu")
    assert [c["layer"] for c in s["calls"]] == list(range(hp.n_layer))
    assert all(c["experts"] > 0 for c in s["calls"])
    assert all(c["dense"] is not None for c in s["calls"][1:])
    assert all("mixer" in c["phases"] and "sync" in c["phases"] for c in s["calls"][1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_forward_marks_every_layer_on_cuda(tiny_next_q4):
    s, hp = _forward_with_clock(tiny_next_q4, "cuda")
    assert [c["layer"] for c in s["calls"]] == list(range(hp.n_layer))
    assert all(c["experts"] > 0 and c["host"] > 0 for c in s["calls"])
