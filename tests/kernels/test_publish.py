"""The routed handoff kernel (strata_ray/kernels/publish.py) against its plain twin.

The kernel runs under the Triton interpreter on CPU machines with triton (tests/kernels/triton_interpret.py)
and on the GPU, into page-locked buffers (python -m pytest -m gpu tests/kernels/test_publish.py); the
pipelined decode's GPU tests (tests/experts/test_tiered_gpu.py) run it in every layer's graph.
"""

from __future__ import annotations

import time

import pytest
import torch

from strata_ray.kernels.publish import publish, publish_reference
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()


def _buffers(k: int, e: int, layers: int, device: str, pin: bool):
    g = torch.Generator().manual_seed(k * e)
    ids = torch.randint(0, 512, (1, k), generator=g).to(device)
    x = torch.randn(1, e, generator=g).to(device)

    def host(*shape, dtype):
        t = torch.full(shape, -1, dtype=dtype)
        return t.pin_memory() if pin else t

    return ids, x, host(k, dtype=torch.int64), host(layers, k, dtype=torch.int64), \
        host(1, e, dtype=torch.float32), host(1, dtype=torch.int32)


def _cases(device: str, pin: bool):
    for k, e, layer, base in [(1, 32, 0, 5), (10, 2048, 3, 7), (8, 100, 47, (1 << 32) - 20)]:
        got = _buffers(k, e, 48, device, pin)
        want = _buffers(k, e, 48, "cpu", False)
        b = torch.tensor([base], dtype=torch.int64, device=device)
        staged = torch.tensor([7, -1, 3][: 1 + k % 3], dtype=torch.int32, device=device)  # copied ahead
        host = torch.full((staged.numel(),), 9, dtype=torch.int64)
        host = host.pin_memory() if pin else host
        w_host = torch.full((staged.numel(),), 9, dtype=torch.int64)
        publish(*got, b, layer, staged, host)
        if device == "cuda":
            torch.cuda.synchronize()
        publish_reference(*[t.cpu() for t in got[:2]], *want[2:], b.cpu(), layer, staged.cpu(), w_host)
        assert torch.equal(host, w_host) and host.tolist() == staged.tolist()
        for a, w in zip(got[2:], want[2:], strict=True):
            assert torch.equal(a, w), (k, e, layer)
        assert got[3][layer].tolist() == got[0].view(-1).tolist() and (got[3][layer - 1] == -1).all()
        assert int(got[5][0]) & 0xFFFFFFFF == (base + layer) & 0xFFFFFFFF  # the 32-bit wrap
        # the ids alone (a predicted routing: no x), with the staged list
        ids, _, ids_host, ids_all, _, flag = _buffers(k, e, 48, device, pin)
        publish(ids, None, ids_host, ids_all, None, flag, b, layer, staged, host)
        if device == "cuda":
            torch.cuda.synchronize()
        assert ids_host.tolist() == ids.view(-1).tolist() and ids_all[layer].tolist() == ids_host.tolist()
        assert int(flag[0]) & 0xFFFFFFFF == (base + layer) & 0xFFFFFFFF and host.tolist() == staged.tolist()


@pytest.mark.parametrize("c", [1, 3])
def test_staged_list_travels_with_the_routing(c):
    """The experts copied ahead (int32 on the device) land in the host's int64 list before the flag."""
    ids, x, ids_host, ids_all, x_host, flag = _buffers(10, 64, 4, "cpu", False)
    staged = torch.tensor([5, -1, 511][:c], dtype=torch.int32)
    host = torch.full((c,), 9, dtype=torch.int64)
    base = torch.tensor([3], dtype=torch.int64)
    publish_reference(ids, x, ids_host, ids_all, x_host, flag, base, 1, staged, host)
    assert host.tolist() == staged.tolist() and int(flag[0]) == 4
    with pytest.raises(ValueError, match="come together"):
        publish_reference(ids, x, ids_host, ids_all, x_host, flag, base, 1, staged)
    with pytest.raises(ValueError, match="staged must be"):
        publish_reference(ids, x, ids_host, ids_all, x_host, flag, base, 1, staged.long(), host)


def test_reference_and_errors():
    ids, x, ids_host, ids_all, x_host, flag = _buffers(10, 64, 4, "cpu", False)
    base = torch.tensor([(1 << 32) - 1], dtype=torch.int64)
    publish_reference(ids, x, ids_host, ids_all, x_host, flag, base, 2)
    assert int(flag[0]) == 1 and torch.equal(ids_all[2], ids[0]) and torch.equal(x_host, x)
    with pytest.raises(ValueError, match="int64"):
        publish_reference(ids.int(), x, ids_host, ids_all, x_host, flag, base, 0)
    with pytest.raises(ValueError, match="host buffers must hold"):
        publish_reference(ids, x, ids_host[:3], ids_all, x_host, flag, base, 0)
    with pytest.raises(ValueError, match="layer 4 of 4"):
        publish(ids, x, ids_host, ids_all, x_host, flag, base, 4)
    with pytest.raises(ValueError, match="x and x_host come together"):
        publish_reference(ids, x, ids_host, ids_all, None, flag, base, 0)
    publish_reference(ids, None, ids_host, ids_all, None, flag, base, 3)  # the ids alone
    assert int(flag[0]) == 2 and torch.equal(ids_all[3], ids[0])


@interpret
def test_interpreted_publish_matches_reference():
    pytest.importorskip("triton")
    _cases("cpu", False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_publish_into_page_locked_buffers():
    _cases("cuda", True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_the_host_sees_the_flag_only_with_the_data():
    """publish after a long kernel: the host does not see the flag early, and once it does, the ids and x
    it guards are in host memory (the fences before the flag's store)."""
    from strata_ray.kernels.expert_cpu_token import reached
    from strata_ray.kernels.stream_flags import HostFlag

    dev = torch.device("cuda")
    flag = HostFlag(dev)
    reached(flag.host, 5)  # compiled (or loaded) now: a first call inside the check would outlast the sleep
    ids = torch.arange(10, device=dev)
    x = torch.full((1, 2048), 3.0, device=dev)
    ids_host, x_host = torch.zeros(10, dtype=torch.int64).pin_memory(), torch.zeros(1, 2048).pin_memory()
    ids_all = torch.zeros(4, 10, dtype=torch.int64).pin_memory()
    base = torch.tensor([5], dtype=torch.int64, device=dev)
    # this form of the kernel compiled now, into a flag of its own (a compile inside the check would outlast
    # the sleep)
    publish(ids, x, ids_host, ids_all, x_host, HostFlag(dev).tensor, base, 0)
    torch.cuda.current_stream(dev).synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the kernel starts late, the host must not see the flag early
    publish(ids, x, ids_host, ids_all, x_host, flag.tensor, base, 0)
    assert not reached(flag.host, 5)
    t = time.perf_counter()
    while not reached(flag.host, 5):
        assert time.perf_counter() - t < 10
    assert bool((x_host == 3.0).all()) and ids_host.tolist() == list(range(10))
    torch.cuda.current_stream(dev).synchronize()  # nothing of this test is pending when its memory is freed
