"""The pipelined decode hands a layer's routing to the CPU worker: one kernel inside the layer's graph.

The worker waits for the `routed` flag to reach v_l, then reads the layer's ids [K] and the MoE input's
int8 codes (contract step 1: codes [1, E], scales and sums [1, E/32]) from page-locked host buffers. The
device side was two copies (device to pinned) and a stream write of the flag (cuStreamWriteValue32), each
its own item in the stream between two graphs: on the H200 ~25 us from the router's last kernel to the next
graph's first (session 11 trace), on the path of every layer's CPU rows. Here one kernel writes the ids and
codes straight into the mapped host buffers (stores over PCIe), fences them at system scope, and only then
raises the flag, so the worker never sees the flag before the data. It is captured in the layer's rows
graph, so the flag's value comes from the device: base [1] (set once a token) + the layer.

The kernel quantizes x itself (the contract's activation quantizer, triton_blocks.quant_blocks) and writes
the codes to device buffers too, for the GPU's own rows of the layer: one launch instead of a quantize and a
publish, and the worker no longer quantizes x on its critical path (the same bits: the contract), ~3.4 us a
layer on the H200 host (session 28), with 2.5 KB over PCIe instead of 8 KB of x.

`publish_reference` is the plain twin (copies, the numpy quantizer and a flag write), for tests.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
from torch import Tensor

from .contract import QK
from .lazy_triton import jit_bodies
from .pdl import pdl_args
from .tile_plan import next_pow2

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch
quant_blocks = None  # triton_blocks.quant_blocks, bound by _kernel() (triton_blocks imports triton)


class ActCodes(NamedTuple):
    """One activation row's codes (contract step 1), as expert_gpu.quantize_act_gpu returns them."""

    q: Tensor  # int8 [1, E]
    d: Tensor  # f32 [1, E/32] block scales
    s: Tensor  # int32 [1, E/32] block sums of q


def _publish_body(IDS, X, IDS_HOST, IDS_ALL, Q, D, S, Q_HOST, D_HOST, S_HOST, FLAG, BASE, STAGED, STAGED_HOST,
                  layer, K, NB, BK: tl.constexpr, BB: tl.constexpr, FENCE: tl.constexpr, C: tl.constexpr,
                  BC: tl.constexpr, HAS_X: tl.constexpr, PDL: tl.constexpr):
    # IDS int64 [K], X f32 [NB * 32] (device); IDS_HOST int64 [K], IDS_ALL int64 [L, K], FLAG int32 [1]
    # (page-locked host memory); BASE int64 [1] (device); HAS_X: X's codes Q int8 [NB * 32], D f32 [NB], S
    # int32 [NB] (device) and Q_HOST / D_HOST / S_HOST (host), else none; C > 0: STAGED int32 [C] (device) ->
    # STAGED_HOST int64 [C]. One program. PDL: it starts early, then waits (kernels/pdl.py)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    k = tl.arange(0, BK)
    ids = tl.load(IDS + k, mask=k < K)
    tl.store(IDS_HOST + k, ids, mask=k < K)
    tl.store(IDS_ALL + layer * K + k, ids, mask=k < K)
    if C > 0:
        c = tl.arange(0, BC)
        tl.store(STAGED_HOST + c, tl.load(STAGED + c, mask=c < C).to(tl.int64), mask=c < C)
    if HAS_X:
        b = tl.arange(0, BB)
        live = b < NB
        offs = b[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BB, 32]
        q, d, s = quant_blocks(tl.load(X + offs, mask=live[:, None], other=0.0))
        tl.store(Q + offs, q, mask=live[:, None])
        tl.store(D + b, d, mask=live)
        tl.store(S + b, s, mask=live)
        tl.store(Q_HOST + offs, q, mask=live[:, None])
        tl.store(D_HOST + b, d, mask=live)
        tl.store(S_HOST + b, s, mask=live)
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
    global quant_blocks
    from .triton_blocks import quant_blocks

    return jit_bodies(_publish_body, do_not_specialize=["layer"])[0]


