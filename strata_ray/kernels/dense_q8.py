"""Dense Q8_0 weights kept quantized on their device, and their linear (DESIGN section 7, batch invariance
of the dense path).

A GGUF Q8_0 matrix [N, K] is N * K / 32 blocks of 34 bytes (fp16 d, then 32 int8 codes q; the value is
float32(d) * float32(q)). `Q8Weight` keeps it as two tensors, `qs` int8 [N, K] and `d` float16
[N, K / 32]: 1.06 bytes a weight instead of the 4 of a float32 copy, in memory and in the bytes a
decode token reads.

`q8_linear(x, w)`:
- CPU: `F.linear(x, w.dequantize())`, the reference forward's bits.
- CUDA, at most GEMV_MAX_TOKENS rows: a GEMV reading qs and d straight, batch invariant (a token's row goes
  through the same operations whether 1 or 16 tokens share the launch, bit for bit). Where cupy is installed
  the CUDA C kernel of dense_q8_cuda (STRATA_DENSE_CUDA=0 turns it off), else the Triton kernel below: one
  program computes BN output rows of ONE token over the whole of K, with tiles chosen from (N, K) alone;
  the token is the fastest grid axis, so the programs of one row block run side by side and read the same
  weight bytes, from L2 after the first. The two forms round differently (each its own fixed order).
- CUDA, more rows (a prompt chunk: compute-bound): `F.linear(x, w.dequantize())` through cuBLAS.

Triton is imported only on the GPU path (CI and CPU machines have none): the kernel body is a plain
function that `_kernel()` hands to `triton.jit` on first use, after binding the module global `tl`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .dense_q8_cuda import cuda_gemv_on, launch_cuda_gemv
from .lazy_triton import jit_bodies
from .tile_plan import next_pow2

QK = 32  # elements of a Q8_0 block
BLOCK_BYTES = 34  # fp16 d + 32 int8
GEMV_MAX_TOKENS = 16  # rows up to which CUDA runs the GEMV (decode, MTP verify windows)
DEQUANT_CHUNK_BYTES = 256 << 20  # float32 weight rows dequantized at once past GEMV_MAX_TOKENS

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


class QuantizedDense:
    """What the quantized dense weights (Q8Weight, dense_scaled.ScaledWeight) share: int8 codes `qs` [N, K]
    with their scales on one device (`parts`, row by row), and `dequantize`."""

    qs: Tensor
    fused: tuple | None = None  # (the matrix this one's rows are part of, first row): fuse_rows' views

    def parts(self) -> tuple:
        """The per-row tensors the weight is made of, in its constructor's order (fuse_rows concatenates
        them)."""
        raise NotImplementedError

    def _map(self, fn: Callable[[Tensor], Tensor]):
        """A weight of the same kind made of fn(part) for each of its parts (absent ones stay None)."""
        return type(self)(*(fn(p) if p is not None else None for p in self.parts()))

    def row_slice(self, r0: int, r1: int):
        """Rows r0..r1 as a weight of the same kind made of views."""
        return self._map(lambda p: p[r0:r1])

    def gather(self, flat: Tensor):
        """Rows flat [M] (int64, on the weight's device) as a weight of the same kind made of copies."""
        return self._map(lambda p: p.index_select(0, flat))

    def to(self, device: torch.device | str):
        return self._map(lambda p: p.to(device))

    @property
    def shape(self) -> torch.Size:
        return self.qs.shape

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def rows(self, idx: Tensor | Sequence[int]) -> Tensor:
        """Dequantized rows float32 [*idx.shape, K] (an embedding lookup): no host sync, no full copy; the
        gathered rows' own dequantize, so the bits of the whole matrix's."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.device)
        return self.gather(idx.reshape(-1)).dequantize().reshape(*idx.shape, self.shape[1])


class Q8Weight(QuantizedDense):
    """A Q8_0 matrix [N, K] as `qs` int8 [N, K] and `d` float16 [N, K // 32] on one device."""

    def __init__(self, qs: Tensor, d: Tensor):
        if qs.dtype != torch.int8 or qs.dim() != 2:
            raise ValueError(f"Q8Weight qs must be int8 [N, K], got {qs.dtype} {list(qs.shape)}")
        n, k = qs.shape
        if n == 0 or k == 0 or k % QK:
            raise ValueError(f"Q8Weight shape [{n}, {k}]: N must be > 0 and K a positive multiple of {QK}")
        if d.dtype != torch.float16 or tuple(d.shape) != (n, k // QK):
            raise ValueError(f"Q8Weight d must be float16 [{n}, {k // QK}], got {d.dtype} {list(d.shape)}")
        if qs.device != d.device:
            raise ValueError(f"Q8Weight qs on {qs.device} but d on {d.device}")
        self.qs = qs.contiguous()  # [N, K]
        self.d = d.contiguous()  # [N, K // 32]

    @classmethod
    def from_blocks(cls, raw: np.ndarray | Tensor, n_rows: int, n_cols: int,
                    device: torch.device | str = "cpu") -> Q8Weight:
        """GGUF Q8_0 bytes (uint8 [N, K // 32 * 34] or flat) -> Q8Weight on `device`.

        A numpy array (a read-only file map included) is split on the host; a tensor is split where it
        lies, then moved."""
        if n_cols <= 0 or n_cols % QK or n_rows <= 0:
            raise ValueError(f"Q8_0 matrix [{n_rows}, {n_cols}]: N must be > 0, K a multiple of {QK} > 0")
        nb = n_cols // QK
        want = n_rows * nb * BLOCK_BYTES
        is_np = isinstance(raw, np.ndarray)
        size = raw.size if is_np else raw.numel()
        if raw.dtype != (np.uint8 if is_np else torch.uint8) or size != want:
            raise ValueError(f"Q8_0 [{n_rows}, {n_cols}] needs {want} uint8 bytes, got {size} of {raw.dtype}")
        if is_np:
            blocks = raw.reshape(n_rows, nb, BLOCK_BYTES)
            # copies: owned, writable arrays (a file map stays untouched)
            d = torch.from_numpy(np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(n_rows, nb))
            qs = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n_rows, -1))
        else:
            blocks = raw.reshape(n_rows, nb, BLOCK_BYTES)
            d = blocks[:, :, :2].contiguous().view(torch.float16).reshape(n_rows, nb)
            qs = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n_rows, n_cols)
        return cls(qs.to(device), d.to(device))

    @property
    def nbytes(self) -> int:
        """Bytes held (qs + d): what a GEMV reads per token."""
        return self.qs.numel() + 2 * self.d.numel()

    def dequantize(self, r0: int = 0, r1: int | None = None) -> Tensor:
        """float32 rows r0..r1 (all by default) [n, K], equal bit for bit to quants.dequantize / gguf: one
        rounding, f32(d) * f32(q)."""
        qs, d = self.qs[r0:r1], self.d[r0:r1]
        n, k = qs.shape
        q = qs.view(n, k // QK, QK).to(torch.float32)  # [n, K/32, 32] exact
        return (q * d.to(torch.float32)[:, :, None]).reshape(n, k)

    def parts(self) -> tuple:
        return self.qs, self.d

    def __repr__(self) -> str:
        return f"Q8Weight({list(self.shape)}, device={self.device})"


def fuse_rows(weights: Sequence[QuantizedDense]) -> list[QuantizedDense]:
    """Matrices of one width and kind that a layer applies to the same input (the GDN's q k v | z | b a, the
    shared expert's gate | up) -> views of one matrix holding their rows in order: the same bytes, stored
    once, and `fused_linear_rows` over the views is one GEMV launch instead of one per matrix."""
    k, kind = weights[0].shape[1], [p is None for p in weights[0].parts()]
    if any(w.shape[1] != k or w.device != weights[0].device or type(w) is not type(weights[0])
           or [p is None for p in w.parts()] != kind for w in weights):
        raise ValueError("fuse_rows: the matrices must share their width, kind and device")
    columns = zip(*(w.parts() for w in weights), strict=True)
    whole = type(weights[0])(*(torch.cat(col) if col[0] is not None else None for col in columns))
    views, r0 = [], 0
    for w in weights:
        n = w.shape[0]
        view = whole.row_slice(r0, r0 + n)  # contiguous row slices: views
        view.fused = (whole, r0)
        views.append(view)
        r0 += n
    return views


def fused_linear_rows(x: Tensor, weights: Sequence[QuantizedDense], linear) -> list[Tensor]:
    """[linear(x, w) for w in weights]; on CUDA at most GEMV_MAX_TOKENS tokens, views that fuse_rows made
    of one matrix, in order and covering it, run as ONE GEMV over that matrix (its tiles from its own shape:
    the rows' bits are those of the fused launch, the same in every such call; batch invariant)."""
    first = weights[0].fused
    n_tok = x.numel() // weights[0].shape[1]
    whole = first[0] if first is not None else None
    covers = whole is not None and [w.fused for w in weights] == [
        (whole, r0) for r0 in itertools.accumulate([0] + [w.shape[0] for w in weights[:-1]])
    ] and sum(w.shape[0] for w in weights) == whole.shape[0]
    if not (covers and x.device.type == "cuda" and n_tok <= GEMV_MAX_TOKENS):
        return [linear(x, w) for w in weights]
    y = linear(x, whole)  # [..., N1 + N2 + ...]
    return list(y.split([w.shape[0] for w in weights], dim=-1))


def q8_linear_rows(x: Tensor, weights: Sequence[Q8Weight]) -> list[Tensor]:
    """fused_linear_rows over Q8Weights."""
    return fused_linear_rows(x, weights, q8_linear)


def check_linear(x: Tensor, w) -> None:
    """x fits a quantized dense weight w (Q8Weight, dense_scaled.ScaledWeight): float32 [..., K], w's
    device."""
    if x.dtype != torch.float32:
        raise ValueError(f"a quantized linear needs float32 x, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != w.shape[1]:
        shape, k = list(x.shape), w.shape[1]
        raise ValueError(f"linear x {shape} does not end in K={k} of weight {list(w.shape)}")
    if x.device != w.device:
        raise ValueError(f"linear x on {x.device} but weight on {w.device}")


def q8_linear_reference(x: Tensor, w: Q8Weight) -> Tensor:
    """The reference twin: float32 [..., N] = F.linear(x, dequantized weight) (cuBLAS / CPU BLAS)."""
    check_linear(x, w)
    return F.linear(x, w.dequantize())


def linear_by_gemv(x: Tensor, w, gemv: Callable[[Tensor, Tensor | None], Tensor | None],
                   out: Tensor | None = None) -> Tensor:
    """x float32 [..., K] @ w.T -> float32 [..., N] for a QuantizedDense w: off CUDA F.linear of the
    dequantized weight; on CUDA gemv(x2 float32 [T, K], out2) for T <= GEMV_MAX_TOKENS rows where it serves
    them (None where not), else dequantized_linear. out: a contiguous float32 [..., N] to write (a decode
    graph's buffer): the GEMV writes it in place (out2, its [T, N] view; None: a new tensor), any other path
    is copied there."""
    check_linear(x, w)
    n, k = w.shape
    n_tok = x.numel() // k
    if out is not None and (out.shape != (*x.shape[:-1], n) or out.dtype != torch.float32
                            or not out.is_contiguous()):
        raise ValueError(f"linear out must be contiguous float32 {[*x.shape[:-1], n]}, got {out.dtype} "
                         f"{list(out.shape)}")
    if x.device.type != "cuda":
        y = F.linear(x, w.dequantize())
    else:
        if n_tok <= GEMV_MAX_TOKENS:
            y = gemv(x.reshape(n_tok, k).contiguous(), None if out is None else out.view(n_tok, n))  # [T, N]
            if y is not None:
                return y.reshape(*x.shape[:-1], n) if out is None else out
        y = dequantized_linear(x, w)
    return y if out is None else out.copy_(y)


def q8_linear(x: Tensor, w: Q8Weight, out: Tensor | None = None) -> Tensor:
    """x float32 [..., K] @ w.T -> float32 [..., N] (into `out` when given: linear_by_gemv); see the module
    doc for which path runs where."""
    return linear_by_gemv(x, w, lambda x2, out2: q8_gemv(x2, w, out=out2), out)


def dequantized_linear(x: Tensor, w) -> Tensor:
    """F.linear over the dequantized weight (a Q8Weight, or dense_blocks' BlockMatrix: any weight whose
    dequantize(r0, r1) gives float32 rows), DEQUANT_CHUNK_BYTES of float32 rows at a time: a prompt chunk's
    temporary stays small even for the [151936, 2048] head (1.2 GB whole), so the expert cache sized from
    free VRAM at load keeps fitting."""
    n, k = w.shape
    step = max(1, DEQUANT_CHUNK_BYTES // (4 * k))
    if step >= n:
        return F.linear(x, w.dequantize())
    out = torch.empty((*x.shape[:-1], n), dtype=torch.float32, device=x.device)  # [..., N]
    for r0 in range(0, n, step):
        out[..., r0 : r0 + step] = F.linear(x, w.dequantize(r0, r0 + step))
    return out


# ---- the Triton GEMV --------------------------------------------------------------------------------


def gemv_tiles(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BN rows, BK columns, warps) of a program, from the matrix shape alone, never the token count:
    the tiles fix each row's reduction order, so this is what makes the GEMV batch invariant.

    About a thousand programs or more for a 1-token launch (BN ~ N / 1024, 2 to 16 rows), each step loading
    2-4 KiB of codes (BK = 4096 / BN columns, at most 1024). Swept on the H200 (session 7, bench_dense_q8
    --sweep, 1 token): 8192x2048 at 8/512 9.0 us (47% of copy bandwidth), 2048x4096 at 2/1024 5.9 us
    (36%), 151936x2048 at 16/256 103 us (77%); session 6's one-word-a-thread body took 19.2, 10.8 and 268."""
    bn = min(16, max(2, 1 << max(0, (n_rows // 1024).bit_length() - 1)))
    bk = max(32, min(1024, 4096 // bn, next_pow2(n_cols)))
    return bn, bk, 4


def _gemv_body(X, QS, D, OUT, n_tok, N, K, KB, BN: tl.constexpr, BK: tl.constexpr):
    # X f32 [T, K], QS int8 [N, K], D f16 [N, KB], OUT f32 [T, N]. One program: token t, rows BN, all of K
    # in chunks of BK (G = BK/32 blocks). The codes load as int8 tiles [BN, G, 32], 16 contiguous codes a
    # thread (one 16-byte load: 2x the bandwidth of session 6's one word a thread), the activations [G, 32]
    # broadcast over the rows, the scales [BN, G]. A block's 32 products are summed, scaled and accumulated
    # per block position; the G positions are summed once at the end. The token is the fastest grid axis:
    # the programs of one row block run side by side and read the same weight bytes, from L2 after the first.
    pid = tl.program_id(0)
    t = pid % n_tok
    rows = (pid // n_tok) * BN + tl.arange(0, BN)  # [BN]
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    g = tl.arange(0, BK // 32)  # [G]
    e = tl.arange(0, 32)  # [32]
    col = g[:, None] * 32 + e[None, :]  # [G, 32]
    q_ptr = QS + rows_c[:, None, None] * K + tl.max_contiguous(tl.multiple_of(col, [32, 16]), [1, 16])[None]
    d_ptr = D + rows_c[:, None] * KB + g[None, :]  # [BN, G]
    x_ptr = X + t.to(tl.int64) * K + col  # [G, 32]
    acc = tl.zeros((BN, BK // 32), tl.float32)
    for k0 in range(0, K, BK):
        live = k0 // 32 + g < KB  # [G]
        q = tl.load(q_ptr + k0, mask=live[None, :, None], other=0)
        x = tl.load(x_ptr + k0, mask=live[:, None], other=0.0)
        d = tl.load(d_ptr + k0 // 32, mask=live[None, :], other=0.0)
        acc += tl.sum(q.to(tl.float32) * x[None, :, :], axis=2) * d.to(tl.float32)
    tl.store(OUT + t.to(tl.int64) * N + rows, tl.sum(acc, axis=1), mask=rows < N)


@functools.cache
def _kernel():
    # n_tok unspecialized: T = 1 and T = 16 run the very same binary (batch invariance)
    return jit_bodies(_gemv_body, do_not_specialize=["n_tok"])[0]


def q8_gemv(x2: Tensor, w: Q8Weight, out: Tensor | None = None,
            tiles: tuple[int, int, int] | None = None) -> Tensor:
    """The GEMV: x2 float32 [T, K] (contiguous) -> out float32 [T, N], every element written.

    Any T works (q8_linear sends T <= GEMV_MAX_TOKENS). On CUDA the CUDA C kernel where it is on and serves
    (see the module doc), else the Triton kernel, which runs where Triton runs (CUDA, or the CPU under
    TRITON_INTERPRET=1). No host sync and no data-dependent allocation: CUDA-graph capturable once
    compiled (call it once per weight shape before capturing). `tiles` picks the Triton kernel with those
    tiles (benchmarks)."""
    check_linear(x2, w)
    n, k = w.shape
    if x2.dim() != 2 or not x2.is_contiguous():
        raise ValueError(f"q8_gemv needs a contiguous [T, K] x, got {list(x2.shape)}")
    n_tok = x2.shape[0]
    if out is None:
        out = torch.empty((n_tok, n), dtype=torch.float32, device=x2.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (n_tok, n) or not out.is_contiguous() \
            or out.device != x2.device:
        raise ValueError(f"q8_gemv out must be contiguous float32 [{n_tok}, {n}] on {x2.device}")
    if n_tok == 0:
        return out
    if tiles is None and x2.device.type == "cuda" and cuda_gemv_on() and launch_cuda_gemv(x2, w.qs, w.d, out):
        return out
    bn, bk, warps = tiles or gemv_tiles(n, k)
    grid = (n_tok * -(-n // bn),)
    _kernel()[grid](x2, w.qs, w.d, out, n_tok, n, k, k // QK, BN=bn, BK=bk, num_warps=warps,
                    enable_fp_fusion=True)  # explicit: Triton 3.10 turns the default off
    return out
