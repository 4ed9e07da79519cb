"""CpuTokenRows: the Python side of expert_cpu_token.token_rows (a decode token's CPU rows, every layer in
one nogil numba call). It holds the layers as numba lists, the shared buffers and flags, and checks what
the kernel cannot: quantized layers of one width, a residency table of the right size.

The device side (experts/decode_pipeline.py) writes `ids` and x's codes (kernels/publish) and the `routed`
flag and waits on the `rows` flag; tests/kernels/test_cpu_token_rows.py drives it from a thread that plays
the device's part with the same buffers.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numba
import numpy as np
from numba.typed import List

from .act_quant import quantize_rows_into
from .block_dots import HALF_ROWS, ROWS
from .contract import QK, ExpertLayer, KernelError, readonly_blocks
from .cpu_pool import SINGLE_THREAD_BYTES, numba_threads
from .expert_cpu_token import (
    ABORT,
    ARRIVE_PITCH,
    GATHER,
    N_STAMPS,
    ST_DOWN0,
    ST_ENTRIES,
    ST_PLANNED,
    ST_QUANT,
    ST_ROWS,
    ST_SEEN,
    ST_UP,
    ST_UP0,
    SYNC_LEN,
    cycles,
    token_rows,
    token_rows_team,
)


def team_layer_ok() -> bool:
    """Whether numba's threading layer runs a prange's iterations all at once (OpenMP, workqueue)."""
    from numba.np.ufunc import parallel

    parallel._launch_threads()  # picks the layer (numba.threading_layer() raises before that)
    return numba.threading_layer() in ("omp", "workqueue")


def cycles_per_second(span_s: float = 0.01) -> float:
    """The rate of expert_cpu_token.cycles() (the time-stamp counter), over a span of busy waiting; 0.0 where
    it is not counted (not x86)."""
    # the first call loads (or compiles) cycles() from numba's cache, tens of milliseconds: inside the span it
    # left a few cycles against the whole span, a rate 10^5 too low (session 38: 22,968 CPU ms a token)
    cycles()
    t0, c0 = time.perf_counter(), cycles()
    while time.perf_counter() - t0 < span_s:
        pass
    dt, dc = time.perf_counter() - t0, cycles() - c0
    return dc / dt if dc > 0 else 0.0


# CpuTokenRows.phase_cycles' columns: member 0's plan as its entries, the plan published (the team's counters
# and READY; the members read x's codes in place), then the rows
PHASES = ("plan", "publish", "gate_up", "gate_up_wait", "requant", "down", "down_wait")
_STEPS = np.array([ST_SEEN, ST_ENTRIES, ST_PLANNED, ST_UP0, ST_UP, ST_QUANT, ST_DOWN0, ST_ROWS])


def phases_of(stamps: np.ndarray) -> np.ndarray:
    """Cycles int64 [L, len(PHASES)] between member 0's stamps int64 [L, N_STAMPS] (CpuTokenRows.stamps, or a
    token's TokenOutputs.stamps); zeros where a layer has no rows stamp (the two-region form, a layer not
    reached). Off the worker's thread: a token's outputs only copy the stamps."""
    parts = np.diff(stamps[:, _STEPS], axis=1)
    parts[stamps[:, ST_ROWS] == 0] = 0
    return parts


class TokenOutputs(NamedTuple):
    """One call's outputs (CpuTokenRows.outputs: copies)."""

    seen_ids: np.ndarray  # [L, K] each layer's routed experts
    n_miss: np.ndarray  # [L] entries computed here
    n_pcie: np.ndarray  # [L] misses the GPU read over PCIe instead
    n_ahead: np.ndarray  # [L, 2] misses copied ahead, experts copied
    busy: np.ndarray  # [L] cycles from a layer's routing to its rows flag
    n_warm: np.ndarray  # [L, 2] predicted CPU entries, of them routed
    stamps: np.ndarray  # [L, N_STAMPS] member 0's cycles at each step (phases_of: the steps' cycles)


