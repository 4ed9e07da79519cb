"""RMSNorm (and the residual add before it) as one numba call: the CPU form of fused_small's norm kernels,
for decode and verify windows.

A one-token RMSNorm in the reference's torch ops is six ops (pow, mean, add, rsqrt, mul, mul); on the 2-core
VM each costs a few microseconds of dispatch for a row of a few hundred floats, so the embedded
strata-tiny-next's 15 norms a token (the layers' input and MoE norms, the attention's q / k heads, the final
norm) were ~20% of its decode. Here a row is one loop: its sum of squares in float64 (in index order, so a
row's result depends on that row alone: batch invariant), then x * r * w rounded to float32 as the reference
rounds it. The sum's order differs from torch's, so the bits differ at rounding level, as the CUDA kernels'
do; `ops.rms_norm_reference` is the twin.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from .fused_small import fused_call


@numba.njit(nogil=True, cache=True)
def _rms_norm_rows(x, d, w, eps, add, out, sums):
    """x, out f32 [R, n] (out may be x), w f32 [n], eps a float (rounded to float32, as the reference's).
    add: each row is x + d (d f32 [R, n]), written into sums f32 [R, n] before it is normed; else d and sums
    are unread."""
    R, n = x.shape
    for r in range(R):
        ss = 0.0  # float64: the rounding of a few thousand squares' sum stays below float32's
        for i in range(n):
            v = x[r, i] + d[r, i] if add else x[r, i]
            if add:
                sums[r, i] = v
            ss += np.float64(v) * np.float64(v)
        mean = np.float32(ss / n)
        inv = np.float32(1.0) / np.sqrt(mean + np.float32(eps))  # float32: the reference's rsqrt(mean + eps)
        for i in range(n):
            v = sums[r, i] if add else x[r, i]
            out[r, i] = (v * inv) * w[i]


def cpu_norm_serves(x: Tensor, w, n_tokens: int) -> bool:
    """Whether an RMSNorm of x (n_tokens tokens) takes the numba rows: a fused_small.fused_call (decode or
    verify window, STRATA_FUSED_DECODE not 0, no grad) on float32 CPU tensors, w the last dim's weights."""
    return (x.is_cpu and x.dtype == torch.float32 and isinstance(w, Tensor) and w.dtype == torch.float32
            and w.dim() == 1 and w.shape[0] == x.shape[-1] > 0 and not w.requires_grad
            and fused_call(x, n_tokens))


# The wrappers below are what a call costs beyond the kernel's ~1 us: a torch op's dispatch is ~1 us on the
# 2-core VM, so each tensor becomes an array once and is shaped by numpy, and outputs are numpy's, made in
# the input's shape (torch.empty_like + view + numpy: 3.4 us; a view of from_numpy's tensor to a torch.Size
# alone: ~8 us).


def _array(t: Tensor) -> np.ndarray:
    """t's memory as an array (contiguous first where it is strided; detached where it tracks grad)."""
    t = t if t.is_contiguous() else t.contiguous()
    return (t.detach() if t.requires_grad else t).numpy()


def rms_norm_cpu(x: Tensor, w: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """ops.rms_norm_reference over the last dim of x [..., n] (float32 CPU), into `out` (contiguous, x's
    shape) when given."""
    src = _array(x)  # x's shape
    if out is None:
        dest = np.empty_like(src)
        out = torch.from_numpy(dest)
    else:
        dest = _array(out)
    rows = src.reshape(-1, src.shape[-1])  # [R, n]
    flat = dest.reshape(rows.shape)
    _rms_norm_rows(rows, rows, _array(w), eps, False, flat, flat)
    return out


def add_rms_norm_cpu(h: Tensor, d: Tensor, w: Tensor, eps: float,
                     out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """ops.add_rms_norm's reference form on float32 CPU tensors: h, d [T, E] -> (h + d, rms_norm(h + d)),
    into `out` (two contiguous tensors of h's shape) when given. The sum is torch's h + d, bit for bit."""
    src_h, src_d = _array(h), _array(d)  # [T, E] each
    if out is None:
        sums, normed = np.empty_like(src_h), np.empty_like(src_h)
        out = (torch.from_numpy(sums), torch.from_numpy(normed))
    else:
        sums, normed = _array(out[0]), _array(out[1])
    _rms_norm_rows(src_h, src_d, _array(w), eps, True, normed, sums)
    return out


def warm_up() -> None:
    """Compile both forms (or load numba's cache of them) now, not at the first decode step."""
    x = torch.zeros(1, 8)
    rms_norm_cpu(x, torch.ones(8), 1e-6)
    add_rms_norm_cpu(x, x, torch.ones(8), 1e-6)
