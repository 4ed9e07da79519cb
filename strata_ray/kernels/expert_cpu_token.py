"""A decode token's CPU expert rows for every layer in one nogil numba call: no Python between layers.

The decode step's CPU rows cost Python on every layer: the host's routing sync, the classification, the
pool call's prologue, and with a helper thread the handoffs under the GIL (~0.3 ms a layer on the H200 host,
more than the overlap it bought: docs/BENCHMARKS.md, session 5). Here one call, made once a token from one
thread, serves all layers:

    for layer l:  wait until the `routed` flag reaches v_l (the device wrote ids [K] and x's int8 codes
                  [1, E] with their scales and sums into the host buffers first: its flag write is fenced
                  after them)
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
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .contract import QK, pcie_entries
from .cpu_atomics import fetch_add as _fetch_add
from .cpu_atomics import load_acquire as _load_acquire
from .cpu_atomics import store_release as _store_release
from .expert_cpu_kernels import (
    _share,
    down_share,
    ffn_parallel,
    gate_up_rows_share,
    gate_up_share,
    quant_share,
)


@intrinsic
def _prefetch_l2(typingctx, arr, offset):
    """A hint: the cache line at byte `offset` of C-contiguous arr's data towards L2 (llvm.prefetch, read,
    locality 2: prefetcht1 on x86). Never faults, changes no value; offset must lie inside arr."""
    if not (isinstance(arr, types.Array) and arr.layout == "C"):
        raise TypeError(f"_prefetch_l2 takes a C-contiguous array, got {arr}")
    sig = types.void(arr, offset)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.gep(builder.bitcast(ary.data, i8p), [args[1]])
        fnty = ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        i32 = ir.IntType(32)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()

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
    return np.int32(np.uint32(_load_acquire(flag, 0)) - np.uint32(value)) >= 0


@njit(nogil=True, cache=True)
def wait_flag(flag, value, stop) -> bool:
    """Spin until flag reaches value (True) or stop[0] becomes non-zero (False)."""
    while not reached(flag, value):
        if _load_acquire(stop, 0) != 0:
            return False
    return True


# compiled into _cpu_entries (whose cache holds it): no cache file of its own under contract.py
_pcie_entries = njit(nogil=True)(pcie_entries)


@njit(nogil=True, cache=True)
def _staged(staged, e):
    """Whether expert e is in the layer's staged list (the experts the GPU copied ahead; -1: none)."""
    for c in range(staged.shape[0]):
        if staged[c] == e:
            return True
    return False


@njit(nogil=True, cache=True)
def _cpu_entries(layer, ids, res, n_expert, share, staged, exp, inv):
    """Which of a layer's entries ids [K] the CPU computes: the GPU takes a miss whose expert is in staged
    int64 [C] (copied ahead, -1: none), then of the other misses the contract.pcie_entries(misses, share)
    of the lowest expert ids (decode_plan.decode_plan_pcie, the same rule); the rest are the CPU's. Their
    experts go into exp[:m] in k order, each entry's index among them into inv [K] (0 for the others).
    Returns (m, the staged misses, the misses not staged)."""
    n_all = 0
    for j in range(ids.shape[0]):
        e = ids[j]
        if res[layer * n_expert + e] < 0 and not _staged(staged, e):
            n_all += 1
    n_gpu = _pcie_entries(n_all, share)
    ahead = 0
    m = 0
    for j in range(ids.shape[0]):
        e = ids[j]
        inv[j] = 0
        if res[layer * n_expert + e] < 0:
            if _staged(staged, e):  # copied ahead: the GPU's, from its staging slot
                ahead += 1
                continue
            lower = 0  # the other misses of a lower expert id (a token's experts are distinct)
            for i in range(ids.shape[0]):
                if ids[i] < e and res[layer * n_expert + ids[i]] < 0 and not _staged(staged, ids[i]):
                    lower += 1
            if lower >= n_gpu:  # the CPU's (else the GPU's: its row comes from the device's rows)
                exp[m] = e
                inv[j] = m
                m += 1
    return m, ahead, n_all


