"""The numba kernels of the CPU expert path (nogil, cached), apart from their Python driver (expert_cpu.py).

numba's on-disk cache is keyed by the source file: a change to the driver must not throw away these kernels'
compiled code (the parallel one takes minutes to compile, on every machine, the GPU machine's each session).
Layouts and the work split are described in expert_cpu.py; tests/kernels/test_expert_cpu.py covers both.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .act_quant import quantize_block, swiglu
from .block_dots import HALF_ROWS, ROWS
from .blocks import tile_sums, tile_sums_half
from .contract import QK
from .cpu_atomics import store_release

f32 = np.float32


@njit(inline="always", nogil=True, cache=True)
def _tile_dot(w, r0, wtype, aq, ad, asum, arow, acc):
    """acc[j, i] = contract dot of weight row w[r0 + i] with activation row arow[j], i < ROWS
    (block_dots.tile_dots: 16 rows' ordered block sums side by side, one vector; up to 4 tokens per
    call share the unpacked weight codes)."""
    tile_sums(w, r0, wtype, aq, ad, asum, arow, acc)


@njit(inline="always", nogil=True, cache=True)
def _share(n_tiles, t, n_threads):
    """Thread t's contiguous share [start, end) of n_tiles tiles (sizes differ by at most one)."""
    return (n_tiles * t) // n_threads, (n_tiles * (t + 1)) // n_threads


@njit(inline="always", nogil=True, cache=True)
def _swiglu_rows(gate, gtype, up, utype, aq, ad, asum, tok, ent, e, r0, arow, g_acc, u_acc, h):
    """h[ent[j], r0:r0 + ROWS] = swiglu(gate x, up x) of expert e's rows r0.. for the entries ent (their
    activation rows tok[ent[j]], gathered into arow): one ROWS-row tile of gate and of up."""
    n = ent.shape[0]
    for j in range(n):
        arow[j] = tok[ent[j]]
    _tile_dot(gate[e], r0, gtype, aq, ad, asum, arow[:n], g_acc)
    _tile_dot(up[e], r0, utype, aq, ad, asum, arow[:n], u_acc)
    for j in range(n):
        for i in range(ROWS):
            h[ent[j], r0 + i] = swiglu(g_acc[j, i], u_acc[j, i])


@njit(nogil=True, cache=True)
def gate_up_share(gate, gtype, up, utype, aq, ad, asum, tok, ents, g_start, g_exp, t, n_threads,
                  h, hq, hd, hs):
    """Thread t's share of h = swiglu(gate x, up x) over (group, 32-row tile), quantized into
    hq int8 / hd / hs at the entries' rows. Group g = entries ents[g_start[g]:g_start[g+1]] of expert
    g_exp[g]; gate/up uint8 [X, n_ff, RB]; aq/ad/asum: the tokens' quantized activations."""
    n_ff = gate.shape[1]
    tiles = n_ff // QK
    g_acc, u_acc = np.empty((ents.shape[0], ROWS), f32), np.empty((ents.shape[0], ROWS), f32)
    arow = np.empty(ents.shape[0], np.int64)
    k0, k1 = _share(g_exp.shape[0] * tiles, t, n_threads)
    for k in range(k0, k1):
        g, tile = k // tiles, k % tiles
        ent = ents[g_start[g]:g_start[g + 1]]
        for r0 in range(tile * QK, tile * QK + QK, ROWS):
            _swiglu_rows(gate, gtype, up, utype, aq, ad, asum, tok, ent, g_exp[g], r0, arow, g_acc, u_acc, h)
        for j in range(ent.shape[0]):
            quantize_block(h[ent[j]], tile * QK, hq[ent[j]], hd[ent[j]], hs[ent[j]], tile)


@njit(nogil=True, cache=True)
def gate_up_rows_share(gate, gtype, up, utype, aq, ad, asum, tok, ents, g_start, g_exp, t, n_threads,
                       unit_rows, h):
    """gate_up_share's h without its requantization, over (group, unit_rows-row tile) units: HALF_ROWS (a
    quarter of its unit) or ROWS (a half), so n_threads members split a few experts' rows evenly. One expert
    over 15 members in half tiles: 64 units, at most 5 a member against 4 for member 0, where whole tiles
    (32) gave two members 3 against member 0's 2, a whole tile (~11 us on the H200 host) that member 0
    waited at the barrier (session 29). quant_share then requantizes h: the same values, the same bits."""
    tiles = gate.shape[1] // unit_rows
    g_acc, u_acc = np.empty((ents.shape[0], unit_rows), f32), np.empty((ents.shape[0], unit_rows), f32)
    arow = np.empty(ents.shape[0], np.int64)
    k0, k1 = _share(g_exp.shape[0] * tiles, t, n_threads)
    for k in range(k0, k1):
        g, r0 = k // tiles, (k % tiles) * unit_rows
        ent = ents[g_start[g]:g_start[g + 1]]
        if unit_rows == ROWS:
            _swiglu_rows(gate, gtype, up, utype, aq, ad, asum, tok, ent, g_exp[g], r0, arow, g_acc, u_acc, h)
            continue
        n = ent.shape[0]  # a half tile: _swiglu_rows' steps over tile_sums_half
        for j in range(n):
            arow[j] = tok[ent[j]]
        tile_sums_half(gate[g_exp[g]], r0, gtype, aq, ad, asum, arow[:n], g_acc)
        tile_sums_half(up[g_exp[g]], r0, utype, aq, ad, asum, arow[:n], u_acc)
        for j in range(n):
            for i in range(HALF_ROWS):
                h[ent[j], r0 + i] = swiglu(g_acc[j, i], u_acc[j, i])


