"""graph_capture: the cycle collector held off for a capture (session 55: the tier tests aborted once with
a collection running inside the decode graphs' capture; what it freed is not known)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from strata_ray.model.graph_capture import capture_graph, collector_held

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def collector_on():
    was_on = gc.isenabled()
    gc.enable()
    yield
    if not was_on:
        gc.disable()


class _Cycle:
    def __init__(self, payload=None):
        self.me, self.payload = self, payload


def _make_garbage(n: int) -> None:
    """n cycles dropped at once: far past the first generation's threshold, so an enabled collector runs."""
    for _ in range(n):
        _Cycle()


def test_collector_is_off_inside_and_on_after(collector_on):
    ref = weakref.ref(_Cycle())  # garbage now: only a collection frees it
    with collector_held():
        assert not gc.isenabled()
        _make_garbage(20 * gc.get_threshold()[0])
        assert ref() is not None  # no automatic collection ran inside
    assert gc.isenabled()
    gc.collect()
    assert ref() is None


def test_collector_comes_back_after_an_error(collector_on):
    with pytest.raises(ValueError), collector_held():
        raise ValueError("inside")
    assert gc.isenabled()


def test_collector_left_off_where_it_was_off(collector_on):
    gc.disable()
    with collector_held():
        pass
    assert not gc.isenabled()


@pytest.mark.parametrize("n", [1, 33, 222])
@GPU[0]
@GPU[1]
def test_capture_leaves_a_dead_pinned_cycle_to_after_the_capture(n, collector_on):
    # a page-locked tensor of torch's host allocator with a stream use (its copy), in a dead cycle: freeing it
    # records CUDA events, which a capture forbids
    host = torch.arange(n, dtype=torch.float32).pin_memory()  # [n]
    dev = host.to("cuda", non_blocking=True)  # [n]
    ref = weakref.ref(_Cycle(host))
    del host
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with capture_graph(g, torch.cuda.graph_pool_handle()):
        dev.mul_(2.0)
        _make_garbage(20 * gc.get_threshold()[0])  # would start a collection inside the capture
        assert ref() is not None
    gc.collect()
    assert ref() is None
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), torch.arange(n, dtype=torch.float32) * 2)  # the capture itself ran nothing
