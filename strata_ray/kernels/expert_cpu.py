"""CPU expert kernels (numba, nogil) under the arithmetic contract, run on the CPU pool: the Python driver
(grouping, checks, the pool's dispatch) here, the numba kernels in expert_cpu_kernels.py.

Weights are read in place (numpy views of the memory-mapped GGUF). The entries are grouped by
expert; each phase (gate+up+SwiGLU, then down) is one numba call per pool thread, and thread t
takes the t-th equal, contiguous share of the (expert group, 32-row tile) space. So a call costs
two pool handoffs whatever the number of experts, and every weight row is read once for all the
tokens routed to its expert. Row results do not depend on the split (batch invariance): each
(row, entry) dot runs the same operation sequence wherever it lands.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from .act_quant import quantize_act_sums
from .contract import QK, ExpertLayer, KernelError, readonly_blocks
from .cpu_atomics import raise_flag_value
from .cpu_pool import CpuPool, default_pool, numba_threads
from .expert_cpu_kernels import down_float_job, down_share, ffn_parallel, gate_up_float_job, gate_up_share
from .spec import float_weights

f32 = np.float32


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


def expert_ffn_cpu(x: np.ndarray, tok: np.ndarray, exp: np.ndarray, layer: ExpertLayer,
                   pool: CpuPool | None = None, started: threading.Event | None = None,
                   out: np.ndarray | None = None, done: tuple[np.ndarray, int] | None = None) -> np.ndarray:
    """rows f32 [M, E]: row m = down(swiglu(gate x, up x)) of expert exp[m] for token tok[m].

    x f32 [N, E]; tok, exp int [M]; layer: uint8 block bytes [X, rows, row_bytes] (host memory).
    started: set once the Python part is done and the kernels (which release the GIL) begin, so a caller
    on another thread can wait for that instead of contending for the GIL with it.
    out: f32 [M, E] C-contiguous to write the rows into (e.g. pinned memory a device copies from).
    done: (flag uint32 [1], value): flag[0] = value once the rows are written, by the parallel kernel
    itself when it runs (no Python between the last row and the flag), else before returning.
    """
    layer.validate()
    x = np.ascontiguousarray(x, dtype=f32)
    tok = np.asarray(tok).astype(np.int64)
    exp = np.asarray(exp).astype(np.int64)
    _check_entries(x, tok, exp, layer)
    pool = pool or default_pool()
    m, n_embd, n_ff = len(tok), layer.n_embd, layer.n_ff
    out = _output(out, m, n_embd)
    if m == 0 or layer.is_float:
        if started is not None:
            started.set()
        if m:
            _float_ffn(x, tok, group_entries(exp), layer, pool, out)
        _set_done(done)
        return out
    gate, up, down = layer.gate, layer.up, layer.down
    if not layer.c_contiguous:
        # a strided layer (a fused gate_up's halves left in the file map, the CPU slot tier's views of its
        # store): the routed experts alone as C blocks, their ids renumbered in the same order.
        # readonly_blocks of the whole layer copied every expert of it at every call (a fused 80b-a3b layer:
        # ~600 MB; a CPU slot tier of 1,000 slots: 1.8 GB)
        routed, exp = np.unique(exp, return_inverse=True)
        exp = exp.reshape(-1).astype(np.int64)
        gate, up, down = (np.asarray(w)[routed] for w in (gate, up, down))
    ents, g_start, g_exp = group_arrays(exp)
    n_groups = len(g_exp)
    xq, xd, xs = quantize_act_sums(x)
    h = np.empty((m, n_ff), f32)
    hq = np.empty((m, n_ff), np.int8)
    hd = np.empty((m, n_ff // QK), f32)
    hs = np.empty((m, n_ff // QK), np.int32)
    gate, up, down = readonly_blocks(gate), readonly_blocks(up), readonly_blocks(down)
    # plain ints: an IntEnum type (gguf's GGMLQuantizationType) is another numba signature
    gtype, utype, dtype = int(layer.gate_type), int(layer.up_type), int(layer.down_type)
    # One share per thread, never more shares than 32-row tiles.
    n_up = min(pool.n_threads, n_groups * n_ff // QK)
    n_down = min(pool.n_threads, n_groups * n_embd // QK)
    args = (gate, gtype, up, utype, xq, xd, xs, tok, ents, g_start, g_exp)
    if started is not None:
        started.set()
    if pool.n_threads > 1 and pool.numba_parallel:
        flag, value = done if done is not None else (_NO_FLAG, 0)
        with numba_threads(max(n_up, n_down)):  # uint32 value: the type expert_cpu_token's call passes
            ffn_parallel(gate, gtype, up, utype, down, dtype, xq, xd, xs, tok, ents, g_start, g_exp, n_up,
                         n_down, h, hq, hd, hs, out, flag, np.uint32(value))
        return out
    pool.run(gate_up_share, [(*args, t, n_up, h, hq, hd, hs) for t in range(n_up)])
    pool.run(down_share, [(down, dtype, hq, hd, hs, ents, g_start, g_exp, t, n_down, out)
                          for t in range(n_down)])
    _set_done(done)
    return out


_NO_FLAG = np.zeros(0, np.uint32)  # ffn_parallel's "no flag to raise"


class TokenLayer(NamedTuple):
    """A quantized ExpertLayer checked once for expert_ffn_cpu_token: its blocks as the kernels take them."""

    layer: ExpertLayer  # the layer these views are of (a caller that keeps them checks it is still its own)
    gate: np.ndarray  # uint8 [X, n_ff, RB], read-only
    up: np.ndarray
    down: np.ndarray  # uint8 [X, E, RB]
    types: tuple[int, int, int]  # gate, up, down as plain ints


def token_form_fits(layer: ExpertLayer) -> bool:
    """Whether token_layer takes this layer: quantized, its three matrices C-contiguous numpy arrays."""
    return not layer.is_float and layer.c_contiguous


def token_layer(layer: ExpertLayer) -> TokenLayer:
    """The checks and views expert_ffn_cpu makes at every call, made once. KernelError for a float layer
    (the token form is the quantized kernels') or a matrix that is not C-contiguous (a fused gate_up's
    halves: its read-only view would be a copy of the whole layer, kept as long as the TokenLayer)."""
    layer.validate()
    if layer.is_float:
        raise KernelError("the one-token CPU rows take quantized experts only")
    if not token_form_fits(layer):
        raise KernelError("the one-token CPU rows read contiguous expert matrices only")
    blocks = (readonly_blocks(layer.gate), readonly_blocks(layer.up), readonly_blocks(layer.down))
    return TokenLayer(layer, *blocks, (int(layer.gate_type), int(layer.up_type), int(layer.down_type)))


def expert_ffn_cpu_token(x: np.ndarray, exp: np.ndarray, tl: TokenLayer) -> np.ndarray:
    """rows f32 [K, E] of one token x f32 [1, E] routed to the experts exp int [K], on the calling thread:
    expert_ffn_cpu's kernels on a one-thread pool, so its bits, without its grouping, checks and dispatch.

    Each entry is a group of its own, in entry order: a token's top-k experts are distinct, and wherever
    they are not, an entry's rows still do not depend on which entries share its group (batch invariance),
    so nothing is sorted. For a small model's decode that Python was most of a layer's expert call: on the
    embedded model the call went ~110 -> ~65 us a layer, this function ~36 of them (session 43, 2-core VM)."""
    # a writable C int64 copy, as group_arrays makes: the kernels' signature (a read-only or strided ids array
    # would be another numba compile), and ids checked after the cast (a NaN must not pass as INT64_MIN)
    g_exp = np.array(exp, dtype=np.int64).reshape(-1)
    k, e_max = g_exp.shape[0], min(tl.gate.shape[0], tl.up.shape[0], tl.down.shape[0])
    if (x.shape != (1, tl.layer.n_embd) or np.ndim(exp) != 1 or not k or int(g_exp.min()) < 0
            or int(g_exp.max()) >= e_max):
        raise KernelError(f"one token [1, {tl.layer.n_embd}] and expert ids [K] in [0, {e_max}) expected, "
                          f"got x {tuple(x.shape)} and ids {np.asarray(exp).tolist()}")
    n_embd, n_ff = tl.layer.n_embd, tl.layer.n_ff
    xq, xd, xs = quantize_act_sums(x)
    h = np.empty((k, n_ff), f32)
    hq = np.empty((k, n_ff), np.int8)
    hd = np.empty((k, n_ff // QK), f32)
    hs = np.empty((k, n_ff // QK), np.int32)
    out = np.empty((k, n_embd), f32)
    ents = np.arange(k, dtype=np.int64)  # entry i: group i, expert exp[i], token 0
    g_start = np.arange(k + 1, dtype=np.int64)
    gtype, utype, dtype = tl.types
    gate_up_share(tl.gate, gtype, tl.up, utype, xq, xd, xs, np.zeros(k, np.int64), ents, g_start, g_exp, 0, 1,
                  h, hq, hd, hs)
    down_share(tl.down, dtype, hq, hd, hs, ents, g_start, g_exp, 0, 1, out)
    return out


def _output(out: np.ndarray | None, m: int, n_embd: int) -> np.ndarray:
    """The caller's rows buffer (checked), or a new one."""
    if out is None:
        return np.zeros((m, n_embd), f32)
    if out.shape != (m, n_embd) or out.dtype != f32 or not out.flags.c_contiguous:
        raise KernelError(f"out must be C-contiguous float32 [{m}, {n_embd}], got {out.dtype} {out.shape}")
    return out


def _set_done(done: tuple[np.ndarray, int] | None) -> None:
    """Set the done flag from Python (the paths that do not run ffn_parallel): a release store, as
    ffn_parallel's (cpu_atomics)."""
    if done is not None:
        raise_flag_value(done[0], done[1])
