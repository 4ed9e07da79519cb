"""The pipelined decode hands a layer's routing to the CPU worker: one kernel inside the layer's graph.

The worker waits for the `routed` flag to reach v_l, then reads the layer's ids [K] and MoE input x [1, E]
from page-locked host buffers. The device side was two copies (device to pinned) and a stream write of the
flag (cuStreamWriteValue32), each its own item in the stream between two graphs: on the H200 ~25 us from
the router's last kernel to the next graph's first (session 11 trace), on the path of every layer's CPU
rows. Here one kernel writes the ids and x straight into the mapped host buffers (stores over PCIe), fences
them at system scope, and only then raises the flag, so the worker never sees the flag before the data. It
is captured in the layer's rows graph, so the flag's value comes from the device: base [1] (set once a
token) + the layer.

`publish_reference` is the plain twin (copies and a flag write), for tests.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from .lazy_triton import jit_bodies
from .tile_plan import next_pow2

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


def _publish_body(IDS, X, IDS_HOST, IDS_ALL, X_HOST, FLAG, BASE, STAGED, STAGED_HOST, layer, K, E,
                  BK: tl.constexpr, BE: tl.constexpr, FENCE: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                  HAS_X: tl.constexpr):
    # IDS int64 [K], X f32 [E] (device); IDS_HOST int64 [K], IDS_ALL int64 [L, K], X_HOST f32 [E], FLAG int32
    # [1] (page-locked host memory); BASE int64 [1] (device); C > 0: STAGED int32 [C] (device) -> STAGED_HOST
    # int64 [C]; HAS_X = 0: no x. One program.
    k = tl.arange(0, BK)
    ids = tl.load(IDS + k, mask=k < K)
    tl.store(IDS_HOST + k, ids, mask=k < K)
    tl.store(IDS_ALL + layer * K + k, ids, mask=k < K)
    if C > 0:
        c = tl.arange(0, BC)
        tl.store(STAGED_HOST + c, tl.load(STAGED + c, mask=c < C).to(tl.int64), mask=c < C)
    if HAS_X:
        e = tl.arange(0, BE)
        tl.store(X_HOST + e, tl.load(X + e, mask=e < E), mask=e < E)
    zero = tl.zeros((1,), tl.int32)
    if FENCE:  # every thread's stores reach the host before it passes the barrier (__threadfence_system)
        tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, $1;", "=r,r", [zero], dtype=tl.int32,
                                  is_pure=False, pack=1)
    tl.debug_barrier()
    value = ((tl.load(BASE) + layer) & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)
    tl.store(FLAG, value)  # a plain store: atomics on host memory need PCIe atomics, which hosts may lack
    if FENCE:  # and out now, not whenever a cache gives it up
        tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, $1;", "=r,r", [zero], dtype=tl.int32,
                                  is_pure=False, pack=1)


@functools.cache
def _kernel():
    return jit_bodies(_publish_body, do_not_specialize=["layer"])[0]


def _check(ids: Tensor, x: Tensor | None, ids_host: Tensor, ids_all: Tensor, x_host: Tensor | None,
           flag: Tensor, base: Tensor) -> None:
    if (x is None) != (x_host is None):
        raise ValueError("publish: x and x_host come together")
    if x is None:  # the ids alone (a predicted routing): x's checks against themselves
        x = x_host = torch.zeros(0, dtype=torch.float32)
    k, e = ids.numel(), x.numel()
    if ids.dtype != torch.int64 or ids_host.dtype != torch.int64 or ids_all.dtype != torch.int64:
        raise ValueError("publish: ids, ids_host and ids_all must be int64")
    if ids_host.numel() != k or ids_all.dim() != 2 or ids_all.shape[1] != k or x_host.numel() != e:
        raise ValueError(f"publish: host buffers must hold {k} ids, [L, {k}] ids and {e} values")
    if x.dtype != torch.float32 or x_host.dtype != torch.float32 or flag.dtype != torch.int32:
        raise ValueError("publish: x and x_host must be float32, the flag int32")
    if base.dtype != torch.int64 or base.numel() != 1:
        raise ValueError("publish: base must be one int64")
    if not all(t.is_contiguous() for t in (ids, x, ids_host, ids_all, x_host)):
        raise ValueError("publish: every buffer must be contiguous")


def _check_staged(staged: Tensor | None, staged_host: Tensor | None) -> None:
    if (staged is None) != (staged_host is None):
        raise ValueError("publish: staged and staged_host come together")
    if staged is not None and (staged.dtype != torch.int32 or staged_host.dtype != torch.int64
                               or staged.numel() != staged_host.numel() or not staged.is_contiguous()
                               or not staged_host.is_contiguous()):
        raise ValueError("publish: staged must be contiguous int32 [C], staged_host int64 [C]")


def publish(ids: Tensor, x: Tensor | None, ids_host: Tensor, ids_all: Tensor, x_host: Tensor | None,
            flag: Tensor, base: Tensor, layer: int, staged: Tensor | None = None,
            staged_host: Tensor | None = None) -> None:
    """On the current stream: ids [K] -> ids_host [K] and ids_all[layer]; x [1, E] -> x_host (both None: no
    x, as for a predicted routing); staged [C] (the experts copied ahead for the layer, if given) ->
    staged_host; then flag := (base + layer) mod 2^32 after the host can see them. ids, x, base, staged on
    the device; the host buffers page-locked (or, under the Triton interpreter, CPU tensors). No host sync:
    graph-capturable."""
    _check(ids, x, ids_host, ids_all, x_host, flag, base)
    _check_staged(staged, staged_host)
    if not 0 <= layer < ids_all.shape[0]:
        raise ValueError(f"publish: layer {layer} of {ids_all.shape[0]}")
    k, e = ids.numel(), 0 if x is None else x.numel()
    c = 0 if staged is None else staged.numel()
    fence = os.environ.get("TRITON_INTERPRET") != "1"  # inline PTX: not under the interpreter
    _kernel()[(1,)](ids, ids if x is None else x, ids_host, ids_all, ids_host if x is None else x_host, flag,
                    base, staged if c else ids, staged_host if c else ids, layer, k, e,
                    BK=max(2, next_pow2(k)), BE=max(2, next_pow2(e)), FENCE=fence, C=c,
                    BC=max(2, next_pow2(max(1, c))), HAS_X=x is not None, num_warps=4)


def publish_reference(ids: Tensor, x: Tensor, ids_host: Tensor, ids_all: Tensor, x_host: Tensor,
                      flag: Tensor, base: Tensor, layer: int, staged: Tensor | None = None,
                      staged_host: Tensor | None = None) -> None:
    """The plain twin: the same writes as copies, then the flag (on the CPU: in program order)."""
    _check(ids, x, ids_host, ids_all, x_host, flag, base)
    _check_staged(staged, staged_host)
    ids_host.copy_(ids.reshape(-1))
    ids_all[layer].copy_(ids.reshape(-1))
    if x is not None:
        x_host.copy_(x.reshape(x_host.shape))
    if staged is not None:
        staged_host.copy_(staged.reshape(-1))
    value = (int(base.reshape(-1)[0]) + layer) & 0xFFFFFFFF
    flag.reshape(-1)[0] = value - (1 << 32) if value >= 1 << 31 else value
