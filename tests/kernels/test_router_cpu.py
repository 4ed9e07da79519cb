"""The CPU router (strata_ray/kernels/router_cpu.py) against moe.route's torch form at awkward sizes: the same
experts, weights to rounding, both logits forms, the tie rule, batch invariance; which calls take it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata_ray.kernels import router_cpu
from strata_ray.kernels.router import route_reference
from strata_ray.kernels.router_cpu import SMALL_ROUTER, route_cpu, route_cpu_serves
from strata_ray.model.moe import route


def _inputs(T, X, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g), torch.randn(X, E, generator=g) * 0.3


@pytest.mark.parametrize("T,X,E,k", [(1, 16, 128, 2), (3, 33, 222, 5), (16, 64, 256, 8), (1, 7, 1, 7),
                                     (2, 300, 64, 10), (33, 16, 128, 2)])
def test_the_references_experts_and_weights_to_rounding(T, X, E, k):
    x, w = _inputs(T, X, E, T * X + k)
    assert (X * E <= SMALL_ROUTER) == (X != 300)  # both logits forms
    ids, wts = route_cpu(x, w, k)
    want_ids, want_wts = route_reference(x @ w.T, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wts, want_wts, rtol=2e-6, atol=2e-6)
    for t in (0, T - 1) if X * E <= SMALL_ROUTER else ():  # a token's result is its own: the same bits alone
        alone = route_cpu(x[t : t + 1], w, k)
        assert torch.equal(alone[0], ids[t : t + 1]) and torch.equal(alone[1], wts[t : t + 1])


def test_ties_go_to_the_lower_expert():
    w = torch.ones(5, 64)  # every logit equal
    ids, wts = route_cpu(torch.randn(1, 64), w, 3)
    assert ids.tolist() == [[0, 1, 2]]
    assert torch.allclose(wts, torch.full((1, 3), 1 / 3))
    ids, wts = np.empty((1, 3), np.int64), np.empty((1, 3), np.float32)  # the F.linear form's picks
    router_cpu._pick_rows(np.array([[0.5, 2.0, 0.5, 2.0, 2.0]], np.float32), 3, ids, wts)
    assert ids.tolist() == [[1, 3, 4]]


@pytest.mark.parametrize("logits", [[1.0, float("nan"), 3.0, 0.0], [float("inf"), 1.0, 2.0, 0.0],
                                    [float("-inf")] * 4, [float("nan")] * 4])
def test_non_finite_logits_still_pick_distinct_experts(logits):
    ids, wts = np.empty((1, 3), np.int64), np.empty((1, 3), np.float32)
    router_cpu._pick_rows(np.array([logits], np.float32), 3, ids, wts)
    assert len(set(ids[0].tolist())) == 3 and all(0 <= i < 4 for i in ids[0])


def test_out_buffers_and_bad_calls():
    x, w = _inputs(2, 16, 32, 0)
    out = torch.empty(2, 4, dtype=torch.int64), torch.empty(2, 4)
    got = route_cpu(x, w, 4, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    want = route_cpu(x, w, 4)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    with pytest.raises(ValueError, match="route_cpu: k=17"):
        route_cpu(x, w, 17)
    with pytest.raises(ValueError, match="route_cpu: out"):
        route_cpu(x, w, 4, out=(torch.empty(2, 4), torch.empty(2, 4)))


def test_which_calls_take_it(monkeypatch):
    x, w = _inputs(17, 16, 32, 1)
    assert route_cpu_serves(x[:16], w, 16)
    assert not route_cpu_serves(x, w, 17)  # a prompt chunk: the torch form
    assert not route_cpu_serves(x[:1].double(), w.double(), 1)
    assert not route_cpu_serves(x[:1], w.clone().requires_grad_(True), 1)
    def same(a, b):
        return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    assert same(route(w, x[:16], 2), route_cpu(x[:16], w, 2))
    assert same(route(w, x, 2), route_reference(torch.nn.functional.linear(x, w), 2))
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert same(route(w, x[:16], 2), route_reference(torch.nn.functional.linear(x[:16], w), 2))


def test_the_warm_up_compiles_what_decode_calls_take():
    """After warm_up, a decode's calls (strided rows, out buffers, both logits forms) compile nothing more."""
    router_cpu.warm_up()
    kernels = router_cpu._route_rows, router_cpu._pick_rows
    before = [len(k.signatures) for k in kernels]
    assert all(before)
    wide = torch.randn(3, 80)
    out = torch.empty(2, 2, dtype=torch.int64), torch.empty(2, 2)
    route_cpu(wide[:2, :64], torch.randn(16, 64), 2, out=out)  # rows strided
    route_cpu(wide[:1, :64], torch.randn(300, 64), 2)
    assert [len(k.signatures) for k in kernels] == before
