"""CUDA C kernels built at run time by NVRTC through cupy and launched on torch's current stream (so they go
into the decode's CUDA graphs like any torch or Triton launch).

cupy is imported only when a CUDA C form is on: CPU machines (CI) never load it. A kernel that NVRTC or the
driver cannot build (too old for the GPU, say) is reported once and not tried again; its caller then keeps
its Triton twin, which gives the same bits (the expert rows) or passes the same tests (the dense GEMV).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Hashable

import numpy as np
import torch

log = logging.getLogger(__name__)

_FAILED: set[Hashable] = set()  # kernels that could not be built here (not tried again)


@functools.cache
def has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def build(source: str, name: str, options: tuple[str, ...], device: int):
    """The compiled kernel `name` of `source` on CUDA device `device` (cupy RawKernel; cupy caches the
    binary on disk too)."""
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawModule(code=source, options=("-std=c++17", *options)).get_function(name)


def min_ctas_option(n: int) -> tuple[str, ...]:
    """The NVRTC option that caps a kernel's registers for n CTAs an SM (its source's
    `__launch_bounds__(threads, MIN_CTAS)` under `#ifdef MIN_CTAS`); none for n = 1, so the kernel is
    compiled exactly as without the cap (the compiler's choice)."""
    return (f"-DMIN_CTAS={n}",) if n > 1 else ()


def build_or_none(key: Hashable, builder: Callable[[], object], what: str, fallback: str):
    """builder(), or None after one warning where it raises (cupy's CompileException, CUDADriverError, a
    missing NVRTC library): `fallback` names what takes the launches then."""
    if key in _FAILED:
        return None
    try:
        return builder()
    except Exception as e:
        _FAILED.add(key)
        first = str(e).splitlines()[0] if str(e) else ""
        log.warning("the CUDA C %s could not be built (%s: %s); %s", what, type(e).__name__, first, fallback)
        return None


def device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's address as a kernel argument."""
    return np.uint64(t.data_ptr())


def ptr_or_null(t: torch.Tensor | None) -> np.uint64:
    """A tensor's address, or a null pointer for None (an argument the kernel may go without)."""
    return np.uint64(0) if t is None else ptr(t)


class _StreamRef:
    """A raw stream handle in the CUDA stream protocol (what cupy's Stream.from_external takes)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


@functools.lru_cache(maxsize=64)
def _cupy_stream(handle: int, device: int):
    """cupy's view of a torch stream (made once a handle: launches inside graph captures reuse it)."""
    import cupy

    with cupy.cuda.Device(device):
        if hasattr(cupy.cuda.Stream, "from_external"):  # cupy 14: ExternalStream is deprecated
            return cupy.cuda.Stream.from_external(_StreamRef(handle))
        with warnings.catch_warnings():  # cupy 14.2 warns but has no from_external yet
            warnings.filterwarnings("ignore", "ExternalStream is deprecated", DeprecationWarning)
            return cupy.cuda.ExternalStream(handle, device)


def launch(kernel, grid: tuple[int, ...], block: int, args: tuple, device: int, shared_mem: int = 0) -> None:
    """kernel<<<grid, block, shared_mem>>>(args) on torch's current stream of `device`."""
    import cupy

    stream = _cupy_stream(torch.cuda.current_stream(device).cuda_stream, device)
    with cupy.cuda.Device(device), stream:
        kernel(grid, (block,), args, shared_mem=shared_mem)
