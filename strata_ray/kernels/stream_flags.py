"""A CUDA stream that waits for a value a CPU thread writes to host memory (DESIGN section 8).

The decode step hands each layer's non-resident experts to the CPU pool. Without a device-side wait the
host must finish the CPU rows before it may enqueue anything that reads them, so the device idles while
the host computes and the host cannot launch the next layer's graph (~0.1-0.2 ms a launch on the H200
host) until then. With a flag the host enqueues "wait until the flag reaches v", the copy of the CPU rows
and the next layer's work at once, and a helper thread computes the rows, writes them, then writes v.

`cuStreamWaitValue32` is a driver call (stream memory operations), reached here through ctypes on
libcuda: torch does not expose it. The flag is an int32 in page-locked memory (torch's pinned allocator:
mapped into the device's address space under unified addressing). Values only grow (a wrapping
32-bit counter), and the wait is "(int32)(flag - v) >= 0", so a stale value never releases a later
wait, across the wrap too.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from .cpu_atomics import raise_flag_value

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0


class StreamFlagError(RuntimeError):
    """The driver refused a stream wait; one line."""


@functools.cache
def _driver():
    """libcuda's cuStreamWaitValue32 (the v2 entry point of CUDA >= 11.7) and cuMemHostGetDevicePointer,
    or None where the driver lacks them."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        wait = lib.cuStreamWaitValue32_v2
        host_ptr = lib.cuMemHostGetDevicePointer_v2
    except (OSError, AttributeError):
        return None
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wait.restype = ctypes.c_int
    host_ptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    host_ptr.restype = ctypes.c_int
    return wait, host_ptr


class HostFlag:
    """An int32 in page-locked host memory that a CUDA stream can wait on.

    Host side: `arm()` the next value, hand it to the thread that will `set()` it; device side: `wait(v)`
    enqueues a stop on the current stream until the flag reaches v."""

    def __init__(self, device: torch.device):
        drv = _driver()
        if drv is None:
            raise StreamFlagError("this CUDA driver has no cuStreamWaitValue32_v2 (CUDA 11.7 or newer)")
        self._wait, host_ptr = drv
        self.device = device
        self.tensor = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # [1]
        self._host = self.tensor.numpy().view(np.uint32)  # the driver compares 32-bit values
        self.value = 0
        dptr = ctypes.c_uint64(0)
        if host_ptr(ctypes.byref(dptr), ctypes.c_void_p(self.tensor.data_ptr()), 0) != 0:
            dptr.value = self.tensor.data_ptr()  # unified addressing: the host address is the device's
        self._dptr = dptr.value
        raise_flag_value(self._host, 0)  # its numba function loaded (or compiled) now, not at a token's flag
        self.wait(0)  # already reached: checks the driver takes the call, then leaves the stream as it was
        torch.cuda.current_stream(device).synchronize()

    @property
    def host(self) -> np.ndarray:
        """uint32 [1]: the flag as host code writes it (a numba kernel can raise it: expert_ffn_cpu's
        `done`)."""
        return self._host

    def arm(self) -> int:
        """The next value to wait for (and to set when the work it guards is done)."""
        self.value = (self.value + 1) & 0xFFFFFFFF
        return self.value

    def wait(self, value: int) -> None:
        """The current stream stops here until the flag reaches `value`."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        rc = self._wait(ctypes.c_void_p(stream), self._dptr, value, WAIT_GEQ)
        if rc != 0:
            raise StreamFlagError(f"cuStreamWaitValue32 failed (CUresult {rc})")

    def set(self, value: int) -> None:
        """Release the waits for values up to `value` (call after the guarded host writes): a release store
        (cpu_atomics.raise_flag), so the device reads the data written before the flag on any host, not
        only where the CPU keeps stores in order (x86)."""
        raise_flag_value(self._host, value)


def host_flag(device: torch.device) -> HostFlag | None:
    """A HostFlag on this CUDA device, or None where the driver cannot wait on host memory."""
    try:
        return HostFlag(device)
    except StreamFlagError:
        return None
