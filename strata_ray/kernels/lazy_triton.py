"""Triton kernels jitted on first use, so the modules that hold them import on machines without triton.

A kernel body is a plain function whose annotations name `tl.constexpr` (strings, under `from __future__
import annotations`) and whose code reads the module global `tl`. `jit_bodies` binds that global to
triton.language and hands the bodies to triton.jit; the module calls it from a functools.cache'd getter,
so triton is imported (and the bodies jitted) once, at the first launch. TRITON_INTERPRET=1 then runs the
same bodies on the CPU (the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def jit_bodies(*bodies: Callable, do_not_specialize: Sequence[str] = ()) -> tuple:
    """triton.jit of each body, after binding `tl` in the bodies' module(s); do_not_specialize: runtime
    arguments whose values must not pick a new binary (applies to every body)."""
    import triton
    import triton.language

    for body in bodies:
        body.__globals__["tl"] = triton.language
    return tuple(triton.jit(body, do_not_specialize=list(do_not_specialize)) for body in bodies)
