"""A kernel that waits for a host flag: the CPU worker's rows, inside a graph of many layers.

The pipelined decode enqueued `cuStreamWaitValue32` (kernels/stream_flags.HostFlag.wait) between a layer's
rows graph and the next layer's segment graph: a stream operation with its value fixed by the host, so a
token was ~2 graph launches a layer. On the H200 host each launch cost 20-60 us of host time in the real
decode (session 20 trace: 109 launches a token, 4.7 ms), and with copies ahead of the routing (5 launches a
staged layer) the host, not the device or the worker, set the pace. Waiting inside the graph lets a run of
layers be one graph: this kernel spins (one thread) until the flag reaches base + layer, base read from the
device (set once a token, as publish reads it), so the value changes every token without a new graph.

The comparison is HostFlag's: (int32)(flag - target) >= 0 releases, so a stale value never releases a
later wait, across the 32-bit wrap too. The worker writes its rows, then the flag by a release store
(kernels/cpu_atomics); kernels after this one read the rows. The spin's loads are volatile ("relaxed"): in
the PTX memory model a relaxed load orders nothing after it, so the kernels after this one are not promised
the rows the worker wrote before its release store (in practice they always saw them: session 56 found no
stale read). "acquire" spins on `ld.acquire.sys` loads and "fence" adds one `fence.acq_rel.sys` after a
relaxed spin: either gives the promise. STRATA_FLAG_ORDER picks one (scripts/bench_flag_wait times them);
DEFAULT_ORDER is acquire; under the Triton interpreter (no inline PTX) the loads are volatile.

`wait_flag_reference` is the plain twin (the host spins), for tests.
"""

from __future__ import annotations

import functools
import os
import time

import torch
from torch import Tensor

from .env_knob import env_knob
from .lazy_triton import jit_bodies
from .pdl import pdl_args

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


ORDERS = ("acquire", "fence", "relaxed")
# acquire: what the PTX memory model asks for, at no measured cost. Session 58 on an H100 (bench_flag_wait,
# a graph of 48 layers, us a layer over the page-locked reads alone): acquire 2.156 (rounds 8.684-8.736 in
# all), relaxed 2.140 (8.684-8.740), fence 2.866 (the system fence ~0.7 us a layer more)
DEFAULT_ORDER = "acquire"


def _wait_body(FLAG, BASE, layer, ORDER: tl.constexpr, PDL: tl.constexpr):
    # FLAG int32 [1] (page-locked host memory); BASE int64 [1] (device). One program of one warp. ORDER: 1
    # acquiring loads, 2 relaxed ones and a fence after, 0 relaxed ones (the interpreter's). PDL: it starts
    # early, then waits for the kernel before (kernels/pdl.py: the kernels after this one count on everything
    # before it having completed)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    target = ((tl.load(BASE) + layer) & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)
    v = target - 1
    while v - target < 0:  # int32 arithmetic wraps: the flag's distance to the target, signed
        # a load over PCIe each time, never a cached copy: volatile, or an acquire at system scope
        if ORDER == 1:
            v = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [FLAG],
                                          dtype=tl.int32, is_pure=False, pack=1)
        else:
            v = tl.load(FLAG, volatile=True)
    if ORDER == 2:
        tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, $1;", "=r,r", [tl.zeros((1,), tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _kernel():
    return jit_bodies(_wait_body, do_not_specialize=["layer"])[0]


def _order_code(order: str | None) -> int:
    """The body's ORDER for a form's name (None: STRATA_FLAG_ORDER, else DEFAULT_ORDER); 0 under the
    interpreter, which runs no inline PTX."""
    if order is None:
        order = env_knob("STRATA_FLAG_ORDER", order_value, DEFAULT_ORDER)
    else:
        order_value(order)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    return {"acquire": 1, "fence": 2, "relaxed": 0}[order]


def order_value(value: str) -> str:
    """STRATA_FLAG_ORDER's value (and wait_flag's order): one of ORDERS (config.py checks it at start)."""
    if value not in ORDERS:
        raise ValueError(", ".join(ORDERS))
    return value


def _check(flag: Tensor, base: Tensor) -> None:
    if flag.dtype != torch.int32 or flag.numel() != 1:
        raise ValueError("wait_flag: the flag must be one int32")
    if base.dtype != torch.int64 or base.numel() != 1:
        raise ValueError("wait_flag: base must be one int64")


def wait_flag(flag: Tensor, base: Tensor, layer: int, order: str | None = None) -> None:
    """On the current stream: stop until (int32)(flag - (base + layer) mod 2^32) >= 0. flag: int32 [1],
    page-locked (or, under the Triton interpreter, a CPU tensor); base: int64 [1] on the device. No host
    sync: graph-capturable. Never released if nothing raises the flag (the worker's abort raises it).
    order: one of ORDERS (None: STRATA_FLAG_ORDER, else DEFAULT_ORDER); the values waited on are the same."""
    _check(flag, base)
    if layer < 0:
        raise ValueError(f"wait_flag: layer {layer} < 0")
    _kernel()[(1,)](flag, base, layer, ORDER=_order_code(order), num_warps=1, **pdl_args(base))


def wait_flag_reference(flag: Tensor, base: Tensor, layer: int, timeout_s: float = 10.0) -> None:
    """The plain twin: the host spins on the same comparison (TimeoutError after timeout_s)."""
    _check(flag, base)
    target = (int(base.reshape(-1)[0]) + layer) & 0xFFFFFFFF
    t0 = time.perf_counter()
    while ((int(flag.reshape(-1)[0]) - target) & 0xFFFFFFFF) >= 1 << 31:
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"wait_flag: the flag stayed below {target}")
        time.sleep(0)