@njit(nogil=True, cache=True)
def _plan_entries(layer, ids_buf, res, n_expert, share, staged, seen_ids, inv, n_miss, n_pcie, n_ahead, exp,
                  ents, g_start, g_exp):
    """A layer's CPU entries from the device's routing (_cpu_entries): each entry's row in `rows` into inv
    [K] (0 when resident or computed by the GPU), the misses grouped by expert into ents / g_start / g_exp
    (one token: its experts are distinct, one entry a group, in expert order). n_ahead [L, 2] receives
    (staged misses, staged experts). Returns M, the CPU's entries."""
    for j in range(ids_buf.shape[0]):
        seen_ids[layer, j] = ids_buf[j]
    m, ahead, n_all = _cpu_entries(layer, ids_buf, res, n_expert, share, staged, exp, inv)
    n_pcie[layer] = n_all - m + ahead
    n_ahead[layer, 0] = ahead
    n_ahead[layer, 1] = 0
    for c in range(staged.shape[0]):
        if staged[c] >= 0:
            n_ahead[layer, 1] += 1
    n_miss[layer] = m
    if m:
        order = np.argsort(exp[:m], kind="mergesort")
        for i in range(m):
            ents[i] = order[i]
            g_start[i] = i
            g_exp[i] = exp[order[i]]
        g_start[m] = m
    return m


@njit(nogil=True, cache=True)
def _take_x(xq_buf, xd_buf, xs_buf, xq, xd, xs):
    """The layer's input codes (the device quantized x: kernels/publish) copied out of the shared buffers:
    xq_buf int8 [1, E], xd_buf f32 [1, E/32], xs_buf int32 [1, E/32] into xq / xd / xs."""
    xq[0, :] = xq_buf[0, :]
    xd[0, :] = xd_buf[0, :]
    xs[0, :] = xs_buf[0, :]


@njit(nogil=True, cache=True)
def _plan_layer(layer, ids_buf, res, n_expert, share, staged, seen_ids, inv, n_miss, n_pcie, n_ahead, exp,
                ents, g_start, g_exp, xq_buf, xd_buf, xs_buf, xq, xd, xs):
    """_plan_entries, then x's codes taken (_take_x) when the CPU has entries. Returns M."""
    m = _plan_entries(layer, ids_buf, res, n_expert, share, staged, seen_ids, inv, n_miss, n_pcie, n_ahead,
                      exp, ents, g_start, g_exp)
    if m:
        _take_x(xq_buf, xd_buf, xs_buf, xq, xd, xs)
    return m


@njit(nogil=True, cache=True)
def _predicted_cpu(layer, pred_ids, res, n_expert, share, pred_staged, p_exp, p_inv):
    """The experts the CPU will compute if the layer routes as predicted (pred_ids [K] from its input):
    _cpu_entries' rule over the prediction, sorted into p_exp[:m] (the order the rows' shares split them
    in). Returns m; 0 for a prediction holding an id out of range."""
    for j in range(pred_ids.shape[0]):
        if pred_ids[j] < 0 or pred_ids[j] >= n_expert:
            return 0
    m = _cpu_entries(layer, pred_ids, res, n_expert, share, pred_staged, p_exp, p_inv)[0]
    p_exp[:m] = np.sort(p_exp[:m])
    return m


@njit(inline="always", nogil=True, cache=True)
def _touch(w, e, r0, r1):
    """One byte of each 64 of expert e's rows r0..r1 of w uint8 [X, rows, RB] read: their cache lines pulled
    into this core's caches. Returns the bytes' sum (the caller keeps it, so the reads stay)."""
    s = 0
    for r in range(r0, r1):
        for b in range(0, w.shape[2], 64):
            s += w[e, r, b]
    return s


