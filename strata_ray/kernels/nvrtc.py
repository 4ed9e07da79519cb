"""CUDA C kernels built at run time by NVRTC through cupy and launched on torch's current stream (so they go
into the decode's CUDA graphs like any torch or Triton launch).

cupy is imported only when a CUDA C form is on: CPU machines (CI) never load it. A kernel that NVRTC or the
driver cannot build (too old for the GPU, say) is reported once and not tried again; its caller then keeps
its Triton twin, which gives the same bits (the expert rows) or passes the same tests (the dense GEMV).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import warnings
from collections.abc import Callable, Hashable

import numpy as np
import torch

from .contract import KernelError
from .pdl import pdl_on_device

log = logging.getLogger(__name__)

_FAILED: set[Hashable] = set()  # kernels that could not be built here (not tried again)
_ARITY: dict[int, tuple[object, str, int]] = {}  # id(kernel) -> (kernel, its name, its parameters)


@functools.cache
def has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def build(source: str, name: str, options: tuple[str, ...], device: int):
    """The compiled kernel `name` of `source` on CUDA device `device` (cupy RawKernel; cupy caches the
    binary on disk too). STRATA_NVRTC_LINEINFO=1 adds the source lines for a profiler (ncu's source page:
    line n is line n of `source`), which leaves the code as it is."""
    import cupy

    lines = ("-lineinfo",) if os.environ.get("STRATA_NVRTC_LINEINFO") == "1" else ()
    with cupy.cuda.Device(device):
        kernel = cupy.RawModule(code=source, options=("-std=c++17", *options, *lines)).get_function(name)
    n = kernel_params(source, name)
    if n is not None:  # held with the kernel (the kernels are cached for good): its id stays its own
        _ARITY[id(kernel)] = (kernel, name, n)
    return kernel


def kernel_params(source: str, name: str) -> int | None:
    """How many parameters `extern "C" __global__ void ... name(...)` of source takes: its list's top-level
    commas + 1; None where the source has no such signature or a directive inside its list (unknown). A
    launch with another count would read past its arguments (a segfault, not an error): launch() checks."""
    m = re.search(r'extern\s+"C"\s+__global__\s+void\s+[^;{]*?\b' + re.escape(name) + r"\s*\(", source)
    if m is None:
        return None
    depth, commas, body = 1, 0, []
    for ch in source[m.end():]:
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            break
        commas += ch == "," and depth == 1
        body.append(ch)
    text = "".join(body)
    if "#" in text:
        return None
    return commas + 1 if text.strip() and text.strip() != "void" else 0


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


# the kernels' PDL hooks (kernels/pdl.py), for a source to paste in: pdl_trigger() lets the next kernel start
# once every CTA has passed it; pdl_wait() returns once the kernel before has completed (both no-ops without
# PDL, and below sm_90: there a launch never asks for PDL, pdl_on_device, and NVRTC builds for the device's
# own architecture, so a PDL launch always runs code that waits)
PDL_HOOKS = r"""
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
"""

_CTYPES = {np.uint64: ctypes.c_uint64, np.int32: ctypes.c_int32, np.int64: ctypes.c_int64,
           np.float32: ctypes.c_float}


@functools.cache
def _driver():
    """cuda.bindings' driver module, or None (no PDL launches then: cupy's launch instead)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def _launch_pdl(kernel, grid: tuple[int, ...], block: int, args: tuple, stream: int, shared_mem: int,
                device: int):
    """The launch through cuLaunchKernelEx with programmatic stream serialization: True where it ran; None
    where cuda.bindings is missing or PDL was turned off; else (outside a graph capture) the error, for
    launch() to try cupy's launch and tell a PDL failure from the launch's own (the kernels' first launches
    are eager warm-ups, so a cuda.bindings or a driver that cannot is found there). Inside a capture a
    failure raises: a graph half captured has no way back."""
    cu = _driver()
    if cu is None or "pdl" in _FAILED:
        return None
    import cupy

    err = None
    try:
        # the device current for cupy's Function (built for it) and for the driver's launch context
        with cupy.cuda.Device(device), torch.cuda.device(device):
            func, cfg, params = _pdl_config(cu, kernel, grid, block, args, stream, shared_mem)
            (err,) = cu.cuLaunchKernelEx(cfg, func, params, 0)
    except Exception as e:  # an older or newer cuda.bindings (its config, its packing), cupy's build
        if _capturing(device):
            raise
        err = e
    if err == cu.CUresult.CUDA_SUCCESS:
        return True
    if _capturing(device):
        raise RuntimeError(f"cuLaunchKernelEx: {err}")
    return err if err is not None else RuntimeError("cuLaunchKernelEx: no result")


def _capturing(device: int) -> bool:
    """Whether torch's current stream of `device` (launch's stream) is capturing a graph: asked with that
    device current, since from another device's context torch would answer for that device's stream."""
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _pdl_config(cu, kernel, grid: tuple[int, ...], block: int, args: tuple, stream: int, shared_mem: int):
    """(the kernel's CUfunction, cuLaunchKernelEx's config with the PDL attribute, the kernel's parameters as
    (values, ctypes))."""
    func = cu.CUfunction(kernel.kernel.ptr)  # cupy's RawKernel -> its Function (built for the device)
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (*grid, 1, 1)[:3]
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
    cfg.sharedMemBytes = shared_mem
    cfg.hStream = cu.CUstream(stream)
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs, cfg.numAttrs = [attr], 1
    params = (tuple(int(a) if isinstance(a, np.integer) else float(a) for a in args),
              tuple(_CTYPES[type(a)] for a in args))
    return func, cfg, params


def launch(kernel, grid: tuple[int, ...], block: int, args: tuple, device: int, shared_mem: int = 0,
           pdl: bool = False) -> None:
    """kernel<<<grid, block, shared_mem>>>(args) on torch's current stream of `device`. pdl: the kernel calls
    pdl_wait() before it reads anything the kernel before wrote (PDL_HOOKS), so it may take programmatic
    dependent launch where kernels/pdl.py allows it."""
    known = _ARITY.get(id(kernel))
    if known is not None and known[0] is kernel and known[2] != len(args):
        raise KernelError(f"the CUDA C kernel {known[1]} takes {known[2]} arguments, the launch passes "
                          f"{len(args)}")
    import cupy

    handle = torch.cuda.current_stream(device).cuda_stream
    pdl_err = None
    if pdl and pdl_on_device(device):
        pdl_err = _launch_pdl(kernel, grid, block, args, handle, shared_mem, device)
        if pdl_err is True:
            return
    stream = _cupy_stream(handle, device)
    with cupy.cuda.Device(device), stream:
        kernel(grid, (block,), args, shared_mem=shared_mem)  # raises where the launch itself is at fault
    if pdl_err is not None:  # cupy's launch ran where cuLaunchKernelEx's did not: PDL's failure, for good
        _FAILED.add("pdl")
        log.warning("CUDA C kernels launch without PDL: cuLaunchKernelEx failed (%s)", pdl_err)
