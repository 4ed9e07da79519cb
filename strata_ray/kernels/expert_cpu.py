"""CPU expert kernels (numba, nogil) under the arithmetic contract, run on the CPU pool.

Weights are read in place (numpy views of the memory-mapped GGUF). Work is split into jobs of
(expert group, output-row range) so that few experts still keep every core busy; each job reads
each of its weight rows once for all tokens routed to that expert.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .act_quant import quantize_act_sums, quantize_block, swiglu
from .blocks import block_isums, block_isums_q8_0, row_scales, unpack_row
from .contract import Q4_K, Q8_0, QK, ExpertLayer, KernelError
from .cpu_pool import CpuPool, default_pool
from .spec import float_weights

f32 = np.float32


@njit(inline="always", nogil=True, cache=True)
def _row_dot(row, wtype, aq, ad, asum, arow, acc, sc):
    """acc[j] = contract dot of one weight row with activation row arow[j], for every j.
    aq holds the int8 activation codes as exact f32 values (so block sums vectorise);
    sc: scratch (w f32 [K], isum f32 [nb], d f32 [nb], dmin f32 [nb], m int32 [nb])."""
    w, isum, d, dmin, m = sc
    n = aq.shape[1] // ad.shape[1]  # 32, but opaque to LLVM (see blocks.block_isums)
    row_scales(row, wtype, d, dmin, m)
    if wtype != Q8_0:
        unpack_row(row, wtype, w, n)
    for j in range(arow.shape[0]):
        a = arow[j]
        if wtype == Q8_0:
            block_isums_q8_0(row, aq[a], isum, n)
        else:
            block_isums(w, aq[a], isum, n)
        acc_j = f32(0.0)
        for b in range(ad.shape[1]):
            t = (isum[b] + f32(0.0)) * (d[b] * ad[a, b])  # + 0 turns a -0 from reassociation into +0
            if wtype == Q4_K:
                t = t - f32(m[b] * asum[a, b]) * (dmin[b] * ad[a, b])
            acc_j = acc_j + t
        acc[j] = acc_j


@njit(nogil=True, cache=True)
def _scratch(nb):
    return (np.empty(nb * QK, f32), np.empty(nb, f32), np.empty(nb, f32), np.empty(nb, f32),
            np.empty(nb, np.int32))


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
def gate_up_job(gate, gtype, up, utype, aq, ad, asum, arow, ent, r0, r1, h, hq, hd, hs):
    """Rows [r0, r1) (multiples of 32) of h = swiglu(gate x, up x) for entries ent, quantized into
    hq (codes as f32)/hd/hs at those entries. gate/up uint8 [n_ff, RB]; aq/ad/asum: token activations."""
    n = arow.shape[0]
    g = np.empty(n, f32)
    u = np.empty(n, f32)
    sc = _scratch(ad.shape[1])
    for r in range(r0, r1):
        _row_dot(gate[r], gtype, aq, ad, asum, arow, g, sc)
        _row_dot(up[r], utype, aq, ad, asum, arow, u, sc)
        for j in range(n):
            h[ent[j], r] = swiglu(g[j], u[j])
    for j in range(n):
        e = ent[j]
        for b in range(r0 // QK, r1 // QK):
            quantize_block(h[e], b * QK, hq[e], hd[e], hs[e], b)  # hq is f32: codes stored exactly


@njit(nogil=True, cache=True)
def down_job(down, dtype, hqf, hd, hs, ent, r0, r1, out):
    """out[ent[j], r] = contract dot of down row r with the entry's quantized hidden vector."""
    acc = np.empty(ent.shape[0], f32)
    sc = _scratch(hd.shape[1])
    for r in range(r0, r1):
        _row_dot(down[r], dtype, hqf, hd, hs, ent, acc, sc)
        for j in range(ent.shape[0]):
            out[ent[j], r] = acc[j]


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


@njit(nogil=True, cache=True)
def gate_up_batch(gate, gtype, up, utype, aq, ad, asum, tok, ents, g_start, g_exp, jobs, h, hq, hd, hs):
    """Run gate_up_job for jobs [J, 3] = (group, r0, r1); group g = entries ents[g_start[g]:g_start[g+1]]
    of expert g_exp[g]. One call per thread keeps Python dispatch off the critical path."""
    for k in range(jobs.shape[0]):
        g = jobs[k, 0]
        ent = ents[g_start[g]:g_start[g + 1]]
        arow = np.empty(ent.shape[0], np.int64)
        for j in range(ent.shape[0]):
            arow[j] = tok[ent[j]]
        e = g_exp[g]
        r0, r1 = jobs[k, 1], jobs[k, 2]
        gate_up_job(gate[e], gtype, up[e], utype, aq, ad, asum, arow, ent, r0, r1, h, hq, hd, hs)


