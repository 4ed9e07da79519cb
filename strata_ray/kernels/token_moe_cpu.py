"""One decode token's routed experts on the CPU, their rows and the rows' weighted sum, with no Python between
the kernels: the CPU backend's decode layer when every routed entry is the CPU pool's.

For a small model that layer was mostly Python: `expert_cpu.expert_ffn_cpu_token` (the rows [K, E]: its
checks and a dozen numpy allocations around two kernel calls) then `moe.combine_rows` (their weighted sum in
k order: its checks and wrappers around one kernel call), ~40 us a layer of the embedded model on the 2-core
VM, of which the kernels were ~15. TokenMoe calls the same kernels straight, on work arrays made once:

    x [1, E] -> act_quant.quantize_rows_into                    (the token's codes, scales and sums)
             -> expert_cpu_kernels.gate_up_share / down_share   (one group an entry, on one thread,
                                                                 as expert_ffn_cpu_token calls them)
             -> fused_small_cpu._combine_rows                   (r0 w0, then + rk wk in k order)

so its bits are those two calls' (tests/kernels/test_token_moe_cpu.py), with their argument types: no numba
signature of its own (one numba function calling the three was as fast, and its first compile took ~80 s on
one core, as it re-optimizes the kernels it calls). The twin is that pair of calls.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from .act_quant import quantize_rows_into
from .contract import QK, KernelError
from .expert_cpu import TokenLayer
from .expert_cpu_kernels import down_share, gate_up_share
from .fused_small import fused_call, needs_grad
from .fused_small_cpu import _combine_rows

f32 = np.float32


def token_moe_cpu_serves(weights: Tensor) -> bool:
    """Whether a one-token layer whose every entry is the CPU pool's takes a TokenMoe: a fused_call (no grad,
    STRATA_FUSED_DECODE not 0) on routing weights that autograd does not track (the combine's gradient with
    respect to them is torch's)."""
    return fused_call(weights, 1) and not needs_grad(weights)


def _plain_f32(a: np.ndarray) -> np.ndarray:
    """a as a C-contiguous, writable float32 array: itself where it is one (np.require's check costs ~1 us,
    these flags ~0.2)."""
    if a.dtype == f32 and a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, dtype=f32, order="C")


class TokenMoe:
    """A quantized layer's one-token experts and combine. Its work arrays are reused call after call, so one
    caller at a time (a forward's layer); each call returns a new output array."""

    def __init__(self, tl: TokenLayer):
        self.tl = tl
        self.n_embd, self.n_ff = tl.layer.n_embd, tl.layer.n_ff
        self.n_expert = min(tl.gate.shape[0], tl.up.shape[0], tl.down.shape[0])
        E, nb = self.n_embd, self.n_embd // QK
        self._x = (np.empty((1, E), np.int8), np.empty((1, nb), f32), np.empty((1, nb), np.int32))
        self._by_k: dict[int, tuple[np.ndarray, ...]] = {}

    def _arrays(self, k: int) -> tuple[np.ndarray, ...]:
        """(h, hq, hd, hs, rows, ents, g_start, tok) for k entries, made at the first call with k."""
        arrays = self._by_k.get(k)
        if arrays is None:
            F, nb = self.n_ff, self.n_ff // QK
            arrays = self._by_k[k] = (
                np.empty((k, F), f32), np.empty((k, F), np.int8), np.empty((k, nb), f32),
                np.empty((k, nb), np.int32),  # h, its codes, scales and sums
                np.empty((k, self.n_embd), f32),  # the rows [K, E]
                np.arange(k, dtype=np.int64), np.arange(k + 1, dtype=np.int64),  # entry i: group i
                np.zeros(k, np.int64),  # every entry's activation row: 0
            )
        return arrays

    def __call__(self, x: np.ndarray, exp: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """combine_rows(expert_ffn_cpu_token(x, exp, tl) as [1, K, E], weights): one token x f32 [1, E]
        routed to the experts exp int [K] with weights f32 [1, K] -> f32 [1, E], the same bits."""
        # C-contiguous, writable, of one dtype each: the kernels' signatures (another would compile again)
        g_exp = np.array(exp, dtype=np.int64).reshape(-1)
        x, wts = _plain_f32(x), _plain_f32(weights)
        ids = g_exp.tolist()  # a few ids: Python's min / max beat numpy's reductions' dispatch
        k, E = len(ids), self.n_embd
        if x.shape != (1, E) or np.ndim(exp) != 1 or not k or wts.shape != (1, k):
            raise KernelError(f"one token [1, {E}], expert ids [K] and weights [1, K] expected, got x "
                              f"{tuple(x.shape)}, ids {np.shape(exp)} and weights {tuple(wts.shape)}")
        if min(ids) < 0 or max(ids) >= self.n_expert:  # a NaN id is INT64_MIN after the cast
            raise KernelError(f"expert ids must be in [0, {self.n_expert}), got {ids}")
        xq, xd, xs = self._x
        h, hq, hd, hs, rows, ents, g_start, tok = self._arrays(k)
        gtype, utype, dtype = self.tl.types
        quantize_rows_into(x, xq, xd, xs)
        gate_up_share(self.tl.gate, gtype, self.tl.up, utype, xq, xd, xs, tok, ents, g_start, g_exp, 0, 1,
                      h, hq, hd, hs)
        down_share(self.tl.down, dtype, hq, hd, hs, ents, g_start, g_exp, 0, 1, rows)
        out = np.empty((1, E), f32)
        _combine_rows(rows.reshape(1, k, E), wts, out)
        return out
