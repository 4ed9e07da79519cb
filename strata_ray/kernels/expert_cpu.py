"""CPU expert kernels (numba, nogil) under the arithmetic contract, run on the CPU pool.

Weights are read in place (numpy views of the memory-mapped GGUF). The entries are grouped by
expert; each phase (gate+up+SwiGLU, then down) is one numba call per pool thread, and thread t
takes the t-th equal, contiguous share of the (expert group, 32-row tile) space. So a call costs
two pool handoffs whatever the number of experts, and every weight row is read once for all the
tokens routed to its expert. Row results do not depend on the split (batch invariance): each
(row, entry) dot runs the same operation sequence wherever it lands.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit, prange

from .act_quant import quantize_act_sums, quantize_block, swiglu
from .block_dots import ROWS
from .blocks import tile_sums
from .contract import QK, ExpertLayer, KernelError
from .cpu_pool import CpuPool, default_pool, numba_threads
from .spec import float_weights

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
        n = ent.shape[0]
        for j in range(n):
            arow[j] = tok[ent[j]]
        e = g_exp[g]
        for r0 in range(tile * QK, tile * QK + QK, ROWS):
            _tile_dot(gate[e], r0, gtype, aq, ad, asum, arow[:n], g_acc)
            _tile_dot(up[e], r0, utype, aq, ad, asum, arow[:n], u_acc)
            for j in range(n):
                for i in range(ROWS):
                    h[ent[j], r0 + i] = swiglu(g_acc[j, i], u_acc[j, i])
        for j in range(n):
            quantize_block(h[ent[j]], tile * QK, hq[ent[j]], hd[ent[j]], hs[ent[j]], tile)


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
def _ffn_parallel(gate, gtype, up, utype, down, dtype, aq, ad, asum, tok, ents, g_start, g_exp, n_up, n_down,
                  h, hq, hd, hs, out):
    """Both phases in one call on numba's own threads: share t of each phase is one prange iteration
    (static schedule: one share per thread), and the implicit barrier between the loops is the phase
    boundary. One dispatch from Python instead of a pool handoff per share and phase, which at 16
    threads cost more than the shares' arithmetic for a decode token."""
    for t in prange(n_up):
        gate_up_share(gate, gtype, up, utype, aq, ad, asum, tok, ents, g_start, g_exp, t, n_up, h, hq, hd, hs)
    for t in prange(n_down):
        down_share(down, dtype, hq, hd, hs, ents, g_start, g_exp, t, n_down, out)


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


