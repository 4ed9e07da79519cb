"""One decode token's routed experts on the CPU, their rows and the rows' weighted sum, in one numba call.

The CPU backend's decode sends every routed entry to the CPU pool (no cache tier computes there), and for
a small model that layer was mostly Python: `expert_cpu.expert_ffn_cpu_token` (the rows [K, E]: its checks
and a dozen numpy allocations around two kernel calls) then `moe.combine_rows` (their weighted sum in k
order: its checks and wrappers around one kernel call), ~55 us a layer on the 2-core VM of which the
kernels were ~23. Here the same kernels run from one nogil call:

    x [1, E] -> act_quant.quantize_rows_into                    (the token's codes, scales and sums)
             -> expert_cpu_kernels.gate_up_share / down_share   (one group an entry, on one thread,
                                                                 as expert_ffn_cpu_token calls them)
             -> fused_small_cpu._combine_rows                   (r0 w0, then + rk wk in k order)

so its bits are those two calls' (tests/kernels/test_token_moe_cpu.py). The twin is that pair of calls.
"""

from __future__ import annotations

import numba
import numpy as np
from torch import Tensor

from .act_quant import quantize_rows_into
from .contract import QK, KernelError
from .expert_cpu import TokenLayer
from .expert_cpu_kernels import down_share, gate_up_share
from .fused_small import fused_call, needs_grad
from .fused_small_cpu import _combine_rows

f32 = np.float32


@numba.njit(nogil=True, cache=True)
def _token_moe(x, exp, wts, gate, gtype, up, utype, down, dtype, out):
    """x f32 [1, E], exp int64 [K], wts f32 [1, K], the layer's blocks -> out f32 [1, E]. Returns 0, or -1
    (nothing computed) where an expert id is outside every matrix's [0, X)."""
    k, n_embd, n_ff = exp.shape[0], x.shape[1], gate.shape[1]
    n_expert = min(gate.shape[0], up.shape[0], down.shape[0])
    for i in range(k):
        if exp[i] < 0 or exp[i] >= n_expert:
            return -1
    xq = np.empty((1, n_embd), np.int8)
    xd = np.empty((1, n_embd // QK), f32)
    xs = np.empty((1, n_embd // QK), np.int32)
    quantize_rows_into(x, xq, xd, xs)
    h = np.empty((k, n_ff), f32)  # gate_up_share's scratch: the SwiGLU before its requantization
    hq = np.empty((k, n_ff), np.int8)
    hd = np.empty((k, n_ff // QK), f32)
    hs = np.empty((k, n_ff // QK), np.int32)
    rows = np.empty((k, n_embd), f32)
    ents = np.arange(k)  # entry i: group i, expert exp[i], activation row 0
    g_start = np.arange(k + 1)
    tok = np.zeros(k, np.int64)
    gate_up_share(gate, gtype, up, utype, xq, xd, xs, tok, ents, g_start, exp, 0, 1, h, hq, hd, hs)
    down_share(down, dtype, hq, hd, hs, ents, g_start, exp, 0, 1, rows)
    _combine_rows(rows.reshape((1, k, n_embd)), wts, out)
    return 0


def token_moe_cpu_serves(weights: Tensor) -> bool:
    """Whether a one-token layer whose every entry is the CPU pool's takes token_moe_cpu: a fused_call (no
    grad, STRATA_FUSED_DECODE not 0) on float32 routing weights that autograd does not track (the combine's
    gradient with respect to them is torch's)."""
    return fused_call(weights, 1) and not needs_grad(weights)


def token_moe_cpu(x: np.ndarray, exp: np.ndarray, weights: np.ndarray, tl: TokenLayer) -> np.ndarray:
    """combine_rows(expert_ffn_cpu_token(x, exp, tl) as [1, K, E], weights): one token x f32 [1, E] routed
    to the experts exp int [K] with weights f32 [1, K] -> f32 [1, E], the same bits."""
    # C-contiguous, writable, of one dtype each: the kernel's one signature (another would compile again)
    g_exp = np.array(exp, dtype=np.int64).reshape(-1)
    x = np.ascontiguousarray(x, dtype=f32)
    wts = np.ascontiguousarray(weights, dtype=f32)
    k = g_exp.shape[0]
    if x.shape != (1, tl.layer.n_embd) or np.ndim(exp) != 1 or not k or wts.shape != (1, k):
        raise KernelError(f"one token [1, {tl.layer.n_embd}], expert ids [K] and weights [1, K] expected, "
                          f"got x {tuple(x.shape)}, ids {np.shape(exp)} and weights {tuple(wts.shape)}")
    out = np.empty((1, tl.layer.n_embd), f32)
    gtype, utype, dtype = tl.types
    if _token_moe(x, g_exp, wts, tl.gate, gtype, tl.up, utype, tl.down, dtype, out):
        e_max = min(tl.gate.shape[0], tl.up.shape[0], tl.down.shape[0])
        raise KernelError(f"expert ids must be in [0, {e_max}), got {g_exp.tolist()}")
    return out
