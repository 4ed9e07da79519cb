"""Programmatic dependent launch (PDL) for the decode chain's small kernels (Hopper and later).

A decode layer is a chain of ~12 small kernels (norms, the GDN step, the router, the publish, the combine),
each 1.3-6 us on an H100, and in a CUDA graph each still pays its launch and its programs' ramp after the
kernel before has drained. Launched with PDL, a kernel may start while the one before it finishes: its
programs run up to `gdc_wait()`, which returns once the kernel before has completed and its writes are
visible. So the launch, the programs' start and the loads of weights (which no kernel of the chain writes)
overlap the tail of the kernel before; `gdc_launch_dependents()` at a kernel's top lets the next one start
as soon as every program of this one is running. bench_pdl.py on an H100 (chains of 96 kernels in one
graph): a one-program norm 1.31 -> 1.05 us a kernel, a 512-program GEMV 2.21 -> 1.59 us with its weights
loaded before the wait (2.09 after it).

The rule every body with a PDL constexpr keeps: before `gdc_wait()` it loads only model weights and stores
nothing. Then a kernel that started early can neither read what the kernel before has not yet written nor
overwrite what it still reads, and since every such kernel waits, "the kernel before has completed" holds
down the whole chain (a kernel may start while several before it still run: only weights are safe to read
early). The CUDA C dense GEMV and expert rows keep the same rule with nvrtc.PDL_HOOKS (`pdl_trigger()`,
`pdl_wait()`), launched through cuda.bindings' cuLaunchKernelEx (nvrtc.launch(..., pdl=True)). A kernel
launched without PDL waits for the kernel before as always; one after it that has PDL starts once it ends
(it never calls the trigger). On an H100 (session 42, 8K): every expert resident 263 -> 284 tok/s with the
Triton kernels, 315 with the CUDA C ones too; a 24 GiB card 163 -> 183 tok/s over 256 tokens.

Off where the GPU is older than Hopper (sm_90), under the Triton interpreter (the CPU tests: the bodies'
PDL branches are then never taken), where the installed Triton has no `launch_pdl` (Triton launches) or
cuda.bindings is missing (CUDA C launches), and with STRATA_PDL=0 (A/B runs). The same bits either way: only
when a kernel starts moves.
"""

from __future__ import annotations

import functools
import os

import torch

from .env_knob import env_knob


def pdl_value(raw: str) -> bool:
    """STRATA_PDL's value: 0 (off) or 1 (on where the GPU and Triton have it, the default)."""
    if raw not in ("0", "1"):
        raise ValueError("0 or 1")
    return raw == "1"


@functools.cache
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(t: torch.Tensor) -> bool:
    """Whether Triton launches on t's device take PDL (see the module doc)."""
    if t.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _triton_has_pdl() and pdl_on_device(index)


def pdl_on_device(index: int) -> bool:
    """Whether launches on CUDA device `index` may take PDL: sm_90 or later and STRATA_PDL not 0 (the CUDA C
    kernels' launcher, kernels/nvrtc.py, asks this; Triton's must also have launch_pdl: pdl_on)."""
    return env_knob("STRATA_PDL", pdl_value, True) and _device_has_pdl(index)


def pdl_args(t: torch.Tensor) -> dict[str, bool]:
    """A converted body's launch keywords: its PDL constexpr and Triton's launch_pdl, both pdl_on(t)."""
    on = pdl_on(t)
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}
