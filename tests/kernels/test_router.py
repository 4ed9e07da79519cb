"""The fused router (strata_ray/kernels/router.py) against moe.route's torch form.

CPU tests run in CI; the kernels run on the GPU (python -m pytest -m gpu tests/kernels/test_router.py)
and under the Triton interpreter on CPU machines with triton (tests/kernels/triton_interpret.py;
STRATA_TRITON_INTERPRET=1 forces it).
"""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.router import logits_tiles, route_reference, route_topk, router_logits
from strata_ray.model.moe import route
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()


def test_route_on_cpu_is_the_reference(monkeypatch):
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")  # the torch form (kernels/router_cpu's: test_router_cpu)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 32, generator=g), torch.randn(3, 32, generator=g)
    ids, wts = route(w, x, 4)
    ref_ids, ref_w = route_reference(x @ w.T, 4)
    assert torch.equal(ids, ref_ids) and torch.equal(wts, ref_w)
    torch.testing.assert_close(wts.sum(-1), torch.ones(3))


def _cases(device, shapes):
    for T, X, E, k in shapes:
        g = torch.Generator().manual_seed(T * X + k)
        w, x = torch.randn(X, E, generator=g).to(device), torch.randn(T, E, generator=g).to(device)
        logits = router_logits(x, w)
        torch.testing.assert_close(logits.cpu(), x.cpu() @ w.cpu().T, rtol=1e-5, atol=1e-4)
        ids, wts = route_topk(logits, k)
        ref_ids, ref_w = route_reference(logits, k)
        assert torch.equal(ids.cpu(), ref_ids.cpu()), (T, X, k)  # random logits: no near-ties
        torch.testing.assert_close(wts.cpu(), ref_w.cpu(), rtol=2e-6, atol=1e-7)
        one_ids, one_w = route_topk(logits[-1:], k)  # a token alone: its row of the batch
        assert torch.equal(one_ids, ids[-1:]) and torch.equal(one_w, wts[-1:])
        # into given buffers (the decode graphs'): the same values, every element written
        out = (torch.full_like(ids, -7), torch.full_like(wts, float("nan")))
        got = route_topk(logits, k, out=out)
        assert got[0] is out[0] and got[1] is out[1]
        assert torch.equal(out[0], ids) and torch.equal(out[1], wts)
    # ties: the lower expert id first (torch leaves the order of equal values open)
    flat = torch.zeros(1, 8, device=device)
    assert route_topk(flat, 3)[0].tolist() == [[0, 1, 2]]
    with pytest.raises(ValueError, match="out must be"):
        route_topk(flat, 3, out=(torch.empty(1, 3, dtype=torch.int32, device=device),
                                 torch.empty(1, 3, device=device)))




def test_logits_tiles_depend_on_the_shape_only():
    assert logits_tiles(512, 2048) == (1, 2048)  # the 80b-a3b's router: a whole row a program
    assert logits_tiles(1, 2048) == (1, 2048)  # its shared-expert gate
    assert logits_tiles(8192, 4096) == (2, 2048)
    assert logits_tiles(64, 5) == (1, 16)


@interpret
def test_interpreted_router():
    pytest.importorskip("triton")
    _cases("cpu", [(1, 64, 96, 4), (3, 37, 600, 1), (2, 512, 256, 10)])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_router():
    _cases("cuda", [(1, 512, 2048, 10), (16, 512, 2048, 10), (33, 128, 2048, 8), (1, 8, 256, 2)])