@njit(nogil=True, cache=True)
def quant_share(h, hq, hd, hs, ents, t, n_threads):
    """Thread t's share of the requantization of h's rows ents (every 32-block of each; after
    gate_up_rows_share): hq int8 / hd / hs, as gate_up_share writes them."""
    nb = h.shape[1] // QK
    k0, k1 = _share(ents.shape[0] * nb, t, n_threads)
    for k in range(k0, k1):
        r, b = ents[k // nb], k % nb
        quantize_block(h[r], b * QK, hq[r], hd[r], hs[r], b)


@njit(nogil=True, cache=True)
def down_share(down, dtype, hq, hd, hs, ents, g_start, g_exp, t, n_threads, out):
    """Thread t's share of out[entry, r] = contract dot of down row r with the entry's quantized h."""
    n_embd = down.shape[1]
    tiles = n_embd // QK
    acc = np.empty((ents.shape[0], ROWS), f32)
    k0, k1 = _share(g_exp.shape[0] * tiles, t, n_threads)
    for k in range(k0, k1):
        g, tile = k // tiles, k % tiles
        ent = ents[g_start[g]:g_start[g + 1]]
        n = ent.shape[0]
        e = g_exp[g]
        for r0 in range(tile * QK, tile * QK + QK, ROWS):
            _tile_dot(down[e], r0, dtype, hq, hd, hs, ent, acc)
            for j in range(n):
                for i in range(ROWS):
                    out[ent[j], r0 + i] = acc[j, i]


@njit(parallel=True, nogil=True, cache=True)
def ffn_parallel(gate, gtype, up, utype, down, dtype, aq, ad, asum, tok, ents, g_start, g_exp, n_up, n_down,
                  h, hq, hd, hs, out, flag, flag_value):
    """Both phases in one call on numba's own threads: share t of each phase is one prange iteration
    (static schedule: one share per thread), and the implicit barrier between the loops is the phase
    boundary. One dispatch from Python instead of a pool handoff per share and phase, which at 16
    threads cost more than the shares' arithmetic for a decode token.

    flag (uint32 [1] or [0]): when given, flag[0] = flag_value once every row is in `out`, from here
    rather than from Python after the call returns: a device stream waiting on it (stream_flags) is
    released without the caller's thread needing the GIL back first (DecodeRows' helper thread)."""
    # np.int64(t): numba types a prange body twice (as a plain loop, int64 t, then as the parallel region,
    # uint64 t); one index type means one compile of each share function, not two
    for t in prange(n_up):
        gate_up_share(gate, gtype, up, utype, aq, ad, asum, tok, ents, g_start, g_exp, np.int64(t), n_up,
                      h, hq, hd, hs)
    for t in prange(n_down):
        down_share(down, dtype, hq, hd, hs, ents, g_start, g_exp, np.int64(t), n_down, out)
    if flag.shape[0]:  # after the loop's barrier: every share's rows are written, and seen before it
        store_release(flag, 0, flag_value)


@njit(inline="always", nogil=True, cache=True)
def _row_dot_float(row, af, arow, acc):
    """Float weights: acc[j] = sum over 32-blocks (in order) of the in-order block sum."""
    for j in range(acc.shape[0]):
        acc[j] = f32(0.0)
    for b in range(af.shape[1] // QK):
        o = b * QK
        for j in range(arow.shape[0]):
            a = arow[j]
            t = f32(0.0)
            for i in range(QK):
                t = t + af[a, o + i] * row[o + i]
            acc[j] = acc[j] + t


@njit(nogil=True, cache=True)
def gate_up_float_job(gate, up, x, arow, ent, r0, r1, h):
    n = arow.shape[0]
    g = np.empty(n, f32)
    u = np.empty(n, f32)
    for r in range(r0, r1):
        _row_dot_float(gate[r], x, arow, g)
        _row_dot_float(up[r], x, arow, u)
        for j in range(n):
            h[ent[j], r] = swiglu(g[j], u[j])


@njit(nogil=True, cache=True)
def down_float_job(down, h, ent, r0, r1, out):
    acc = np.empty(ent.shape[0], f32)
    for r in range(r0, r1):
        _row_dot_float(down[r], h, ent, acc)
        for j in range(ent.shape[0]):
            out[ent[j], r] = acc[j]
