"""A decode token's CPU expert rows for every layer in one nogil numba call: no Python between layers.

The decode step's CPU rows cost Python on every layer: the host's routing sync, the classification, the
pool call's prologue, and with a helper thread the handoffs under the GIL (~0.3 ms a layer on the H200 host,
more than the overlap it bought: docs/BENCHMARKS.md, session 5). Here one call, made once a token from one
thread, serves all layers:

    for layer l:  wait until the `routed` flag reaches v_l (the device wrote ids [K] and x [1, E] into the
                  host buffers first: its flag write is fenced after its copies)
                  -> the layer's entries that are not resident (the host residency table)
                  -> their rows into `rows` [M, E] and each entry's row index into `inv` [K]
                  -> the `rows` flag := v_l (by ffn_parallel after its last row, or here when M = 0)

A device stream waits for the rows flag (stream_flags.HostFlag) before it copies `rows` and `inv` up, so
the host thread only enqueues the token's work and syncs once for its logits (DEVICE-NOTES, the next
decode change). The rows are the kernels' of expert_cpu_kernels.py, called with the same arguments an
`expert_ffn_cpu` call over the misses passes them: the same bits (tests/kernels/test_cpu_token_rows.py).

Flags hold 32-bit values that wrap; "reached" is (int32)(flag - v) >= 0, as cuStreamWaitValue32's GEQ.
A stop flag set to 1 ends any wait: the call returns the number of layers done (-1: none cut short).
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .act_quant import quantize_rows_into
from .contract import QK
from .expert_cpu_kernels import down_share, ffn_parallel, gate_up_share


@intrinsic
def _load_acquire_u32(typingctx, arr, idx):
    """arr[idx] (uint32 [n]) as an acquire load: read again on every call (another thread, or the device,
    writes it), and no later read moves before it."""
    sig = types.uint32(arr, idx)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.load_atomic(ptr, ordering="acquire", align=4)

    return sig, codegen


_HAS_TSC = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def _cycles(typingctx):
    """The CPU's time-stamp counter (rdtsc: constant rate on current x86; 0 elsewhere, where LLVM's cycle
    counter may trap in user mode). Only differences are used, scaled by cycles_per_second()."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        if not _HAS_TSC:
            return ir.Constant(ir.IntType(64), 0)
        fnty = ir.FunctionType(ir.IntType(64), [])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.readcyclecounter")
        return builder.call(fn, [])

    return sig, codegen


@njit(nogil=True, cache=True)
def cycles() -> int:
    return _cycles()


@njit(nogil=True, cache=True)
def reached(flag, value) -> bool:
    """Whether flag[0] has reached `value` (32-bit wrapping order)."""
    return np.int32(np.uint32(_load_acquire_u32(flag, 0)) - np.uint32(value)) >= 0


@njit(nogil=True, cache=True)
def wait_flag(flag, value, stop) -> bool:
    """Spin until flag reaches value (True) or stop[0] becomes non-zero (False)."""
    while not reached(flag, value):
        if _load_acquire_u32(stop, 0) != 0:
            return False
    return True


@njit(nogil=True, cache=True)
def token_rows(gates, ups, downs, wtypes, res, n_expert, ids_buf, x_buf, rows, inv, routed, rows_flag, base,
               stop, n_threads, single_thread_bytes, blob_bytes, seen_ids, n_miss, busy):
    """One token's CPU rows, layer after layer (module docstring).

    gates, ups, downs: typed lists of uint8 [X, rows, row_bytes], one per layer; wtypes int64 [L, 3];
    res int32 [L * X] slot or -1; ids_buf int64 [K], x_buf f32 [1, E]: the device's copies of this layer's
    routing; rows f32 [K, E] (the first M rows written), inv int32 [K]: entry k's row, 0 for resident
    entries; routed, rows_flag, stop uint32 [1]; v_l = base + l (mod 2^32). seen_ids int64 [L, K] and
    n_miss int64 [L] receive each layer's ids and miss count (the caller's window accounting); busy int64 [L]
    the cycles() from seeing the layer's routing to raising its rows flag (the CPU rows' own time, the
    waits on the device left out).
    Returns -1, or the layer whose wait `stop` ended."""
    n_layers = len(gates)
    k = ids_buf.shape[0]
    n_embd = x_buf.shape[1]
    nb = n_embd // QK
    exp = np.empty(k, np.int64)
    tok = np.zeros(k, np.int64)  # one token: every entry reads activation row 0
    x = np.empty((1, n_embd), np.float32)
    xq = np.empty((1, n_embd), np.int8)
    xd = np.empty((1, nb), np.float32)
    xs = np.empty((1, nb), np.int32)
    for layer in range(n_layers):
        v = np.uint32((base + layer) & 0xFFFFFFFF)
        if not wait_flag(routed, v, stop):
            return layer
        t0 = _cycles()
        m = 0
        for j in range(k):
            e = ids_buf[j]
            seen_ids[layer, j] = e
            if res[layer * n_expert + e] < 0:
                exp[m] = e
                inv[j] = m
                m += 1
            else:
                inv[j] = 0
        n_miss[layer] = m
        if m == 0:
            rows_flag[0] = v
            busy[layer] = _cycles() - t0
            continue
        gate, up, down = gates[layer], ups[layer], downs[layer]
        gtype, utype, dtype = wtypes[layer, 0], wtypes[layer, 1], wtypes[layer, 2]
        n_ff = gate.shape[1]
        # entries grouped by expert (one token: its experts are distinct, one entry a group)
        ents = np.argsort(exp[:m], kind="mergesort").astype(np.int64)
        g_start = np.arange(m + 1).astype(np.int64)
        g_exp = exp[:m][ents]
        x[0, :] = x_buf[0, :]
        quantize_rows_into(x, xq, xd, xs)
        h = np.empty((m, n_ff), np.float32)
        hq = np.empty((m, n_ff), np.int8)
        hd = np.empty((m, n_ff // QK), np.float32)
        hs = np.empty((m, n_ff // QK), np.int32)
        out = rows[:m]
        if n_threads > 1 and m * blob_bytes >= single_thread_bytes:
            # the shares; the region runs on the caller's numba thread count (set_num_threads here would
            # make this function uncacheable: numba holds it as a ctypes pointer)
            n_up = min(n_threads, m * n_ff // QK)
            n_down = min(n_threads, m * n_embd // QK)
            ffn_parallel(gate, gtype, up, utype, down, dtype, xq, xd, xs, tok[:m], ents, g_start, g_exp, n_up,
                         n_down, h, hq, hd, hs, out, rows_flag, v)
        else:  # a small call: this thread alone, no parallel region (the same rows: batch invariance)
            gate_up_share(gate, gtype, up, utype, xq, xd, xs, tok[:m], ents, g_start, g_exp, 0, 1,
                          h, hq, hd, hs)
            down_share(down, dtype, hq, hd, hs, ents, g_start, g_exp, 0, 1, out)
            rows_flag[0] = v
        busy[layer] = _cycles() - t0
    return -1