@njit(inline="always", nogil=True, cache=True)
def down_tile_bytes(down, g_exp, k):
    """Byte range [start, stop) in down uint8 [X, n_embd, RB] (C-contiguous) of down_share's unit k: the QK
    rows of tile k % tiles of expert g_exp[k // tiles] (contiguous: an expert's rows are)."""
    tiles = down.shape[1] // QK
    g, tile = k // tiles, k % tiles
    start = (g_exp[g] * down.shape[1] + tile * QK) * down.shape[2]
    return start, start + QK * down.shape[2]


@njit(inline="always", nogil=True, cache=True)
def prefetch_rows(h, ents):
    """h f32 [K, n_ff]'s rows ents (C-contiguous) towards this core's L2, every cache line's hint at once.
    The gate/up members wrote them, so each line sits in another core's cache, and quant_share's reads met
    those misses a block or two at a time (a member's requantization of one entry's 512 values took ~3 us on
    the H200 host: ~32 transfers nearly in series); with the hints in flight together they overlap."""
    row_bytes = h.shape[1] * 4
    for j in range(ents.shape[0]):
        base = ents[j] * row_bytes
        for off in range(0, row_bytes, 64):
            _prefetch_l2(h, base + off)


@njit(nogil=True, cache=True)
def prefetch_down_share(down, g_exp, t, n_down):
    """Member t's share of the down rows (the units down_share(..., t, n_down, ...) reads) prefetched towards
    its L2, one hint a cache line: issued once its gate/up share is done, so the lines arrive while the
    slower members finish theirs instead of on the down rows' own path. Only the time moves: the rows read
    the same bytes. On the H200 the down share got faster and the gate/up wait longer by as much (the last
    gate/up members' reads share the host's memory with the hints): off by default (session 29)."""
    k0, k1 = _share(g_exp.shape[0] * (down.shape[1] // QK), t, n_down)
    for k in range(k0, k1):
        start, stop = down_tile_bytes(down, g_exp, k)
        for off in range(start, stop, 64):
            _prefetch_l2(down, off)


@njit(nogil=True, cache=True)
def warm_share(gate, up, down, g_exp, t, n_team, routed, value, unit_rows):
    """Member t's bytes of the rows the experts g_exp (sorted) will need, read ahead: the gate and up tiles
    gate_up_rows_share gives member t, then the down tiles down_share gives it, so each member's share of
    the rows sits in its own core's cache when the layer's routing comes (the layer's mixer runs on the
    device meanwhile, the host's memory idle). Stops once `routed` reaches `value`: from then on the rows
    themselves are on the critical path. unit_rows: the team's gate/up unit (gate_up_rows_share). Returns the
    bytes' sum."""
    m = g_exp.shape[0]
    n_ff, n_embd = gate.shape[1], down.shape[1]
    s = 0
    n_up = min(n_team, m * n_ff // unit_rows)
    if t < n_up:
        tiles = n_ff // unit_rows
        k0, k1 = _share(m * tiles, t, n_up)
        for k in range(k0, k1):
            if reached(routed, value):
                return s
            g, r0 = k // tiles, (k % tiles) * unit_rows
            s += _touch(gate, g_exp[g], r0, r0 + unit_rows) + _touch(up, g_exp[g], r0, r0 + unit_rows)
    n_down = min(n_team, m * n_embd // QK)
    if t < n_down:
        tiles = n_embd // QK
        k0, k1 = _share(m * tiles, t, n_down)
        for k in range(k0, k1):
            if reached(routed, value):
                return s
            g, tile = k // tiles, k % tiles
            s += _touch(down, g_exp[g], tile * QK, tile * QK + QK)
    return s


@njit(nogil=True, cache=True)
def token_rows(gates, ups, downs, wtypes, res, n_expert, shares, staged, ids_buf, xq_buf, xd_buf, xs_buf,
               rows, inv, routed, rows_flag, base, stop, n_threads, single_thread_bytes, blob_bytes, seen_ids,
               n_miss, n_pcie, n_ahead, busy):
    """One token's CPU rows, layer after layer (module docstring).

    gates, ups, downs: typed lists of uint8 [X, rows, row_bytes], one per layer; wtypes int64 [L, 3]; res
    int32 [L * X] slot or -1; shares int64 [L]: each layer's permille of misses the GPU reads over PCIe (0:
    none; _plan_layer); staged int64 [C]: the experts the device copied ahead for this layer (-1: none);
    ids_buf int64 [K], xq_buf int8 [1, E], xd_buf f32 [1, E/32], xs_buf int32 [1, E/32]: the device's copies
    of this layer's routing and of its input's codes (contract step 1); rows f32 [K, E] (the first M rows
    written), inv int32 [K]: entry k's row, 0 for resident and PCIe entries; routed, rows_flag, stop uint32
    [1]; v_l = base + l (mod 2^32). seen_ids int64 [L, K], n_miss and n_pcie int64 [L] receive each layer's
    ids, CPU entries and the GPU's misses (the caller's window accounting), n_ahead int64 [L, 2] the staged
    misses and experts; busy int64 [L] the cycles() from seeing the layer's routing to raising its rows flag
    (the CPU rows' own time, the waits on the device left out).
    Returns -1, or the layer whose wait `stop` ended."""
    n_layers = len(gates)
    k = ids_buf.shape[0]
    n_embd = xq_buf.shape[1]
    nb = n_embd // QK
    exp = np.empty(k, np.int64)
    ents_k = np.empty(k, np.int64)
    g_start_k = np.empty(k + 1, np.int64)
    g_exp_k = np.empty(k, np.int64)
    tok = np.zeros(k, np.int64)  # one token: every entry reads activation row 0
    xq = np.empty((1, n_embd), np.int8)
    xd = np.empty((1, nb), np.float32)
    xs = np.empty((1, nb), np.int32)
    for layer in range(n_layers):
        v = np.uint32((base + layer) & 0xFFFFFFFF)
        if not wait_flag(routed, v, stop):
            return layer
        t0 = _cycles()
        m = _plan_layer(layer, ids_buf, res, n_expert, shares[layer], staged, seen_ids, inv, n_miss, n_pcie,
                        n_ahead, exp, ents_k, g_start_k, g_exp_k, xq_buf, xd_buf, xs_buf, xq, xd, xs)
        if m == 0:
            _store_release(rows_flag, 0, v)
            busy[layer] = _cycles() - t0
            continue
        gate, up, down = gates[layer], ups[layer], downs[layer]
        gtype, utype, dtype = wtypes[layer, 0], wtypes[layer, 1], wtypes[layer, 2]
        n_ff = gate.shape[1]
        ents, g_start, g_exp = ents_k[:m], g_start_k[: m + 1], g_exp_k[:m]
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
            # np.int64 shares: literal 0 and 1 would compile the share functions once more for Literal[int]
            gate_up_share(gate, gtype, up, utype, xq, xd, xs, tok[:m], ents, g_start, g_exp, np.int64(0),
                          np.int64(1), h, hq, hd, hs)
            down_share(down, dtype, hq, hd, hs, ents, g_start, g_exp, np.int64(0), np.int64(1), out)
            _store_release(rows_flag, 0, v)
        busy[layer] = _cycles() - t0
    return -1


# ---- the team form: one parallel region a token ------------------------------------------------------------
# token_rows opens two OpenMP regions a layer (ffn_parallel's phases): each wakes the team and ends at a join,
# a fixed cost per layer that the H200 host measured at about as much as the rows' own arithmetic for ~5
# entries (docs/BENCHMARKS.md, session 6). token_rows_team opens one region for the whole token: member 0
# waits for the device and plans each layer, the members meet at counters in `sync` (acquire/release
# atomics) instead of region joins, and every member runs the same shares of the same kernels as
# ffn_parallel: the same rows, bit for bit. The members spin between layers; the team lives one token.

# sync int64 [SYNC_LEN]: READY = layers planned (member 0 releases), ARRIVED = barrier arrivals (the counter
# form), ABORT = the layer a stop ended (-1: none), M = this layer's CPU entries; with warming: PRED = layers
# whose prediction member 0 has read (released whether or not one came), PM = the predicted CPU entries to
# warm (0: none); GO = the gather form's release (written by member 0 only), on a cache line of its own
READY, ARRIVED, ABORT, M, PRED, PM = 0, 1, 2, 3, 4, 5
GO, NEXT_UP, NEXT_DOWN, SYNC_LEN = 16, 32, 48, 64
# arrive int64 [team, ARRIVE_PITCH]: member t's barrier arrivals at arrive[t, ARRIVE_AT], 128 bytes from the
# next member's (each on a cache line only its member writes, whatever the array's alignment)
ARRIVE_PITCH, ARRIVE_AT = 16, 8
# stamps int64 [L, N_STAMPS]: member 0's cycles() at a layer's steps (busy's parts;
# CpuTokenRows.phase_cycles): routing seen, plan published, its gate/up done, every gate/up done (barrier 1
# left), h requantized, its down done, every row in (the rows flag raised), the entries planned (before the
# plan's publication in sync); the last, the layer's CPU entries
ST_SEEN, ST_PLANNED, ST_UP0, ST_UP, ST_QUANT, ST_DOWN0, ST_ROWS, ST_ENTRIES = 0, 1, 2, 3, 4, 5, 6, 7
N_STAMPS = 9
# the team's barrier forms (token_rows_team's `form`): COUNTER, every member adds to one shared counter and
# spins on it (14 cores' atomics on one cache line while the others spin on it); GATHER, each member stores
# its arrival on a line of its own, member 0 gathers them and releases GO (the only write the spinners see),
# every member requantizes h itself (no barrier between that and the down rows) and the last barrier of a
# layer is a gather alone (the next layer's READY is the release); DYNAMIC, the gather form whose members
# take the gate/up and down units one at a time from a shared counter instead of fixed shares: a member a
# few us late (the OS ran something on its core, its first loads slower) takes fewer units instead of
# holding the barrier (the engine's layers with one CPU entry waited 8-25 us a layer at the gate/up barrier
# with fixed shares, session 28). Which member computes a unit does not change its rows: the same bits.
COUNTER, GATHER, DYNAMIC = 0, 1, 2


@njit(nogil=True, cache=True)
def _barrier(sync, target):
    """Arrive, then wait until `target` arrivals in all (targets grow by the team size per barrier)."""
    _fetch_add(sync, ARRIVED, 1)
    while _load_acquire(sync, ARRIVED) < target:
        pass


@njit(nogil=True, cache=True)
def _gather(arrive, t, n_team, epoch):
    """The gather form's arrival: member t > 0 stores epoch on its own line (a release: its rows are seen
    first); member 0 spins until every member's line holds it (acquire: their rows are seen after)."""
    if t:
        _store_release(arrive[t], ARRIVE_AT, epoch)
        return
    for u in range(1, n_team):
        while _load_acquire(arrive[u], ARRIVE_AT) < epoch:
            pass


@njit(nogil=True, cache=True)
def _gather_go(sync, arrive, t, n_team, epoch):
    """A whole barrier in the gather form: the members arrive, member 0 gathers and releases GO, the others
    spin on GO (a line only member 0 writes)."""
    _gather(arrive, t, n_team, epoch)
    if t == 0:
        _store_release(sync, GO, epoch)
    else:
        while _load_acquire(sync, GO) < epoch:
            pass


@njit(inline="always", nogil=True, cache=True)
def _first_share(sync, counter, form, t, n_team, n_units):
    """(shares, member t's first): fixed shares, min(n_team, n_units) of them, member t's is t (none when
    t >= shares); DYNAMIC, n_units shares of one unit each, the first taken from sync[counter]."""
    if form == DYNAMIC:
        return n_units, _fetch_add(sync, counter, 1)
    return min(n_team, n_units), t


@njit(inline="always", nogil=True, cache=True)
def _next_share(sync, counter, form, n_shares):
    """The member's next share after one done: DYNAMIC, the next unit from sync[counter]; fixed shares, none
    (n_shares: the loop ends)."""
    if form == DYNAMIC:
        return _fetch_add(sync, counter, 1)
    return n_shares


@njit(nogil=True, cache=True)
def _wait_prediction(predicted, routed, value, stop):
    """Spin until the layer's prediction (predicted reaches value: 1) or its routing (routed does: 2) is
    there, whichever first, or stop[0] becomes non-zero (0). A layer with no prediction just waits for its
    routing."""
    while True:
        if reached(routed, value):
            return 2
        if reached(predicted, value):
            return 1
        if _load_acquire(stop, 0) != 0:
            return 0


@njit(nogil=True, cache=True)
def _warm_hits(g_exp, m, p_exp, pm):
    """How many of the layer's CPU experts g_exp[:m] the prediction's p_exp[:pm] held."""
    hits = 0
    for i in range(m):
        for j in range(pm):
            if p_exp[j] == g_exp[i]:
                hits += 1
                break
    return hits


@njit(nogil=True, cache=True)
def _team_member(t, n_team, gates, ups, downs, wtypes, res, n_expert, shares, staged, ids_buf, xq_buf, xd_buf,
                 xs_buf, rows, inv, routed, rows_flag, base, stop, seen_ids, n_miss, n_pcie, n_ahead, busy,
                 sync, exp, ents, g_start, g_exp, h, hq, hd, hs, tok, warm, predicted, pred_ids, pred_staged,
                 n_warm, p_exp, p_inv, sink, form, arrive, stamps, prefetch, unit_rows):
    n_layers = len(gates)
    n_embd = xq_buf.shape[1]
    n_ff = gates[0].shape[1]
    if form != COUNTER:  # h requantized by every member into its own buffers: no barrier before the down rows
        k = hq.shape[0]
        hq = np.empty((k, n_ff), np.int8)
        hd = np.empty((k, n_ff // QK), np.float32)
        hs = np.empty((k, n_ff // QK), np.int32)
    for layer in range(n_layers):
        v = np.uint32((base + layer) & 0xFFFFFFFF)
        gate, up, down = gates[layer], ups[layer], downs[layer]
        if warm:  # the layer's predicted CPU rows read ahead into each member's cache while its mixer runs
            if t == 0:
                got = _wait_prediction(predicted, routed, v, stop)
                pm = 0
                if got == 1:  # the buffers hold this layer's prediction until the worker raises its rows flag
                    pm = _predicted_cpu(layer, pred_ids, res, n_expert, shares[layer], pred_staged, p_exp,
                                        p_inv)
                n_warm[layer, 0] = pm
                sync[PM] = pm
                _store_release(sync, PRED, layer + 1)
                if got == 0:  # stopped: the others leave at READY, as below
                    sync[ABORT] = layer
                    _store_release(sync, READY, layer + 1)
                    return
            else:
                while _load_acquire(sync, PRED) < layer + 1:
                    pass
            pm = sync[PM]
            if pm:
                sink[t] += warm_share(gate, up, down, p_exp[:pm], t, n_team, routed, v, unit_rows)
        if t == 0:  # the planner: wait for the device, classify, take x's codes, publish
            if not wait_flag(routed, v, stop):
                sync[ABORT] = layer
                _store_release(sync, READY, layer + 1)
                return
            t0 = _cycles()
            m = _plan_entries(layer, ids_buf, res, n_expert, shares[layer], staged, seen_ids, inv, n_miss,
                              n_pcie, n_ahead, exp, ents, g_start, g_exp)
            stamps[layer, ST_ENTRIES] = _cycles()
            # x's codes stay where the device wrote them: every member reads them there (the device writes the
            # next layer's only after this layer's rows flag); a copy here cost member 0 ~5.5 us (session 29)
            if warm:
                n_warm[layer, 1] = _warm_hits(g_exp, m, p_exp, sync[PM])
            stamps[layer, ST_SEEN] = t0
            sync[M] = m
            # every member passed the last layer's final gather (its down units all taken): the counters
            # restart, released with READY
            sync[NEXT_UP] = 0
            sync[NEXT_DOWN] = 0
            _store_release(sync, READY, layer + 1)
            stamps[layer, ST_PLANNED] = _cycles()
        else:
            while _load_acquire(sync, READY) < layer + 1:
                pass
            if sync[ABORT] >= 0:
                return
        # every barrier even when m = 0: member 0 must not publish the next layer's plan (sync[M], exp, x)
        # nor its prediction (p_exp) while a member still reads this one's
        m = sync[M]
        # gate+up in unit_rows-row units (HALF_ROWS by default), then h's requantization (a phase of its
        # own in the counter form, each member's own in the gather forms): a few experts' rows split evenly
        # over the team (32-row units with the requantization in them left members 25% idle, 16-row units
        # member 0 a whole unit behind the last at one entry, gate_up_rows_share says why). Fixed shares:
        # member t takes share t of n_up, once; DYNAMIC: unit u of n_up units (share u of n_up shares:
        # exactly that unit) as it comes
        n_up, u = _first_share(sync, NEXT_UP, form, t, n_team, m * n_ff // unit_rows)
        while u < n_up:
            gate_up_rows_share(gate, wtypes[layer, 0], up, wtypes[layer, 1], xq_buf, xd_buf, xs_buf, tok[:m],
                               ents[:m], g_start[: m + 1], g_exp[:m], u, n_up, unit_rows, h)
            u = _next_share(sync, NEXT_UP, form, n_up)
        if t == 0:
            stamps[layer, ST_UP0] = _cycles()
        n_down = min(n_team, m * n_embd // QK)
        if prefetch and form != DYNAMIC and t < n_down:  # fixed shares: this member's down units are known
            prefetch_down_share(down, g_exp[:m], t, n_down)
        if form != COUNTER:
            _gather_go(sync, arrive, t, n_team, 2 * layer + 1)
            if t == 0:
                stamps[layer, ST_UP] = _cycles()
            prefetch_rows(h, ents[:m])
            quant_share(h, hq, hd, hs, ents[:m], 0, 1)  # all of h, the same bits as the shared phase's
        else:
            _barrier(sync, n_team * (3 * layer + 1))
            if t == 0:
                stamps[layer, ST_UP] = _cycles()
            n_quant = min(n_team, m * n_ff // QK)
            if t < n_quant:
                quant_share(h, hq, hd, hs, ents[:m], t, n_quant)
            _barrier(sync, n_team * (3 * layer + 2))
        if t == 0:
            stamps[layer, ST_QUANT] = _cycles()
        n_down, u = _first_share(sync, NEXT_DOWN, form, t, n_team, m * n_embd // QK)
        while u < n_down:
            down_share(down, wtypes[layer, 2], hq, hd, hs, ents[:m], g_start[: m + 1], g_exp[:m], u, n_down,
                       rows)
            u = _next_share(sync, NEXT_DOWN, form, n_down)
        if t == 0:
            stamps[layer, ST_DOWN0] = _cycles()
        if form != COUNTER:  # an arrived member goes on to the next layer's READY, which member 0 publishes
            _gather(arrive, t, n_team, 2 * layer + 2)  # only after this gather
        else:
            _barrier(sync, n_team * (3 * layer + 3))
        if t == 0:  # every member's rows are in `rows` (the barrier's acquire): release them to the device
            _store_release(rows_flag, 0, v)
            stamps[layer, ST_ROWS] = _cycles()
            stamps[layer, N_STAMPS - 1] = m
            busy[layer] = stamps[layer, ST_ROWS] - t0


@njit(parallel=True, nogil=True, cache=True)
def token_rows_team(gates, ups, downs, wtypes, res, n_expert, shares, staged, ids_buf, xq_buf, xd_buf, xs_buf,
                    rows, inv, routed, rows_flag, base, stop, n_team, seen_ids, n_miss, n_pcie, n_ahead, busy,
                    sync, warm, predicted, pred_ids, pred_staged, n_warm, form, arrive, stamps, prefetch,
                    unit_rows):
    """token_rows with one parallel region for the token: n_team members (the caller's numba thread count,
    every member running at once: an OpenMP or workqueue layer, never TBB, whose tasks may not) serve
    every layer; the same arguments and results as token_rows (its single-thread cut-off aside: the team
    shares every layer's rows, whatever their size, which gives the same bits). sync int64 [SYNC_LEN], the
    caller's (the members' counters); form: COUNTER, GATHER or DYNAMIC (the same rows in every form);
    arrive int64 [>= n_team, ARRIVE_PITCH] (the gather form's arrivals); stamps int64 [L, N_STAMPS] receives
    member 0's cycles() at each layer's steps (ST_*) and, last, the layer's CPU entries;
    the caller reads sync[ABORT] afterwards (-1, or the layer a stop ended): returned from here, it came back
    as the value stored before the region (numba 0.68).

    warm (0 / 1): before each layer's routing, wait for its prediction too: `predicted` uint32 [1] reaching
    base + layer means pred_ids int64 [K] and pred_staged int64 [C] hold the routing predicted from the
    layer's input and the experts the device copies ahead for it. Each member then reads ahead its share of
    the predicted CPU rows' weights (warm_share), until the routing comes. Only the time moves: the rows
    are computed from the real routing as always. n_warm int64 [L, 2] receives each layer's (predicted CPU
    entries, CPU entries among them).

    prefetch (0 / 1): with fixed shares, each member prefetches its down units once its gate/up share is done
    (prefetch_down_share; member 0's hints count in its gate/up wait). Only the time moves.

    unit_rows (HALF_ROWS / ROWS): the weight rows of a gate/up unit (gate_up_rows_share). Only the split
    moves: the same rows."""
    k = ids_buf.shape[0]
    n_ff = gates[0].shape[1]
    sync[:] = 0
    sync[ABORT] = -1
    arrive[:] = 0  # epochs restart at 1 every token
    stamps[:] = 0
    exp = np.empty(k, np.int64)
    ents = np.empty(k, np.int64)
    g_start = np.empty(k + 1, np.int64)
    g_exp = np.empty(k, np.int64)
    h = np.empty((k, n_ff), np.float32)
    hq = np.empty((k, n_ff), np.int8)
    hd = np.empty((k, n_ff // QK), np.float32)
    hs = np.empty((k, n_ff // QK), np.int32)
    tok = np.zeros(k, np.int64)  # one token: every entry reads activation row 0
    p_exp = np.empty(k, np.int64)
    p_inv = np.empty(k, np.int32)
    sink = np.zeros(n_team, np.int64)  # the warm reads' sums: kept, so they are not optimised away
    n_warm[:] = 0
    for t in prange(n_team):  # np.int64(t): one compile of _team_member (ffn_parallel says why)
        _team_member(np.int64(t), n_team, gates, ups, downs, wtypes, res, n_expert, shares, staged, ids_buf,
                     xq_buf, xd_buf, xs_buf, rows, inv, routed, rows_flag, base, stop, seen_ids, n_miss,
                     n_pcie, n_ahead, busy, sync, exp, ents, g_start, g_exp, h, hq, hd, hs, tok, warm,
                     predicted, pred_ids, pred_staged, n_warm, p_exp, p_inv, sink, form, arrive, stamps,
                     prefetch, unit_rows)
    return sink.sum()