def group_entries(exp: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """[(expert, its entry indices ascending)] in expert order."""
    order = np.argsort(exp, kind="stable")
    sorted_exp = exp[order]
    cuts = [0, *(np.flatnonzero(np.diff(sorted_exp)) + 1), len(order)]
    return [(int(sorted_exp[c0]), order[c0:c1]) for c0, c1 in zip(cuts[:-1], cuts[1:], strict=True)]


def group_arrays(exp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """group_entries as arrays, for the quantized kernels: (entries grouped by expert, ascending within
    each group, int64 [M]; group starts int64 [G + 1]; the groups' experts int64 [G]), without Python
    lists (a decode call holds ~5 experts and this runs 48 times a token)."""
    order = np.argsort(exp, kind="stable")
    sorted_exp = exp[order]
    first = np.empty(len(exp), dtype=bool)
    first[:1] = True
    np.not_equal(sorted_exp[1:], sorted_exp[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    g_start = np.append(starts, len(exp)).astype(np.int64)
    return order.astype(np.int64, copy=False), g_start, sorted_exp[starts]


def _row_ranges(n_rows: int, chunk: int) -> list[tuple[int, int]]:
    return [(r, min(r + chunk, n_rows)) for r in range(0, n_rows, chunk)]


def _chunk_rows(n_groups: int, n_rows: int, n_threads: int) -> int:
    """Rows per float job (a multiple of 32): about 4 jobs per thread over the whole phase."""
    per_group = max(1, (4 * n_threads + n_groups - 1) // n_groups)
    return max(QK, (n_rows // per_group) // QK * QK)


def _check_entries(x: np.ndarray, tok: np.ndarray, exp: np.ndarray, layer: ExpertLayer) -> None:
    if x.ndim != 2 or x.shape[1] != layer.n_embd:
        raise KernelError(f"x must be [N, {layer.n_embd}], got {tuple(x.shape)}")
    if tok.shape != exp.shape or tok.ndim != 1:
        raise KernelError(f"tok and exp must be [M] each, got {tok.shape} and {exp.shape}")
    if len(tok) and (tok.min() < 0 or tok.max() >= x.shape[0]):
        raise KernelError("a token index is out of range")
    if len(exp) and (exp.min() < 0 or exp.max() >= layer.gate.shape[0]):
        raise KernelError(f"an expert index is out of range (layer holds {layer.gate.shape[0]})")


def _float_ffn(x, tok, groups, layer: ExpertLayer, pool: CpuPool, out: np.ndarray) -> None:
    n_embd, n_ff = layer.n_embd, layer.n_ff
    up_chunk = _chunk_rows(len(groups), n_ff, pool.n_threads)
    down_chunk = _chunk_rows(len(groups), n_embd, pool.n_threads)
    h = np.empty((len(tok), n_ff), f32)
    mats = ((layer.gate, layer.gate_type), (layer.up, layer.up_type), (layer.down, layer.down_type))
    views = {e: [float_weights(np.asarray(w[e]), t) for w, t in mats] for e, _ in groups}
    pool.run(gate_up_float_job, [(views[e][0], views[e][1], x, tok[ent], ent, r0, r1, h)
                                 for e, ent in groups for r0, r1 in _row_ranges(n_ff, up_chunk)])
    pool.run(down_float_job, [(views[e][2], h, ent, r0, r1, out)
                              for e, ent in groups for r0, r1 in _row_ranges(n_embd, down_chunk)])


def _contiguous(w) -> np.ndarray:
    """The block bytes as a C-contiguous numpy array (a view when already contiguous)."""
    return np.ascontiguousarray(np.asarray(w))


def expert_ffn_cpu(x: np.ndarray, tok: np.ndarray, exp: np.ndarray, layer: ExpertLayer,
                   pool: CpuPool | None = None, started: threading.Event | None = None) -> np.ndarray:
    """rows f32 [M, E]: row m = down(swiglu(gate x, up x)) of expert exp[m] for token tok[m].

    x f32 [N, E]; tok, exp int [M]; layer: uint8 block bytes [X, rows, row_bytes] (host memory).
    started: set once the Python part is done and the kernels (which release the GIL) begin, so a caller
    on another thread can wait for that instead of contending for the GIL with it.
    """
    layer.validate()
    x = np.ascontiguousarray(x, dtype=f32)
    tok = np.asarray(tok).astype(np.int64)
    exp = np.asarray(exp).astype(np.int64)
    _check_entries(x, tok, exp, layer)
    pool = pool or default_pool()
    m, n_embd, n_ff = len(tok), layer.n_embd, layer.n_ff
    out = np.zeros((m, n_embd), f32)
    if m == 0 or layer.is_float:
        if started is not None:
            started.set()
        if m:
            _float_ffn(x, tok, group_entries(exp), layer, pool, out)
        return out
    ents, g_start, g_exp = group_arrays(exp)
    n_groups = len(g_exp)
    xq, xd, xs = quantize_act_sums(x)
    h = np.empty((m, n_ff), f32)
    hq = np.empty((m, n_ff), np.int8)
    hd = np.empty((m, n_ff // QK), f32)
    hs = np.empty((m, n_ff // QK), np.int32)
    gate, up, down = _contiguous(layer.gate), _contiguous(layer.up), _contiguous(layer.down)
    # One share per thread, never more shares than 32-row tiles.
    n_up = min(pool.n_threads, n_groups * n_ff // QK)
    n_down = min(pool.n_threads, n_groups * n_embd // QK)
    args = (gate, layer.gate_type, up, layer.up_type, xq, xd, xs, tok, ents, g_start, g_exp)
    if started is not None:
        started.set()
    if pool.n_threads > 1 and pool.numba_parallel:
        with numba_threads(max(n_up, n_down)):
            _ffn_parallel(gate, layer.gate_type, up, layer.up_type, down, layer.down_type, xq, xd, xs, tok,
                          ents, g_start, g_exp, n_up, n_down, h, hq, hd, hs, out)
        return out
    pool.run(gate_up_share, [(*args, t, n_up, h, hq, hd, hs) for t in range(n_up)])
    pool.run(down_share, [(down, layer.down_type, hq, hd, hs, ents, g_start, g_exp, t, n_down, out)
                          for t in range(n_down)])
    return out
