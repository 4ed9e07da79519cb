"""The decode step's short elementwise chains as one numba call each: the CPU twins of fused_small's kernels,
for decode and verify windows (fused_small.fused_call: at most FUSED_MAX_TOKENS tokens, no grad).

On the 2-core VM a torch op costs a few microseconds of dispatch whatever its size, and a one-token layer of
the embedded strata-tiny-next is mostly such ops. Three chains run in every layer:

- RMSNorm: six ops (pow, mean, add, rsqrt, mul, mul); 15 norms a token (the layers' input and MoE norms,
  the attention's q / k heads, the final norm) were ~20% of its decode. `rms_norm_cpu` and
  `add_rms_norm_cpu` (the residual add before the MoE's norm, its sum torch's bit for bit): a row is one
  loop, its sum of squares in float64 in index order (so a row's result depends on that row alone: batch
  invariant), then x * r * w rounded to float32 as the reference rounds it. The sum's order differs from
  torch's, so the bits differ at rounding level, as the CUDA kernels' do; `ops.rms_norm_reference` is the
  twin.
- the shared expert's activation, silu(g) * u * sigmoid(x . w_gate) (five ops): `shared_act_cpu`, the gate's
  dot in float64 in index order; `fused_small.shared_act_reference` is the twin.
- an attention layer's q / k head norms and rotary embedding (~16 ops, the CUDA form's kernels/norm_rope):
  `norm_rope_cpu`, each head normed as `rms_norm_cpu` norms a row, then rotate_half's multiply, multiply and
  add as ops.apply_rope rounds them (numba contracts no multiply-add into an FMA); the gate half of a gated
  query copied out. `norm_rope.norm_rope_reference` is the twin.

And one chain of the MoE block: the weighted sum of a token's k expert rows (moe.combine_rows, 2k numpy ops,
~28 us a layer), `combine_rows_cpu`: the same products and sums in k order, each rounded to float32 as the
numpy ops round them, so the same bits (the arithmetic contract's combine: placement must not change them).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from .fused_small import fused_call, needs_grad


@numba.njit(nogil=True, inline="always")
def _norm_row(src, w, eps, dest):
    """dest[:n] = rms_norm(src[:n]) * w for n = w's length (src may hold more: a gated head's q half), eps a
    float (rounded to float32, as the reference's). dest may be src."""
    n = w.shape[0]
    ss = 0.0  # float64, in index order: the rounding of a few thousand squares' sum stays below float32's
    for i in range(n):
        ss += np.float64(src[i]) * np.float64(src[i])
    inv = np.float32(1.0) / np.sqrt(np.float32(ss / n) + np.float32(eps))  # the reference's rsqrt(mean + eps)
    for i in range(n):
        dest[i] = (src[i] * inv) * w[i]


@numba.njit(nogil=True, inline="always")
def dot_lanes(a, b):
    """a . b (f32 [n] each) as 8 float32 lanes (lane j: the values j, j + 8, ... in order; the tail's in
    lane 0 .. n % 8 - 1) added in a fixed tree: one order, which the compiler packs into a vector (a dot in
    index order does not vectorize). The attention core's scores and the router's logits."""
    n = a.shape[0]
    n8 = n - n % 8
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for i in range(0, n8, 8):
        a0 += a[i] * b[i]
        a1 += a[i + 1] * b[i + 1]
        a2 += a[i + 2] * b[i + 2]
        a3 += a[i + 3] * b[i + 3]
        a4 += a[i + 4] * b[i + 4]
        a5 += a[i + 5] * b[i + 5]
        a6 += a[i + 6] * b[i + 6]
        a7 += a[i + 7] * b[i + 7]
    for i in range(n8, n):
        a0 += a[i] * b[i]
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@numba.njit(nogil=True, cache=True)
def _rms_norm_rows(x, d, w, eps, add, out, sums):
    """x, out f32 [R, n] (out may be x), w f32 [n], eps a float. add: each row is x + d (d f32 [R, n]),
    written into sums f32 [R, n] before it is normed; else d and sums are unread."""
    R, n = x.shape
    for r in range(R):
        if add:
            for i in range(n):
                sums[r, i] = x[r, i] + d[r, i]
            _norm_row(sums[r], w, eps, out[r])
        else:
            _norm_row(x[r], w, eps, out[r])


@numba.njit(nogil=True, cache=True)
def _shared_act_rows(g, u, x, w_gate, out):
    """g, u f32 [N, F] (rows may be strided), x f32 [N, E], w_gate f32 [E] -> out f32 [N, F]."""
    N, F = g.shape
    one = np.float32(1.0)
    for t in range(N):
        dot = 0.0  # float64, in index order: the token's gate logit
        for e in range(x.shape[1]):
            dot += np.float64(x[t, e]) * np.float64(w_gate[e])
        gate = one / (one + np.exp(-np.float32(dot)))
        for f in range(F):
            gf = g[t, f]
            out[t, f] = (gf / (one + np.exp(-gf))) * u[t, f] * gate  # silu(g) * u * sigmoid, as the reference


@numba.njit(nogil=True, cache=True)
def _norm_rope_heads(qg, k, wq, wk, eps, cos, sin, gated, q_out, k_out, gate):
    """qg f32 [T, H, D or 2D] (per head q, then its gate where gated), k f32 [T, Hkv, D] (each head's values
    contiguous; tokens may be strided), wq / wk f32 [D], cos / sin f32 [T, n_rot] -> q_out [T, H, D], k_out
    [T, Hkv, D], gate [T, H D] (unwritten unless gated)."""
    T, H = qg.shape[0], qg.shape[1]
    Hkv, D = k.shape[1], k.shape[2]
    n_rot = cos.shape[1]
    half = n_rot // 2
    normed = np.empty(D, np.float32)
    for t in range(T):
        for j in range(H + Hkv):
            src = qg[t, j] if j < H else k[t, j - H]  # [D or 2D]
            dest = q_out[t, j] if j < H else k_out[t, j - H]
            _norm_row(src, wq if j < H else wk, eps, normed)  # the head's first D values
            for i in range(n_rot):  # rotate_half: [-x2, x1] beside x; x * cos + rotated * sin
                rotated = -normed[i + half] if i < half else normed[i - half]
                dest[i] = normed[i] * cos[t, i] + rotated * sin[t, i]
            for i in range(n_rot, D):
                dest[i] = normed[i]
            if gated and j < H:
                for i in range(D):
                    gate[t, j * D + i] = src[D + i]


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


def as_array(t: Tensor, rows: bool = False) -> np.ndarray:
    """t's memory as an array (detached where it tracks grad): contiguous first where it is strided, or with
    rows, where its last dim is (a view of some rows of a wider product stays a view)."""
    if not (t.is_contiguous() or rows and t.stride(-1) == 1):
        t = t.contiguous()
    return (t.detach() if t.requires_grad else t).numpy()


def rms_norm_cpu(x: Tensor, w: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """ops.rms_norm_reference over the last dim of x [..., n] (float32 CPU), into `out` (contiguous, x's
    shape) when given."""
    src = as_array(x)  # x's shape
    if out is None:
        dest = np.empty_like(src)
        out = torch.from_numpy(dest)
    else:
        dest = as_array(out)
    rows = src.reshape(-1, src.shape[-1])  # [R, n]
    flat = dest.reshape(rows.shape)
    _rms_norm_rows(rows, rows, as_array(w), eps, False, flat, flat)
    return out


@numba.njit(nogil=True, cache=True)
def _combine_rows(r, w, out):
    """r f32 [N, K, E], w f32 [N, K] -> out f32 [N, E]: r[:, 0] w[:, 0], then + r[:, k] w[:, k] for k = 1..K-1
    in order (float32 products and sums, as numpy's ops)."""
    N, K, E = r.shape
    for n in range(N):
        w0 = w[n, 0]
        for e in range(E):
            out[n, e] = r[n, 0, e] * w0
        for k in range(1, K):
            wk = w[n, k]
            for e in range(E):
                out[n, e] = out[n, e] + r[n, k, e] * wk


def combine_cpu_serves(rows: Tensor, weights: Tensor) -> bool:
    """Whether moe.combine_rows of rows [N, K, E] takes _combine_rows: a fused_call (decode or verify window)
    on contiguous float32 CPU tensors, none tracked by autograd, K >= 1."""
    return (rows.is_cpu and rows.dtype == weights.dtype == torch.float32 and rows.dim() == 3
            and rows.shape[1] > 0 and weights.shape == rows.shape[:2] and rows.is_contiguous()
            and weights.is_contiguous() and not needs_grad(weights) and fused_call(rows, rows.shape[0]))


def combine_rows_cpu(rows: Tensor, weights: Tensor) -> Tensor:
    """moe.combine_rows' bits on contiguous float32 CPU tensors: rows [N, K, E], weights [N, K] -> [N, E]."""
    r = rows.numpy()  # [N, K, E]
    out = np.empty((r.shape[0], r.shape[2]), np.float32)
    _combine_rows(r, weights.numpy(), out)
    return torch.from_numpy(out)


def add_rms_norm_cpu(h: Tensor, d: Tensor, w: Tensor, eps: float,
                     out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """ops.add_rms_norm's reference form on float32 CPU tensors: h, d [T, E] -> (h + d, rms_norm(h + d)),
    into `out` (two contiguous tensors of h's shape) when given. The sum is torch's h + d, bit for bit."""
    src_h, src_d = as_array(h), as_array(d)  # [T, E] each
    if out is None:
        sums, normed = np.empty_like(src_h), np.empty_like(src_h)
        out = (torch.from_numpy(sums), torch.from_numpy(normed))
    else:
        sums, normed = as_array(out[0]), as_array(out[1])
    _rms_norm_rows(src_h, src_d, as_array(w), eps, True, normed, sums)
    return out


def shared_act_cpu_serves(x: Tensor, w_gate, n_tokens: int) -> bool:
    """Whether the shared expert's activation of x [N, E] takes _shared_act_rows: a fused_call on float32 CPU
    tensors, w_gate's E values float32."""
    return (x.is_cpu and x.dtype == torch.float32 and isinstance(w_gate, Tensor)
            and w_gate.dtype == torch.float32 and w_gate.numel() == x.shape[-1] and not w_gate.requires_grad
            and fused_call(x, n_tokens))


def shared_act_cpu(g: Tensor, u: Tensor, x: Tensor, w_gate: Tensor) -> Tensor:
    """fused_small.shared_act_reference on float32 CPU tensors: g, u [N, F] (views of one product's rows may
    be row-strided), x [N, E], w_gate [E] (any shape of E values) -> [N, F] contiguous."""
    n, f = g.shape
    if u.shape != g.shape or x.shape != (n, w_gate.numel()):
        raise ValueError(f"shared_act_cpu: g {list(g.shape)}, u {list(u.shape)}, x {list(x.shape)}, w_gate "
                         f"{list(w_gate.shape)}")
    out = np.empty((n, f), np.float32)
    rows = as_array(g, rows=True), as_array(u, rows=True)  # [N, F] each
    _shared_act_rows(*rows, as_array(x), as_array(w_gate).reshape(-1), out)
    return torch.from_numpy(out)


def norm_rope_cpu_serves(x: Tensor, n_tokens: int) -> bool:
    """Whether an attention layer's inputs for x (n_tokens tokens) take _norm_rope_heads: a fused_call on
    float32 CPU tensors."""
    return x.is_cpu and x.dtype == torch.float32 and fused_call(x, n_tokens)


def norm_rope_cpu(qg: Tensor, k: Tensor, wq: Tensor, wk: Tensor, eps: float, cos: Tensor,
                  sin: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """norm_rope_reference on float32 CPU tensors: qg [T, H, D or 2D], k [T, Hkv, D] (views of a projection's
    rows may be token-strided), wq / wk [D], cos / sin [T, 1, n_rot] -> q [T, H, D], k [T, Hkv, D], gate
    [T, H D] or None."""
    from .norm_rope import check_inputs

    D, gated = check_inputs(qg, k, wq, wk, cos, sin, any_head_dim=True)
    T, H = qg.shape[:2]
    q_out = np.empty((T, H, D), np.float32)
    k_out = np.empty((T, k.shape[1], D), np.float32)
    gate = np.empty((T, H * D if gated else 0), np.float32)
    n_rot = cos.shape[-1]
    heads = as_array(qg, rows=True), as_array(k, rows=True)  # [T, H, D or 2D], [T, Hkv, D]
    tables = as_array(cos).reshape(T, n_rot), as_array(sin).reshape(T, n_rot)
    _norm_rope_heads(*heads, as_array(wq), as_array(wk), eps, *tables, gated, q_out, k_out, gate)
    return torch.from_numpy(q_out), torch.from_numpy(k_out), torch.from_numpy(gate) if gated else None


def warm_up() -> None:
    """Compile every kernel here (or load numba's cache of them) now, not at the first decode step."""
    x = torch.zeros(1, 8)
    rms_norm_cpu(x, torch.ones(8), 1e-6)
    add_rms_norm_cpu(x, x, torch.ones(8), 1e-6)
    # two tokens: views of one product whose rows are strided (a single row's view is contiguous to numpy,
    # and would compile the plain signature again), as a verify window's or a short prompt's calls make them
    x2 = torch.zeros(2, 8)
    combine_rows_cpu(torch.zeros(2, 3, 8), torch.zeros(2, 3))
    gu = torch.zeros(2, 16)  # gate and up as views of one product, as the shared expert makes them
    shared_act_cpu(gu[:, :8], gu[:, 8:], x2, torch.zeros(8))
    shared_act_cpu(x, x, x, torch.zeros(8))
    for T in (1, 2):
        tables = torch.ones(T, 1, 16), torch.zeros(T, 1, 16)
        weights = torch.ones(16), torch.ones(16)
        norm_rope_cpu(torch.zeros(T, 2, 32), torch.zeros(T, 1, 16), *weights, 1e-6, *tables)
        qkv = torch.zeros(T, 96)  # q (+ gate), k as views of one projection (a fused attn_qkv)
        norm_rope_cpu(qkv[:, :64].view(T, 2, 32), qkv[:, 64:80].view(T, 1, 16), *weights, 1e-6, *tables)
