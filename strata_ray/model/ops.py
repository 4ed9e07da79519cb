"""The small numeric functions of the reference forward pass, in plain float32 torch.

Each one is a replaceable unit: the fast kernels (GPU attention, GDN, expert matmuls) swap in behind these
signatures. Everything here is out-of-place and free of host syncs so the forward stays differentiable and
runs on any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from strata_ray.kernels.attention_decode import attention_decode, attention_decode_supports
from strata_ray.kernels.attention_decode_cpu import one_query_cpu, one_query_cpu_serves
from strata_ray.kernels.fused_small import (
    add_rms_norm_fused,
    fused_enabled,
    needs_grad,
    plain_f32,
    rms_norm_fused,
)
from strata_ray.kernels.fused_small_cpu import add_rms_norm_cpu, cpu_norm_serves, rms_norm_cpu

GDN_CHUNK = 64  # chunk length of the chunked delta rule; prompt chunks must be multiples of it
# chunks whose state-free part runs in one launch (always this many on a device: fixed shapes). 16 on CUDA
# (a 4096-token layer: ~600 launches instead of ~1,600); 4 on CPUs, where the bits are the same and 16 was
# 10-25% slower on the 2-core VM (session 9: T = 1024-4096, 4-16 heads)
GDN_GROUP = 16
GDN_GROUP_CPU = 4


def gdn_group(device: torch.device) -> int:
    return GDN_GROUP if device.type == "cuda" else GDN_GROUP_CPU


def linear(x: Tensor, w, out: Tensor | None = None) -> Tensor:
    """x [..., in] @ w[out, in]^T -> [..., out] (GGUF/torch nn.Linear convention, no bias). w: a float tensor,
    a Q8Weight (a Q8_0 matrix kept quantized: kernels/dense_q8), a ScaledWeight (a Q4_K / Q6_K one on
    CUDA: kernels/dense_scaled) or a BlockMatrix (a quantized matrix as its blocks on the CPU:
    kernels/dense_blocks). out: a tensor to write (a decode graph's fixed buffer), the same bits: the
    quantized GEMVs write it in place (dense_q8.linear_by_gemv), the other forms are copied there."""
    if isinstance(w, Tensor):
        y = F.linear(x, w)
        return y if out is None else out.copy_(y)
    from strata_ray.kernels.dense_q8 import Q8Weight, q8_linear

    if isinstance(w, Q8Weight):
        return q8_linear(x, w, out)
    from strata_ray.kernels.dense_blocks import BlockMatrix, block_linear

    if isinstance(w, BlockMatrix):
        y = block_linear(x, w)
        return y if out is None else out.copy_(y)
    from strata_ray.kernels.dense_scaled import scaled_linear

    return scaled_linear(x, w, out)


def linear_rows(x: Tensor, ws: Sequence) -> list[Tensor]:
    """[linear(x, w) for w in ws]. Quantized views of one matrix (weights.fuse_dense_rows) run as one GEMV
    in a decode step (kernels/dense_q8.fused_linear_rows): the matrices a layer applies to the same input."""
    from strata_ray.kernels.dense_q8 import QuantizedDense, fused_linear_rows

    if not all(isinstance(w, QuantizedDense) for w in ws):
        return [linear(x, w) for w in ws]
    return fused_linear_rows(x, ws, linear)


def embedding(ids: Tensor, w) -> Tensor:
    """Rows `ids` [...] of w [V, E] -> [..., E] float32 (a float tensor, a Q8Weight, a ScaledWeight or a
    BlockMatrix)."""
    if isinstance(w, Tensor):
        return F.embedding(ids, w)
    return w.rows(ids.reshape(-1)).view(*ids.shape, -1)


def rms_norm(x: Tensor, w: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """Plain RMSNorm over the last dim of x [T, ...]. GGUF weights already hold the +1 of zero-centred norms.

    On CUDA, calls of at most 16 tokens (decode, verify windows) run one fused kernel instead (its sum in
    another order: rounding-level differences, batch invariant among those calls). out: a tensor of x's
    shape to write into (the decode graphs' buffers: the fused kernel writes it without a copy). On the CPU
    those calls run one numba call instead of six torch ops (kernels/fused_small_cpu: rounding-level
    differences as well, batch invariant)."""
    if x.dim() >= 2 and fused_enabled(x, x.shape[0]) and plain_f32(x, w):
        return rms_norm_fused(x, w, eps, out=out)
    if x.dim() >= 2 and _cpu_norm(x, w, out):
        return rms_norm_cpu(x, w, eps, out=out)
    y = rms_norm_reference(x, w, eps)
    return y if out is None else out.copy_(y)


def add_rms_norm(h: Tensor, d: Tensor, w: Tensor, eps: float,
                 out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The residual add and the RMSNorm after it: h, d [T, E] -> (h + d, rms_norm(h + d)), into `out` (two
    tensors of h's shape: the decode graphs' buffers) when given. Where rms_norm takes its fused kernel
    (CUDA, decode and verify windows) one launch does both (kernels/fused_small.add_rms_norm_fused: the
    sum's bits, the fused norm's); on the CPU, one numba call (kernels/fused_small_cpu: the sum's bits
    too)."""
    if h.dim() == 2 and fused_enabled(h, h.shape[0]) and plain_f32(h, d, w):
        return add_rms_norm_fused(h, d, w, eps, out=out)
    if (h.dim() == 2 and d.shape == h.shape and d.dtype == torch.float32 and not needs_grad(d)
            and _cpu_norm(h, w, out[0] if out is not None else None)
            and (out is None or out[1].is_contiguous())):
        return add_rms_norm_cpu(h, d, w, eps, out=out)
    s = torch.add(h, d, out=out[0] if out is not None else None)
    return s, rms_norm(s, w, eps, out=out[1] if out is not None else None)


def _cpu_norm(x: Tensor, w, out: Tensor | None) -> bool:
    """Whether a norm of x [T, ...] takes kernels/fused_small_cpu (a CPU decode or verify window), out
    (when given) contiguous."""
    return cpu_norm_serves(x, w, x.shape[0]) and (out is None or out.is_contiguous())


def rms_norm_reference(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm in plain torch ops: the reference twin of kernels/fused_small.rms_norm_fused."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def gated_rms_norm(x: Tensor, z: Tensor, w: Tensor, eps: float) -> Tensor:
    """Gated norm of the GDN output: w * rmsnorm(x) * silu(z), per head over the last dim."""
    return rms_norm(x, w, eps) * F.silu(z)


def l2_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the fla / HF form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """down(silu(gate(x)) * up(x)): one expert or the shared expert."""
    g, u = linear_rows(x, (w_gate, w_up))
    return linear(F.silu(g) * u, w_down)


_INV_FREQ: dict[tuple[int, float, torch.device], Tensor] = {}  # rope frequencies, built once per device


def _inv_freq(n_rot: int, base: float, device: torch.device) -> Tensor:
    key = (n_rot, base, device)
    if key not in _INV_FREQ:
        exponents = torch.arange(0, n_rot, 2, dtype=torch.float32, device=device) / n_rot
        _INV_FREQ[key] = 1.0 / (base**exponents)
    return _INV_FREQ[key]


def rope_tables(pos: Tensor, n_rot: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin [T, 1, n_rot] of NEOX RoPE at pos [T] int64, in float32 exactly as transformers computes them.

    One pair serves every tensor rotated at these positions (q and k of a layer)."""
    freqs = pos.to(torch.float32)[:, None] * _inv_freq(n_rot, base, pos.device)  # [T, n_rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, n_rot]
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NEOX (rotate_half) RoPE with tables from rope_tables on the first n_rot dims of x [T, H, D]."""
    n_rot = cos.shape[-1]
    x_rot, x_pass = x[..., :n_rot], x[..., n_rot:]
    half = n_rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def rope_neox(x: Tensor, pos: Tensor, n_rot: int, base: float) -> Tensor:
    """NEOX (rotate_half) RoPE on the first n_rot dims of x [T, H, D]; dims n_rot.. pass through.

    pos [T] int64 absolute positions. Frequencies are computed in float32 exactly as transformers does.
    """
    return apply_rope(x, *rope_tables(pos, n_rot, base))


# Scores [H, T, S] materialised at once, at most (fp32: 64 MB). A longer prompt chunk runs in query blocks,
# so an 8192-token chunk at depth 8K needs ~0.2 GB of attention temporaries instead of ~13 GB (which a
# 24 GB card holding a cache does not have).
ATTENTION_MAX_SCORES = 1 << 24


def attention(q: Tensor, k: Tensor, v: Tensor, q_offset: int, scale: float,
              max_scores: int = ATTENTION_MAX_SCORES) -> Tensor:
    """Causal GQA attention.

    q [T, H, D] for absolute positions q_offset..q_offset+T-1; k, v [S, Hkv, D] for positions 0..S-1 (the KV
    cache including this step). Query head h reads kv head h // (H / Hkv). Returns [T, H, D].
    When H*T*S exceeds max_scores, queries run in blocks, each over the keys it can see (deterministic;
    the same values up to rounding as one block).
    """
    T, H, _ = q.shape
    S, Hkv, _ = k.shape
    # CUDA, decode / verify: the cache as stored
    if fused_enabled(q, T) and attention_decode_supports(q, k) and plain_f32(q, k, v):
        return attention_decode(q, k, v, q_offset, scale)
    sees_all = S <= q_offset + 1  # the first query sees every key: nothing to mask (a decode step)
    # CPU only: on CUDA (H200, cuBLAS) the products over Hkv batches gave other bits than over H batches
    if T == 1 and sees_all and q.device.type == "cpu":
        if one_query_cpu_serves(q, k, v):  # a decode token: one numba call (kernels/attention_decode_cpu)
            return one_query_cpu(q, k, v, scale)
        return attention_one_query(q, k, v, scale)
    rep = H // Hkv
    # [S, H, D] copies of k and v viewed [H, S, D]; a query block reads the first `seen` keys of them (the
    # same values and strides as copying k[:seen], so the same bits), copied once per call, not per block
    kh = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, S, D]
    vh = v.repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, S, D]
    if T > 1 and H * T * S > max_scores:
        qb = max(1, max_scores // (H * S))
        blocks = []
        for i in range(0, T, qb):
            seen = min(S, q_offset + min(T, i + qb))  # keys up to the block's last query
            blocks.append(_attention_heads(q[i : i + qb], kh[:, :seen], vh[:, :seen], q_offset + i, scale))
        return torch.cat(blocks)
    return _attention_heads(q, kh, vh, q_offset, scale)


def _attention_heads(q: Tensor, kh: Tensor, vh: Tensor, q_offset: int, scale: float) -> Tensor:
    """attention() of q [T, H, D] over keys and values already per query head, kh, vh [H, S, D]."""
    T, S = q.shape[0], kh.shape[1]
    sees_all = S <= q_offset + 1
    scores = torch.matmul(q.transpose(0, 1), kh.transpose(1, 2)) * scale  # [H, T, S]
    if not sees_all:
        q_pos = torch.arange(q_offset, q_offset + T, device=q.device)[:, None]
        k_pos = torch.arange(S, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vh).transpose(0, 1)  # [T, H, D]


def attention_one_query(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """attention() of one query q [1, H, D] that sees all of k, v [S, Hkv, D] (no mask) -> [1, H, D].

    Query heads j, j + rep, j + 2 rep, ... read kv heads 0, 1, 2, ...: one batched product per j over k and v
    as stored, instead of copying them rep times (repeat_interleave). Every head's products and softmax row
    have the shapes and operand layouts of attention()'s, so the result has the same bits.
    """
    _, H, D = q.shape
    rep = H // k.shape[1]
    qh = q.transpose(0, 1)  # [H, 1, D]
    kt = k.permute(1, 2, 0)  # [Hkv, D, S]
    vt = v.transpose(0, 1)  # [Hkv, S, D]
    outs = []
    for j in range(rep):
        scores = torch.matmul(qh[j::rep], kt) * scale  # [Hkv, 1, S]
        outs.append(torch.matmul(torch.softmax(scores, dim=-1), vt))  # [Hkv, 1, D]
    return torch.stack(outs, dim=1).reshape(1, H, D)  # head g * rep + j at [g, j]


def causal_conv1d(x: Tensor, w: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv (no bias) followed by SiLU.

    x [T, C] new inputs, w [C, K] (ssm_conv1d), state [K-1, C] the previous K-1 raw inputs (zeros at start).
    y[t, c] = silu(sum_j w[c, j] * xp[t + j, c]) with xp = cat(state, x).
    Returns (y [T, C], new state [K-1, C]).
    """
    K = w.shape[1]
    if x.shape[0] == 0:  # no new inputs: unfold needs at least K rows; the state stays as it is
        return x, state
    xp = torch.cat((state, x), dim=0)  # [T+K-1, C]
    windows = xp.unfold(0, K, 1)  # [T, C, K]
    y = (windows * w).sum(-1)
    return F.silu(y), xp[xp.shape[0] - (K - 1) :]


def gdn_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor
) -> tuple[Tensor, Tensor]:
    """Gated delta rule, one token at a time.

    q, k [T, H, dk] (already l2-normalised, q scaled by dk^-0.5, expanded to the H value heads), v [T, H, dv],
    g [T, H] log decay (<= 0), beta [T, H], S [H, dk, dv] incoming state. Returns (o [T, H, dv], S).
    """
    H, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    outs = []
    T = q.shape[0]
    for t in range(T):
        # one token: the tensors are its own (reshaped below, no per-token select)
        q_t, k_t, v_t, g_t, beta_t = (q, k, v, g, beta) if T == 1 else (q[t], k[t], v[t], g[t], beta[t])
        k_t = k_t.reshape(H, dk, 1)
        S = S * g_t.exp().reshape(H, 1, 1)
        u = (v_t.reshape(H, dv, 1) - state_read(S, k_t)) * beta_t.reshape(H, 1, 1)  # delta-rule correction
        S = S + k_t * u.reshape(H, 1, dv)
        outs.append(state_read(S, q_t.reshape(H, dk, 1)))  # [H, dv, 1]
    if len(outs) == 1:  # a decode step: no stack
        return outs[0].reshape(1, H, dv), S
    o = torch.stack(outs).reshape(-1, H, dv) if outs else v.new_zeros(v.shape)
    return o, S


def state_read(S: Tensor, x: Tensor) -> Tensor:
    """S [H, dk, dv], x [H, dk, 1] -> [H, dv, 1]: einsum("hkv,hk->hv", S, x) as the very bmm einsum runs
    (same operands and strides, so the same bits) without einsum's equation parsing and permutes."""
    return torch.bmm(S.transpose(1, 2), x)


def _gdn_group(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """The state-free part of the WY-form delta rule for a group of chunks: q, k [H, N, C, dk],
    v [H, N, C, dv], g, beta [H, N, C] -> (U [H, N, C, dv], W [H, N, C, dk], Qg [H, N, C, dk], A [H, N, C, C],
    Kd [H, N, dk, C], decay [H, N, 1, 1]), for _gdn_chunk_step."""
    C = q.shape[2]
    G = g.cumsum(-1)  # [H, N, C]
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, N, C, C] e^(Gi-Gj)
    # WY representation: U = (I + L)^-1 (beta v), W = (I + L)^-1 (beta k exp(G)), L strictly lower; the solve
    # reads only the strict lower triangle (unitriangular), so L keeps its diagonal here.
    L = (beta[..., None] * k) @ k.transpose(-1, -2) * D  # [H, N, C, C]
    rhs = torch.cat((beta[..., None] * v, beta[..., None] * k * G.exp()[..., None]), dim=-1)
    UW = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    U, W = UW[..., : v.shape[-1]], UW[..., v.shape[-1] :]
    G_last = G[..., -1:]  # [H, N, 1]
    Qg = q * G.exp()[..., None]
    A = q @ k.transpose(-1, -2) * D  # [H, N, C, C]
    Kd = (k * (G_last - G).exp()[..., None]).transpose(-1, -2)  # [H, N, dk, C]
    return U, W, Qg, A, Kd, G_last.exp()[..., None]


def _gdn_chunk_step(U: Tensor, W: Tensor, Qg: Tensor, A: Tensor, Kd: Tensor, decay: Tensor,
                    S: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk's state-dependent part (the tensors of _gdn_group at one chunk, S [H, dk, dv]) -> (o, S)."""
    V_new = U - W @ S  # [H, C, dv]
    o = Qg @ S + A @ V_new
    return o, S * decay + Kd @ V_new


def gdn_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, chunk: int = GDN_CHUNK
) -> tuple[Tensor, Tensor]:
    """Gated delta rule in chunks of `chunk` tokens (same arguments and result as gdn_recurrent).

    Chunks start at token 0 of this call; the tail is padded with identity steps (g = 0, beta = 0, k = 0),
    which change neither the state nor the earlier outputs. What does not depend on the state (the WY solve,
    the decays, the intra-chunk products) runs for gdn_group(device) chunks at once, always in groups of
    exactly that many (padded with identity chunks), so every launch has one shape and a chunk's result does
    not depend on how many chunks share the call; then the state passes through the chunks in order, four
    products each (a 4096-token prompt: ~600 launches a layer instead of ~1,600).
    """
    T = q.shape[0]
    group = gdn_group(q.device)
    n = -(-T // chunk)  # chunks holding tokens
    n_pad = -(-n // group) * group
    pad = n_pad * chunk - T
    H = q.shape[1]

    def grouped(x: Tensor) -> Tensor:  # [T, H, ...] -> [groups, H, group, chunk, ...], contiguous
        x = x.movedim(0, 1)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        x = x.reshape(H, n_pad // group, group, chunk, *x.shape[2:])
        return x.movedim(1, 0).contiguous()

    if T == 0:
        return v, S
    q, k, v, g, beta = (grouped(x) for x in (q, k, v, g, beta))
    outs = []
    for gi in range(q.shape[0]):
        parts = _gdn_group(q[gi], k[gi], v[gi], g[gi], beta[gi])
        for c in range(min(group, n - gi * group)):
            o, S = _gdn_chunk_step(*(t[:, c] for t in parts), S)
            outs.append(o)
    o = torch.cat(outs, dim=1)[:, :T]  # [H, T, dv]
    return o.movedim(1, 0), S
