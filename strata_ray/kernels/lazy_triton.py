"""Triton kernels jitted on first use, so the modules that hold them import on machines without triton.

A kernel body is a plain function whose annotations name `tl.constexpr` (strings, under `from __future__
import annotations`) and whose code reads the module global `tl`. `jit_bodies` binds that global to
triton.language and hands the bodies to triton.jit; the module calls it from a functools.cache'd getter,
so triton is imported (and the bodies jitted) once, at the first launch. TRITON_INTERPRET=1 then runs the
same bodies on the CPU (the tests).

Triton 3.9 contracts a multiply and an add into an FMA unless a launch says `enable_fp_fusion=False` (the
arithmetic contract's kernels say so) and warns that 3.10 turns that default off. The other kernels (the
dense path: norms, GEMVs, the GDN step, attention) were measured with FMA, and every GPU run so far gave
their bits with it, so jit_bodies keeps that default where the user has not chosen one
(TRITON_DEFAULT_FP_FUSION): a Triton upgrade does not change their bits or speed unseen.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence


def jit_bodies(*bodies: Callable, do_not_specialize: Sequence[str] = ()) -> tuple:
    """triton.jit of each body, after binding `tl` in the bodies' module(s); do_not_specialize: runtime
    arguments whose values must not pick a new binary (applies to every body)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # before any launch compiles (read there)
    import triton
    import triton.language

    for body in bodies:
        body.__globals__["tl"] = triton.language
    return tuple(triton.jit(body, do_not_specialize=list(do_not_specialize)) for body in bodies)
