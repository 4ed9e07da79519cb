"""HostFlag: a CUDA stream stops at wait(v) until a host thread sets the flag to v (cuStreamWaitValue32)."""

import threading
import time

import pytest
import torch

from strata_ray.kernels.stream_flags import HostFlag, _driver, host_flag

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_without_a_cuda_driver_there_is_no_flag():
    """No libcuda (CI): host_flag says so with None, and the decode computes its CPU rows in order."""
    if _driver() is not None:
        pytest.skip("this machine has a CUDA driver")
    assert host_flag(torch.device("cuda")) is None


def _released_copy(flag: HostFlag, value: int, delay: float = 0.2) -> tuple[torch.Tensor, float]:
    """Queue wait(value) then a copy of a pinned buffer a host thread fills only after `delay` s and then
    sets the flag; returns (what the device copied, seconds until the stream was done)."""
    dev = torch.device("cuda")
    src = torch.zeros(1 << 20, dtype=torch.float32, pin_memory=True)
    dst = torch.empty(1 << 20, dtype=torch.float32, device=dev)

    def writer():
        time.sleep(delay)
        src.numpy()[:] = 7.0
        flag.set(value)

    t = time.perf_counter()
    flag.wait(value)
    dst.copy_(src, non_blocking=True)
    thread = threading.Thread(target=writer)
    thread.start()
    torch.cuda.current_stream(dev).synchronize()
    thread.join()
    return dst.cpu(), time.perf_counter() - t


@pytest.mark.gpu
@needs_cuda
def test_the_stream_waits_for_the_flag_and_sees_the_data_written_before_it():
    flag = HostFlag(torch.device("cuda"))
    for _ in range(3):  # a fresh value each time: the earlier, smaller ones do not release it
        got, seconds = _released_copy(flag, flag.arm())
        assert seconds >= 0.2
        assert torch.all(got == 7.0)


@pytest.mark.gpu
@needs_cuda
def test_the_counter_wraps_without_releasing_early():
    flag = HostFlag(torch.device("cuda"))
    flag.value = 0xFFFFFFFF
    flag.set(0xFFFFFFFF)
    value = flag.arm()
    assert value == 0  # (int32)(0xFFFFFFFF - 0) < 0: still waits
    got, seconds = _released_copy(flag, value)
    assert seconds >= 0.2 and torch.all(got == 7.0)
