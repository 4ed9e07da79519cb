"""The in-graph wait for a host flag (strata_ray/kernels/flag_wait.py) against its plain twin.

The kernel runs under the Triton interpreter on CPU machines with triton (tests/kernels/triton_interpret.py)
and on the GPU over a page-locked flag (python -m pytest -m gpu tests/kernels/test_flag_wait.py); the
pipelined decode's GPU tests (tests/experts/test_tiered_gpu.py) run it in its token graphs.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from strata_ray.kernels.flag_wait import ORDERS, wait_flag, wait_flag_reference
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()
WRAP = 1 << 32


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - WRAP if v >= 1 << 31 else v


# (base, layer, a flag value that releases the wait, one that must not): the target is base + layer mod 2^32
CASES = [(5, 0, 5, 4), (7, 3, 11, 9), (WRAP - 2, 5, 3, WRAP - 1), (WRAP - 20, 47, 100, 26)]


@pytest.mark.parametrize("base,layer,released,held", CASES)
def test_reference_releases_at_the_target_across_the_wrap(base, layer, released, held):
    flag = torch.tensor([_int32(released)], dtype=torch.int32)
    wait_flag_reference(flag, torch.tensor([base]), layer)
    flag[0] = _int32(held)
    with pytest.raises(TimeoutError, match="stayed below"):
        wait_flag_reference(flag, torch.tensor([base]), layer, timeout_s=0.05)


def test_errors():
    flag, base = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="one int32"):
        wait_flag(flag.long(), base, 0)
    with pytest.raises(ValueError, match="one int64"):
        wait_flag_reference(flag, base.int(), 0)
    with pytest.raises(ValueError, match="layer -1"):
        wait_flag(flag, base, -1)
    with pytest.raises(ValueError, match="acquire, fence, relaxed"):
        wait_flag(flag, base, 0, order="seq_cst")


def test_a_bad_order_in_the_environment_is_one_line(monkeypatch):
    monkeypatch.setenv("STRATA_FLAG_ORDER", "sc")
    with pytest.raises(ValueError, match=r"STRATA_FLAG_ORDER: invalid value 'sc' \(allowed: acquire, fence"):
        wait_flag(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 0)


def _raise_later(flag: torch.Tensor, value: int, delay_s: float) -> threading.Thread:
    def go():
        time.sleep(delay_s)
        flag[0] = _int32(value)

    t = threading.Thread(target=go)
    t.start()
    return t


@interpret
@pytest.mark.parametrize("base,layer,released,held", CASES)
def test_interpreted_wait_holds_until_the_flag_reaches_the_target(base, layer, released, held):
    pytest.importorskip("triton")
    flag = torch.tensor([_int32(released)], dtype=torch.int32)
    wait_flag(flag, torch.tensor([base]), layer)  # already there: returns
    flag[0] = _int32(held)
    t0 = time.perf_counter()
    raiser = _raise_later(flag, released, 0.2)
    wait_flag(flag, torch.tensor([base]), layer)
    raiser.join()
    assert time.perf_counter() - t0 >= 0.2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("order", ORDERS)
def test_gpu_graph_waits_for_the_host_each_replay_at_its_base(order, monkeypatch):
    """A captured wait, then a write the host can see: the write lands only after the host raises the flag
    to the target, which moves with the device's base on every replay (no new graph). Each order's form
    (chosen by the environment, as the engine's graphs are)."""
    monkeypatch.setenv("STRATA_FLAG_ORDER", order)
    from strata_ray.kernels.stream_flags import HostFlag

    dev = torch.device("cuda")
    flag = HostFlag(dev)
    base = torch.zeros(1, dtype=torch.int64, device=dev)
    out = torch.zeros(1, dtype=torch.int64, device=dev)
    base.fill_(WRAP - 2)  # target 0: the flag's 0 releases it
    wait_flag(flag.tensor, base, 2)  # compiled now, not inside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wait_flag(flag.tensor, base, 2)
        out.add_(1)
    for round_base in (10, WRAP - 1, 40):
        target = (round_base + 2) & 0xFFFFFFFF
        flag.set((target - 1) & 0xFFFFFFFF)
        base.fill_(round_base)
        before = int(out.item())
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query(), "the graph ran past a flag below its target"
        flag.set(target)
        t0 = time.perf_counter()
        while not done.query():
            assert time.perf_counter() - t0 < 10, "the wait missed the flag"
        assert int(out.item()) == before + 1
