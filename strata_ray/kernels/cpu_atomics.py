"""Acquire loads, release stores and an atomic add on numpy array elements, for numba kernels that hand data
to another thread or to the device through a flag, and one njit release store for Python callers.

A flag raised after the data it guards must be a release store: it orders every write before it ahead of
the flag, for the compiler and for the CPU. x86 keeps stores in program order anyway, but an aarch64 host
(a Grace Hopper board) does not, and a plain store lets LLVM move it too where it can prove the arrays
apart: the device (or a thread) could read the flag's value before the rows it guards, and the contract's
bits with them. The reader's side is an acquire load: no later read moves before it.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic


def _element(context, builder, signature, args):
    """The address of arr[idx] (args: the array, the index)."""
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.gep(ary.data, [args[1]])


@intrinsic
def load_acquire(typingctx, arr, idx):
    """arr[idx] as an acquire load: read again on every call (another thread, or the device, writes it),
    and no later read moves before it."""
    sig = arr.dtype(arr, idx)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_element(context, builder, signature, args), ordering="acquire",
                                   align=arr.dtype.bitwidth // 8)

    return sig, codegen


@intrinsic
def store_release(typingctx, arr, idx, val):
    """arr[idx] = val (of arr's dtype) as a release store: the writes before it are seen first."""
    sig = types.void(arr, idx, arr.dtype)

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _element(context, builder, signature, args), ordering="release",
                             align=arr.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fetch_add(typingctx, arr, idx, val):
    """arr[idx] += val atomically, returning the old value (acquire-release: a barrier's arrival publishes
    the member's writes)."""
    sig = arr.dtype(arr, idx, arr.dtype)

    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _element(context, builder, signature, args), args[2], "acq_rel")

    return sig, codegen


@njit(nogil=True, cache=True)
def raise_flag(flag, value) -> None:
    """flag[0] = value as a release store, from Python (flag uint32 [1], value np.uint32): after host writes
    the device reads once it sees the flag (stream_flags.HostFlag.set)."""
    store_release(flag, 0, value)


def raise_flag_value(flag: np.ndarray, value: int) -> None:
    """raise_flag with value as the flag's own type (one numba signature for every caller)."""
    raise_flag(flag, flag.dtype.type(value))