def _check(ids: Tensor, x: Tensor | None, ids_host: Tensor, ids_all: Tensor, codes_host: ActCodes | None,
           flag: Tensor, base: Tensor, codes: ActCodes | None) -> None:
    if not (x is None) == (codes_host is None) == (codes is None):
        raise ValueError("publish: x, codes_host and codes come together")
    k = ids.numel()
    if ids.dtype != torch.int64 or ids_host.dtype != torch.int64 or ids_all.dtype != torch.int64:
        raise ValueError("publish: ids, ids_host and ids_all must be int64")
    if ids_host.numel() != k or ids_all.dim() != 2 or ids_all.shape[1] != k:
        raise ValueError(f"publish: host buffers must hold {k} ids and [L, {k}] ids")
    if flag.dtype != torch.int32:
        raise ValueError("publish: the flag must be int32")
    if base.dtype != torch.int64 or base.numel() != 1:
        raise ValueError("publish: base must be one int64")
    if not all(t.is_contiguous() for t in (ids, ids_host, ids_all)):
        raise ValueError("publish: every buffer must be contiguous")
    if x is None:  # the ids alone (a predicted routing)
        return
    e = x.numel()
    if x.dtype != torch.float32 or not x.is_contiguous() or e % QK:
        raise ValueError(f"publish: x must be contiguous float32 of a multiple of {QK} values, got {x.dtype} "
                         f"{tuple(x.shape)}")
    want = ((e, torch.int8), (e // QK, torch.float32), (e // QK, torch.int32))
    for name, got in (("codes_host", codes_host), ("codes", codes)):
        for t, (n, dtype) in zip(got, want, strict=True):
            if t.numel() != n or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"publish: {name} must be contiguous int8 [1, {e}], float32 [1, {e // QK}] "
                                 f"and int32 [1, {e // QK}]")


def _check_staged(staged: Tensor | None, staged_host: Tensor | None) -> None:
    if (staged is None) != (staged_host is None):
        raise ValueError("publish: staged and staged_host come together")
    if staged is not None and (staged.dtype != torch.int32 or staged_host.dtype != torch.int64
                               or staged.numel() != staged_host.numel() or not staged.is_contiguous()
                               or not staged_host.is_contiguous()):
        raise ValueError("publish: staged must be contiguous int32 [C], staged_host int64 [C]")


def publish(ids: Tensor, x: Tensor | None, ids_host: Tensor, ids_all: Tensor, codes_host: ActCodes | None,
            flag: Tensor, base: Tensor, layer: int, staged: Tensor | None = None,
            staged_host: Tensor | None = None, codes: ActCodes | None = None) -> None:
    """On the current stream: ids [K] -> ids_host [K] and ids_all[layer]; x [1, E] quantized (contract step
    1) into codes (device) and codes_host (all three None: no x, as for a predicted routing); staged [C] (the
    experts copied ahead for the layer, if given) -> staged_host; then flag := (base + layer) mod 2^32 after
    the host can see them. ids, x, codes, base, staged on the device; the host buffers page-locked (or,
    under the Triton interpreter, CPU tensors). No host sync: graph-capturable."""
    _check(ids, x, ids_host, ids_all, codes_host, flag, base, codes)
    _check_staged(staged, staged_host)
    if not 0 <= layer < ids_all.shape[0]:
        raise ValueError(f"publish: layer {layer} of {ids_all.shape[0]}")
    k, nb = ids.numel(), 0 if x is None else x.numel() // QK
    c = 0 if staged is None else staged.numel()
    fence = os.environ.get("TRITON_INTERPRET") != "1"  # inline PTX: not under the interpreter
    q, d, s = codes if x is not None else (ids, ids, ids)  # unread stand-ins where there is no x
    qh, dh, sh = codes_host if x is not None else (ids, ids, ids)
    _kernel()[(1,)](ids, ids if x is None else x, ids_host, ids_all, q, d, s, qh, dh, sh, flag, base,
                    staged if c else ids, staged_host if c else ids, layer, k, nb, BK=max(2, next_pow2(k)),
                    BB=max(2, next_pow2(nb)), FENCE=fence, C=c, BC=max(2, next_pow2(max(1, c))),
                    HAS_X=x is not None, num_warps=4, enable_fp_fusion=False,  # the contract: no FMA
                    **pdl_args(ids))


def publish_reference(ids: Tensor, x: Tensor | None, ids_host: Tensor, ids_all: Tensor,
                      codes_host: ActCodes | None, flag: Tensor, base: Tensor, layer: int,
                      staged: Tensor | None = None, staged_host: Tensor | None = None,
                      codes: ActCodes | None = None) -> None:
    """The plain twin: the same writes as copies (the codes from the numpy quantizer, spec.py), then the flag
    (on the CPU: in program order)."""
    _check(ids, x, ids_host, ids_all, codes_host, flag, base, codes)
    _check_staged(staged, staged_host)
    ids_host.copy_(ids.reshape(-1))
    ids_all[layer].copy_(ids.reshape(-1))
    if x is not None:
        from .spec import act_quant_ref

        for value, dst_host, dst in zip(act_quant_ref(x.detach().cpu().reshape(1, -1).numpy()),
                                        codes_host, codes, strict=True):
            t = torch.from_numpy(value)
            dst_host.copy_(t.reshape(dst_host.shape))
            dst.copy_(t.reshape(dst.shape))
    if staged is not None:
        staged_host.copy_(staged.reshape(-1))
    value = (int(base.reshape(-1)[0]) + layer) & 0xFFFFFFFF
    flag.reshape(-1)[0] = value - (1 << 32) if value >= 1 << 31 else value
