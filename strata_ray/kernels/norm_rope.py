"""An attention layer's q / k head norms and rotary embedding in one launch (decode and verify windows).

After the q | k | v projection, attention_inputs ran ~16 small torch ops on a decode token: a copy of q
out of the gated projection's [q | gate] rows, two RMSNorms over heads, rotate_half's slices, negation and
concatenations, three multiplies and an add for each of q and k, and a copy of the gate. In a captured
decode graph each is a kernel of its own (~2 us on the H200, mostly launch and ramp), 12 attention layers a
token. Here one program takes one head of one token: it norms the head (the fused RMSNorm's formula, its
sum in the kernel's own order), rotates its first n_rot values with the caller's cos / sin tables (NEOX
rotate_half: the very multiply, multiply, add of ops.apply_rope, without FMA contraction), writes q or k
contiguous, and for a gated query head (qwen3next) its gate half too.

The partner value of rotate_half (i + n_rot/2 or i - n_rot/2) is normed a second time from its own load:
the same operations on the same inputs, so the same bits as the value at its place. The reference twin is
the torch composition (`norm_rope_reference`); the norm's sum order differs, so the two agree to rounding,
and calls of at most FUSED_MAX_TOKENS tokens stay batch invariant among themselves (one program a head).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .lazy_triton import jit_bodies
from .pdl import pdl_args

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch

_OPTS = dict(enable_fp_fusion=False)  # apply_rope's roundings: a multiply, a multiply, an add


def norm_rope_supported(head_dim: int, n_rot: int) -> bool:
    """Head sizes the kernel takes: a power of two >= 16, rotating an even number of its values."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and rotates(head_dim, n_rot)


def _norm_rope_body(QG, KS, WQ, WK, COS, SIN, QO, KO, GO, H, Hkv, q_tok, q_head, k_tok, eps,
                    D: tl.constexpr, N_ROT: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    # QG f32 [T, rows]: token t's query head j at QG + t q_tok + j q_head (its gate D values after it when
    # GATED); KS f32: kv head g at KS + t k_tok + g D; WQ, WK f32 [D]; COS, SIN f32 [T, N_ROT]; QO [T, H, D],
    # KO [T, Hkv, D], GO [T, H D] contiguous. Program (token, head): heads 0..H-1 query, then the kv heads.
    if PDL:  # it starts early, then waits for the kernel before (kernels/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    i = tl.arange(0, D)
    rot = i < N_ROT
    partner = tl.where(i < N_ROT // 2, i + N_ROT // 2, i - N_ROT // 2)  # rotate_half's source, i < N_ROT
    if j < H:
        src = QG + t * q_tok + j * q_head
        w = WQ
        dst = QO + (t * H + j) * D
    else:
        src = KS + t * k_tok + (j - H) * D
        w = WK
        dst = KO + (t * Hkv + (j - H)) * D
    x = tl.load(src + i)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)  # the fused RMSNorm's formula
    y = x * r * tl.load(w + i)
    yp = tl.load(src + partner, mask=rot, other=0.0) * r * tl.load(w + partner, mask=rot, other=0.0)
    c = tl.load(COS + t * N_ROT + i, mask=rot, other=0.0)
    s = tl.load(SIN + t * N_ROT + i, mask=rot, other=0.0)
    turned = tl.where(i < N_ROT // 2, -yp, yp)
    tl.store(dst + i, tl.where(rot, y * c + turned * s, y))
    if GATED:
        if j < H:
            tl.store(GO + (t * H + j) * D + i, tl.load(src + D + i))


@functools.cache
def _kernels():
    return jit_bodies(_norm_rope_body)


def rotates(head_dim: int, n_rot: int) -> bool:
    """Whether a head of head_dim values rotates n_rot of them (an even count, at most head_dim)."""
    return 0 < n_rot <= head_dim and n_rot % 2 == 0


def check_inputs(qg: Tensor, k: Tensor, wq: Tensor, wk: Tensor, cos: Tensor, sin: Tensor,
                 any_head_dim: bool = False) -> tuple[int, bool]:
    """(D, gated) of the inputs, or ValueError (one line). any_head_dim: the CPU form's rule (kernels/
    fused_small_cpu), which takes heads of any size; the Triton kernel's are powers of two from 16."""
    T, H, QD = qg.shape
    D = wq.shape[0]
    n_rot = cos.shape[-1]
    fits = rotates(D, n_rot) if any_head_dim else norm_rope_supported(D, n_rot)
    ok = (QD in (D, 2 * D) and k.dim() == 3 and k.shape[0] == T and k.shape[2] == D and wk.shape == (D,)
          and cos.shape == sin.shape == (T, 1, n_rot) and fits
          and all(x.dtype == torch.float32 for x in (qg, k, wq, wk, cos, sin)))
    if not ok:
        rule = "even n_rot <= D" if any_head_dim else "D a power of two, even n_rot"
        raise ValueError(f"norm_rope: qg {list(qg.shape)}, k {list(k.shape)}, weights {list(wq.shape)} "
                         f"{list(wk.shape)}, cos {list(cos.shape)} (float32; {rule})")
    return D, QD == 2 * D


def norm_rope_reference(qg: Tensor, k: Tensor, wq: Tensor, wk: Tensor, eps: float, cos: Tensor,
                        sin: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """qg [T, H, D or 2D] (per head q, or q then its gate), k [T, Hkv, D], head norm weights wq, wk [D],
    cos / sin [T, 1, n_rot] (ops.rope_tables) -> normed and rotated q [T, H, D], k [T, Hkv, D], and the
    gate [T, H D] (None without): attention_inputs' torch ops, with the fused kernel's RMSNorm formula."""
    from strata_ray.model import ops

    D, gated = check_inputs(qg, k, wq, wk, cos, sin, any_head_dim=True)  # torch ops: any head size
    T, H = qg.shape[:2]
    norm = ops.rms_norm_reference
    q = ops.apply_rope(norm(qg[..., :D], wq, eps), cos, sin)
    kk = ops.apply_rope(norm(k, wk, eps), cos, sin)
    return q, kk, qg[..., D:].reshape(T, H * D) if gated else None


def norm_rope_fused(qg: Tensor, k: Tensor, wq: Tensor, wk: Tensor, eps: float, cos: Tensor,
                    sin: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """norm_rope_reference in one launch (CUDA-graph capturable). qg and k may be views of a wider
    projection output (each token's row strided, a head's values contiguous)."""
    D, gated = check_inputs(qg, k, wq, wk, cos, sin)
    T, H, _ = qg.shape
    Hkv = k.shape[1]
    if qg.stride(2) != 1 or qg.stride(1) != qg.shape[2] or k.stride(2) != 1 or k.stride(1) != D:
        raise ValueError("norm_rope_fused: each head's values must be contiguous")
    q_out = torch.empty((T, H, D), dtype=torch.float32, device=qg.device)
    k_out = torch.empty((T, Hkv, D), dtype=torch.float32, device=qg.device)
    gate = torch.empty((T, H * D), dtype=torch.float32, device=qg.device) if gated else None
    if T:
        tables = cos.contiguous(), sin.contiguous()  # [T, 1, n_rot]
        _kernels()[0][(T, H + Hkv)](qg, k, wq.contiguous(), wk.contiguous(), *tables, q_out, k_out,
                                    gate if gated else q_out, H, Hkv, qg.stride(0), qg.stride(1), k.stride(0),
                                    eps, D=D, N_ROT=cos.shape[-1], GATED=gated, num_warps=4, **_OPTS,
                                    **pdl_args(q_out))
    return q_out, k_out, gate