@njit(nogil=True, cache=True)
def down_batch(down, dtype, hqf, hd, hs, ents, g_start, g_exp, jobs, out):
    for k in range(jobs.shape[0]):
        g = jobs[k, 0]
        ent = ents[g_start[g]:g_start[g + 1]]
        down_job(down[g_exp[g]], dtype, hqf, hd, hs, ent, jobs[k, 1], jobs[k, 2], out)


def _jobs(n_groups: int, n_rows: int, chunk: int) -> np.ndarray:
    """int64 [J, 3] of (group, r0, r1)."""
    return np.array([(g, r0, r1) for g in range(n_groups) for r0, r1 in _row_ranges(n_rows, chunk)], np.int64)


def _per_thread(jobs: np.ndarray, n_threads: int) -> list[np.ndarray]:
    """Deal jobs round-robin (neighbouring row ranges of one expert land on different threads)."""
    return [np.ascontiguousarray(jobs[i::n_threads]) for i in range(min(n_threads, len(jobs)))]


def group_entries(exp: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """[(expert, its entry indices ascending)] in expert order."""
    order = np.argsort(exp, kind="stable")
    sorted_exp = exp[order]
    cuts = [0, *(np.flatnonzero(np.diff(sorted_exp)) + 1), len(order)]
    return [(int(sorted_exp[c0]), order[c0:c1]) for c0, c1 in zip(cuts[:-1], cuts[1:], strict=True)]


def _row_ranges(n_rows: int, chunk: int) -> list[tuple[int, int]]:
    return [(r, min(r + chunk, n_rows)) for r in range(0, n_rows, chunk)]


def _chunk_rows(n_groups: int, n_rows: int, n_threads: int) -> int:
    """Rows per job (a multiple of 32): about 4 jobs per thread over the whole phase."""
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


def expert_ffn_cpu(x: np.ndarray, tok: np.ndarray, exp: np.ndarray, layer: ExpertLayer,
                   pool: CpuPool | None = None) -> np.ndarray:
    """rows f32 [M, E]: row m = down(swiglu(gate x, up x)) of expert exp[m] for token tok[m].

    x f32 [N, E]; tok, exp int [M]; layer: uint8 block bytes [X, rows, row_bytes] (host memory).
    """
    layer.validate()
    x = np.ascontiguousarray(x, dtype=f32)
    tok = np.asarray(tok).astype(np.int64)
    exp = np.asarray(exp).astype(np.int64)
    _check_entries(x, tok, exp, layer)
    pool = pool or default_pool()
    m, n_embd, n_ff = len(tok), layer.n_embd, layer.n_ff
    out = np.zeros((m, n_embd), f32)
    if m == 0:
        return out
    groups = group_entries(exp)
    up_chunk = _chunk_rows(len(groups), n_ff, pool.n_threads)
    down_chunk = _chunk_rows(len(groups), n_embd, pool.n_threads)
    h = np.empty((m, n_ff), f32)
    if layer.is_float:
        mats = ((layer.gate, layer.gate_type), (layer.up, layer.up_type), (layer.down, layer.down_type))
        views = {e: [float_weights(np.asarray(w[e]), t) for w, t in mats] for e, _ in groups}
        pool.run(gate_up_float_job, [(views[e][0], views[e][1], x, tok[ent], ent, r0, r1, h)
                                     for e, ent in groups for r0, r1 in _row_ranges(n_ff, up_chunk)])
        pool.run(down_float_job, [(views[e][2], h, ent, r0, r1, out)
                                  for e, ent in groups for r0, r1 in _row_ranges(n_embd, down_chunk)])
        return out
    xq, xd, xs = quantize_act_sums(x)
    xq = xq.astype(f32)  # exact; f32 codes let the block sums vectorise
    hq = np.empty((m, n_ff), f32)
    hd = np.empty((m, n_ff // QK), f32)
    hs = np.empty((m, n_ff // QK), np.int32)
    gate, up, down = np.asarray(layer.gate), np.asarray(layer.up), np.asarray(layer.down)
    ents = np.concatenate([ent for _, ent in groups])
    g_start = np.cumsum([0] + [len(ent) for _, ent in groups]).astype(np.int64)
    g_exp = np.array([e for e, _ in groups], np.int64)
    n = pool.n_threads
    pool.run(gate_up_batch, [(gate, layer.gate_type, up, layer.up_type, xq, xd, xs, tok, ents, g_start, g_exp,
                              jobs, h, hq, hd, hs)
                             for jobs in _per_thread(_jobs(len(groups), n_ff, up_chunk), n)])
    pool.run(down_batch, [(down, layer.down_type, hq, hd, hs, ents, g_start, g_exp, jobs, out)
                          for jobs in _per_thread(_jobs(len(groups), n_embd, down_chunk), n)])
    return out