class CpuTokenRows:
    """One decode token's CPU rows over `layers` (ExpertLayer per layer, quantized), given the host
    residency table `res` (int32 [L * X], -1 = not resident; read during the call, so change it only
    between tokens). Buffers (numpy; on CUDA views of pinned memory the device copies to and from):
    ids int64 [K], x's codes (contract step 1: xq int8 [1, E], xd f32 [1, E/32], xs int32 [1, E/32]; put_x on
    the CPU, kernels/publish on the device), rows f32 [K, E], inv int32 [K], staged int64 [C] (the experts the
    device copied ahead for the layer, -1: none; C = n_staged); flags uint32 [1]: routed, rows, stop.
    warm: before each layer's routing the team also waits for its prediction (flag `predicted`, then
    pred_ids int64 [K] and pred_staged int64 [C]: the routing predicted from the layer's input, the experts
    copied ahead for it) and reads the predicted CPU rows' weights into its cores' caches meanwhile
    (expert_cpu_token.warm_share); the team form only. prefetch: with fixed shares each member prefetches
    its down units once its gate/up share is done (expert_cpu_token.prefetch_down_share; the same rows).
    unit_rows: the weight rows of a team member's gate/up unit, HALF_ROWS or ROWS (the same rows)."""

    def __init__(self, layers: list[ExpertLayer], res: np.ndarray, k: int, n_threads: int,
                 buffers: dict[str, np.ndarray] | None = None,
                 single_thread_bytes: int = SINGLE_THREAD_BYTES, team: bool = True, n_staged: int = 1,
                 warm: bool = False, form: int = GATHER, prefetch: bool = False, unit_rows: int = HALF_ROWS):
        if not layers:
            raise KernelError("no expert layers")
        n_embd, n_expert = layers[0].n_embd, layers[0].gate.shape[0]
        for lay in layers:
            lay.validate()
            if lay.is_float:
                raise KernelError("the token worker runs quantized expert layers only")
            if lay.n_embd != n_embd or lay.gate.shape[0] != n_expert:
                raise KernelError("every layer must have the same width and expert count")
        if n_embd % QK:
            raise KernelError(f"n_embd must be a multiple of {QK}, got {n_embd}")
        if res.dtype != np.int32 or res.shape != (len(layers) * n_expert,):
            raise KernelError(f"res must be int32 [{len(layers) * n_expert}], got {res.dtype} {res.shape}")
        self.n_layers, self.n_expert, self.k, self.n_embd = len(layers), n_expert, k, n_embd
        self.n_threads = max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))
        self.res, self.single_thread_bytes = res, single_thread_bytes
        self.gates, self.ups, self.downs = (List([readonly_blocks(getattr(lay, m)) for lay in layers])
                                            for m in ("gate", "up", "down"))
        self.wtypes = np.array([[lay.gate_type, lay.up_type, lay.down_type] for lay in layers], np.int64)
        self.blob_bytes = max(lay.gate[0].nbytes + lay.up[0].nbytes + lay.down[0].nbytes for lay in layers)
        nb = n_embd // QK
        want = {"ids": ((k,), np.int64), "xq": ((1, n_embd), np.int8), "xd": ((1, nb), np.float32),
                "xs": ((1, nb), np.int32), "rows": ((k, n_embd), np.float32),
                "inv": ((k,), np.int32), "routed": ((1,), np.uint32), "rows_flag": ((1,), np.uint32),
                "stop": ((1,), np.uint32), "staged": ((max(1, n_staged),), np.int64),
                "predicted": ((1,), np.uint32), "pred_ids": ((k,), np.int64),
                "pred_staged": ((max(1, n_staged),), np.int64)}
        buffers = dict(buffers or {})
        for name in ("staged", "pred_staged"):
            if name not in buffers:
                buffers[name] = np.full(max(1, n_staged), -1, np.int64)  # nothing copied ahead
        for name, (shape, dtype) in want.items():
            buf = buffers.setdefault(name, np.zeros(shape, dtype))
            if buf.shape != shape or buf.dtype != dtype or not buf.flags.c_contiguous:
                raise KernelError(f"buffer {name} must be C-contiguous {np.dtype(dtype)} {shape}")
        self.buf = buffers
        self.seen_ids = np.zeros((self.n_layers, k), np.int64)  # [L, K] each layer's routed experts
        self.n_miss = np.zeros(self.n_layers, np.int64)  # [L] entries computed here
        self.n_pcie = np.zeros(self.n_layers, np.int64)  # [L] misses the GPU read over PCIe instead
        self.n_ahead = np.zeros((self.n_layers, 2), np.int64)  # [L, 2] misses copied ahead, experts copied
        # [L] each layer's permille of misses the GPU takes (contract.pcie_entries); set by the caller
        # between tokens, the device plan reads the same values
        self.shares = np.zeros(self.n_layers, np.int64)
        self.busy = np.zeros(self.n_layers, np.int64)  # [L] cycles from a layer's routing to its rows flag
        self._rate = None  # cycles a second, measured on first use
        # the team form (one parallel region a token) needs every member running at once: OpenMP or
        # workqueue threads, not TBB tasks; team=False keeps two regions a layer (token_rows)
        self.team = team and self.n_threads > 1 and team_layer_ok()
        self._sync = np.zeros(SYNC_LEN, np.int64)  # the team's counters (expert_cpu_token.token_rows_team)
        # the team's form (expert_cpu_token.COUNTER / GATHER / DYNAMIC: the same rows) and the gather forms'
        # arrival lines, one a member of any team size numba allows (team_sizes sweeps change n_threads)
        self.form = int(form)
        self.prefetch = bool(prefetch)  # each member's down units prefetched after its gate/up (fixed shares)
        if unit_rows not in (HALF_ROWS, ROWS):
            raise KernelError(f"a gate/up unit is {HALF_ROWS} or {ROWS} weight rows, not {unit_rows}")
        self.unit_rows = int(unit_rows)  # weight rows of a member's gate/up unit (the same rows either way)
        self._arrive = np.zeros((max(1, numba.config.NUMBA_NUM_THREADS), ARRIVE_PITCH), np.int64)
        # [L, N_STAMPS] member 0's cycles at each layer's steps, the last token's (phase_cycles)
        self.stamps = np.zeros((self.n_layers, N_STAMPS), np.int64)
        self.warm = warm and self.team
        self.n_warm = np.zeros((self.n_layers, 2), np.int64)  # [L, 2] predicted CPU entries, of them routed

    def busy_seconds(self, busy: np.ndarray | None = None) -> float:
        """The last call's CPU-row time (its waits on the device left out), summed over the layers it served
        (or that of `busy`, a call's outputs().busy); 0.0 where the cycle counter is not read."""
        if self._rate is None:
            self._rate = cycles_per_second()
        busy = self.busy if busy is None else busy
        return float(busy.sum()) / self._rate if self._rate else 0.0

    def phase_cycles(self) -> np.ndarray:
        """The last team call's CPU-row time of each layer in parts (PHASES), cycles int64 [L, 7]: plan
        (routing seen -> its CPU entries known), publish (-> the plan published to the team), gate/up (->
        member 0's share done), gate/up wait (-> every share done, the barrier left; member 0's down
        prefetch in it), requantization, down (-> member 0's share done), down wait (-> every row in).
        Zeros for the two-region form and for layers no call reached."""
        return phases_of(self.stamps)

    def outputs(self) -> TokenOutputs:
        """Copies of the last call's outputs (the next call overwrites the arrays)."""
        return TokenOutputs(self.seen_ids.copy(), self.n_miss.copy(), self.n_pcie.copy(), self.n_ahead.copy(),
                            self.busy.copy(), self.n_warm.copy(), self.stamps.copy())

    def put_x(self, x: np.ndarray) -> None:
        """The device's part on the CPU (tests, benchmarks): the layer's input x f32 [1, E] quantized into
        the shared codes buffers, as kernels/publish writes them (the same bits: the contract)."""
        b = self.buf
        x = np.ascontiguousarray(x, np.float32).reshape(1, self.n_embd)
        quantize_rows_into(x, b["xq"], b["xd"], b["xs"])

    def run(self, base: int, res: np.ndarray | None = None) -> int:
        """Serve one token: layer l waits for routed >= base + l, then raises rows_flag to it. Blocks (the
        GIL is released); returns -1, or the layer whose wait `stop` ended. res: the residency table the
        token was planned with (a snapshot of the constructor's, same shape), else the constructor's."""
        b = self.buf
        if res is None:
            res = self.res
        elif res.dtype != self.res.dtype or res.shape != self.res.shape or not res.flags.c_contiguous:
            raise KernelError(f"res must be C-contiguous int32 {self.res.shape}")
        self.busy[:] = 0
        with numba_threads(self.n_threads):  # the pool size; each layer narrows it to its shares
            if self.team:
                token_rows_team(self.gates, self.ups, self.downs, self.wtypes, res, self.n_expert,
                                self.shares, b["staged"], b["ids"], b["xq"], b["xd"], b["xs"], b["rows"],
                                b["inv"], b["routed"], b["rows_flag"], base & 0xFFFFFFFF, b["stop"],
                                self.n_threads, self.seen_ids, self.n_miss, self.n_pcie, self.n_ahead,
                                self.busy, self._sync, int(self.warm), b["predicted"], b["pred_ids"],
                                b["pred_staged"], self.n_warm, self.form, self._arrive, self.stamps,
                                int(self.prefetch), self.unit_rows)
                return int(self._sync[ABORT])
            return int(token_rows(self.gates, self.ups, self.downs, self.wtypes, res, self.n_expert,
                                  self.shares, b["staged"], b["ids"], b["xq"], b["xd"], b["xs"], b["rows"],
                                  b["inv"], b["routed"], b["rows_flag"], base & 0xFFFFFFFF, b["stop"],
                                  self.n_threads, self.single_thread_bytes, self.blob_bytes, self.seen_ids,
                                  self.n_miss, self.n_pcie, self.n_ahead, self.busy))

    def stop(self) -> None:
        """End the call's current wait (the device will not raise `routed` again: an error, a shutdown)."""
        self.buf["stop"][0] = 1
