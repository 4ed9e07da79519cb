"""The routed handoff kernel (strata_ray/kernels/publish.py) against its plain twin.

The kernel runs under the Triton interpreter on CPU machines with triton (tests/kernels/triton_interpret.py)
and on the GPU, into page-locked buffers (python -m pytest -m gpu tests/kernels/test_publish.py); the
pipelined decode's GPU tests (tests/experts/test_tiered_gpu.py) run it in every layer's graph.
"""

from __future__ import annotations

import time

import pytest
import torch

from strata_ray.kernels.act_quant import quantize_act_sums
from strata_ray.kernels.publish import ActCodes, publish, publish_reference
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()


def _codes(e: int, device: str, pin: bool) -> ActCodes:
    """Codes buffers for an x of e values, filled with a value no quantizer writes everywhere."""
    def one(n, dtype):
        t = torch.full((1, n), -7 if dtype != torch.float32 else float("nan"), dtype=dtype)
        return (t.pin_memory() if pin else t).to(device)

    return ActCodes(one(e, torch.int8), one(e // 32, torch.float32), one(e // 32, torch.int32))


# an x of at least this many values holds poisoned blocks (a NaN, +inf, -inf, and a NaN among zeros)
POISONED = 224


def _buffers(k: int, e: int, layers: int, device: str, pin: bool):
    """ids [1, K], x [1, E] (device), ids_host [K], ids_all [L, K], codes_host (host), flag [1] (host)."""
    g = torch.Generator().manual_seed(k * e)
    ids = torch.randint(0, 512, (1, k), generator=g).to(device)
    x = torch.randn(1, e, generator=g) * torch.rand(1, e, generator=g) * 4  # a spread of block scales
    x[0, :32] = 0.0  # a block of zeros: d = 0, codes 0
    if e >= POISONED:  # poisoned blocks (the contract's step 1: q = 0, d = NaN, s = 0): a NaN, +inf, -inf,
        x[0, 37], x[0, 64], x[0, 127] = float("nan"), float("inf"), float("-inf")
        x[0, 128:160] = 0.0
        x[0, 150] = float("nan")  # and a NaN among zeros, which the block's max alone does not see
    x = x.to(device)

    def host(*shape, dtype):
        t = torch.full(shape, -1, dtype=dtype)
        return t.pin_memory() if pin else t

    return ids, x, host(k, dtype=torch.int64), host(layers, k, dtype=torch.int64), _codes(e, "cpu", pin), \
        host(1, dtype=torch.int32)


def _same(a: ActCodes, b: ActCodes) -> bool:
    """Bit for bit (NaN scales too)."""
    return all(torch.equal(u.cpu().view(torch.int8), w.cpu().view(torch.int8))
               for u, w in zip(a, b, strict=True))


def _cases(device: str, pin: bool):
    for k, e, layer, base in [(1, 32, 0, 5), (10, 2048, 3, 7), (8, POISONED, 47, (1 << 32) - 20)]:
        got = _buffers(k, e, 48, device, pin)
        want = _buffers(k, e, 48, "cpu", False)
        codes, w_codes = _codes(e, device, False), _codes(e, "cpu", False)
        b = torch.tensor([base], dtype=torch.int64, device=device)
        staged = torch.tensor([7, -1, 3][: 1 + k % 3], dtype=torch.int32, device=device)  # copied ahead
        host = torch.full((staged.numel(),), 9, dtype=torch.int64)
        host = host.pin_memory() if pin else host
        w_host = torch.full((staged.numel(),), 9, dtype=torch.int64)
        publish(*got, b, layer, staged, host, codes)
        if device == "cuda":
            torch.cuda.synchronize()
        publish_reference(*[t.cpu() for t in got[:2]], *want[2:], b.cpu(), layer, staged.cpu(), w_host,
                          w_codes)
        assert torch.equal(host, w_host) and host.tolist() == staged.tolist()
        for a, w in zip(got[2:4] + got[5:], want[2:4] + want[5:], strict=True):
            assert torch.equal(a, w), (k, e, layer)
        # the codes, bit for bit: host and device, against the numpy quantizer and the CPU workers' own
        assert _same(got[4], w_codes) and _same(codes, w_codes), (k, e, layer)
        q, d, s = quantize_act_sums(got[1].cpu().numpy())
        assert _same(w_codes, ActCodes(*(torch.from_numpy(v) for v in (q, d, s))))
        assert int(w_codes.d[0, 0]) == 0 and int(w_codes.s[0, 0]) == 0 and (w_codes.q[0, :32] == 0).all()
        if e >= POISONED:
            assert torch.isnan(w_codes.d[0, 1:5]).all() and (w_codes.s[0, 1:5] == 0).all()
            assert (w_codes.q[0, 32:160] == 0).all()
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
    ids, x, ids_host, ids_all, codes_host, flag = _buffers(10, 64, 4, "cpu", False)
    codes = _codes(64, "cpu", False)
    staged = torch.tensor([5, -1, 511][:c], dtype=torch.int32)
    host = torch.full((c,), 9, dtype=torch.int64)
    base = torch.tensor([3], dtype=torch.int64)
    publish_reference(ids, x, ids_host, ids_all, codes_host, flag, base, 1, staged, host, codes)
    assert host.tolist() == staged.tolist() and int(flag[0]) == 4
    with pytest.raises(ValueError, match="staged and staged_host come together"):
        publish_reference(ids, x, ids_host, ids_all, codes_host, flag, base, 1, staged, codes=codes)
    with pytest.raises(ValueError, match="staged must be"):
        publish_reference(ids, x, ids_host, ids_all, codes_host, flag, base, 1, staged.long(), host, codes)


def test_reference_and_errors():
    ids, x, ids_host, ids_all, codes_host, flag = _buffers(10, 64, 4, "cpu", False)
    codes = _codes(64, "cpu", False)
    base = torch.tensor([(1 << 32) - 1], dtype=torch.int64)
    publish_reference(ids, x, ids_host, ids_all, codes_host, flag, base, 2, codes=codes)
    assert int(flag[0]) == 1 and torch.equal(ids_all[2], ids[0]) and _same(codes_host, codes)
    with pytest.raises(ValueError, match="int64"):
        publish_reference(ids.int(), x, ids_host, ids_all, codes_host, flag, base, 0, codes=codes)
    with pytest.raises(ValueError, match="host buffers must hold"):
        publish_reference(ids, x, ids_host[:3], ids_all, codes_host, flag, base, 0, codes=codes)
    with pytest.raises(ValueError, match="layer 4 of 4"):
        publish(ids, x, ids_host, ids_all, codes_host, flag, base, 4, codes=codes)
    with pytest.raises(ValueError, match="x, codes_host and codes come together"):
        publish_reference(ids, x, ids_host, ids_all, None, flag, base, 0, codes=codes)
    with pytest.raises(ValueError, match="x, codes_host and codes come together"):
        publish_reference(ids, x, ids_host, ids_all, codes_host, flag, base, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        publish_reference(ids, x[:, :40], ids_host, ids_all, codes_host, flag, base, 0, codes=codes)
    with pytest.raises(ValueError, match="codes must be contiguous int8"):
        publish_reference(ids, x, ids_host, ids_all, codes_host, flag, base, 0,
                          codes=_codes(32, "cpu", False))
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
    """publish after a long kernel: the host does not see the flag early, and once it does, the ids and
    codes it guards are in host memory (the fences before the flag's store)."""
    from strata_ray.kernels.expert_cpu_token import reached
    from strata_ray.kernels.stream_flags import HostFlag

    dev = torch.device("cuda")
    flag = HostFlag(dev)
    reached(flag.host, 5)  # compiled (or loaded) now: a first call inside the check would outlast the sleep
    ids = torch.arange(10, device=dev)
    x = torch.full((1, 2048), 3.0, device=dev)
    ids_host, codes_host = torch.zeros(10, dtype=torch.int64).pin_memory(), _codes(2048, "cpu", True)
    codes = _codes(2048, "cuda", False)
    ids_all = torch.zeros(4, 10, dtype=torch.int64).pin_memory()
    base = torch.tensor([5], dtype=torch.int64, device=dev)
    # this form of the kernel compiled now, into a flag of its own (a compile inside the check would outlast
    # the sleep)
    publish(ids, x, ids_host, ids_all, codes_host, HostFlag(dev).tensor, base, 0, codes=codes)
    torch.cuda.current_stream(dev).synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the kernel starts late, the host must not see the flag early
    publish(ids, x, ids_host, ids_all, codes_host, flag.tensor, base, 0, codes=codes)
    assert not reached(flag.host, 5)
    t = time.perf_counter()
    while not reached(flag.host, 5):
        assert time.perf_counter() - t < 10
    # every block of 3.0s: d = 3/127, every code 127, sums 32 * 127
    assert bool((codes_host.q == 127).all()) and bool((codes_host.s == 32 * 127).all())
    assert ids_host.tolist() == list(range(10))
    torch.cuda.current_stream(dev).synchronize()  # nothing of this test is pending when its memory is freed
