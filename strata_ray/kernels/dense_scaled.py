"""Dense Q4_K and Q6_K matrices kept on their device as int8 codes with float32 chunk scales: the exact values
of the file at 1.5 / 1.25 bytes a weight instead of a float32 copy's 4 (DESIGN section 7, batch invariance of
the dense path).

A real Q4_K_M file holds its attention / GDN projections, shared experts, embedding and head in Q4_K and
Q6_K. Dequantized to float32 they take ~9 GB of an 80B-A3B's VRAM and ~7 GB of reads a decode token; as
Q8_0 (the synthetic files) 2.5 GB. Their values are exact in this form:

    Q6_K  value (n, k) = f32(scale[n, k // 16] * q)             q int8 in -32..31, scale = f32(d * sc)
    Q4_K  value (n, k) = f32(scale[n, k // 16] * q) - offset[..]  q in 0..15, scale = f32(d * sc), offset =
                                                                  f32(dmin * m), each repeated for both
                                                                  16-value chunks of its 32-value sub-block

the two roundings of quants.dequantize, so `dequantize()` gives the reference forward's bits.

`scaled_linear(x, w)`:
- CPU: `F.linear(x, w.dequantize())`, the reference bits.
- CUDA, at most GEMV_MAX_TOKENS rows (decode, verify windows): dense_q8_cuda's GEMV with float32 chunk scales
  (and offsets: a chunk's b * its sum of x after its product), batch invariant, its own rounding; where cupy
  is missing or the kernel cannot serve, the dequantized linear below.
- CUDA, more rows: cuBLAS over the dequantized weight, a slice of rows at a time.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from strata_ray.model.quants import QK_K, T, q4_k_parts, q6_k_parts, row_bytes, type_name

from .dense_q8 import QuantizedDense, linear_by_gemv
from .dense_q8_cuda import cuda_gemv_on, launch_cuda_gemv

CHUNK = 16  # values a scale (and an offset) covers: a Q6_K group, half a Q4_K sub-block
TYPES = (T.Q4_K, T.Q6_K)


class ScaledWeight(QuantizedDense):
    """A Q4_K or Q6_K matrix [N, K] as `qs` int8 [N, K], `scale` float32 [N, K / 16] and `offset` float32
    [N, K / 16] (Q4_K) or None (Q6_K), on one device."""

    def __init__(self, qs: Tensor, scale: Tensor, offset: Tensor | None = None):
        if qs.dtype != torch.int8 or qs.dim() != 2:
            raise ValueError(f"ScaledWeight qs must be int8 [N, K], got {qs.dtype} {list(qs.shape)}")
        n, k = qs.shape
        if n == 0 or k == 0 or k % CHUNK:
            raise ValueError(f"ScaledWeight shape [{n}, {k}]: N must be > 0 and K a multiple of {CHUNK}")
        for name, t in (("scale", scale), ("offset", offset)):
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (n, k // CHUNK)):
                raise ValueError(f"ScaledWeight {name} must be float32 [{n}, {k // CHUNK}], got {t.dtype} "
                                 f"{list(t.shape)}")
            if t is not None and t.device != qs.device:
                raise ValueError(f"ScaledWeight qs on {qs.device} but {name} on {t.device}")
        self.qs = qs.contiguous()  # [N, K]
        self.scale = scale.contiguous()  # [N, K / 16]
        self.offset = offset.contiguous() if offset is not None else None  # [N, K / 16]

    @classmethod
    def from_blocks(cls, raw: np.ndarray, n_rows: int, n_cols: int, ggml_type: int,
                    device: torch.device | str = "cpu") -> ScaledWeight:
        """GGUF Q4_K / Q6_K bytes (uint8 [N, row bytes] or flat, a read-only file map included) ->
        ScaledWeight on `device`, decoded on the host by quants' own block decoders."""
        if ggml_type not in TYPES:
            raise ValueError(f"ScaledWeight holds Q4_K or Q6_K, not {type_name(ggml_type)}")
        if n_rows <= 0 or n_cols <= 0 or n_cols % QK_K:
            raise ValueError(f"{type_name(ggml_type)} matrix [{n_rows}, {n_cols}]: K must be a multiple of "
                             f"{QK_K} > 0, N > 0")
        want = n_rows * row_bytes(n_cols, ggml_type)
        if raw.dtype != np.uint8 or raw.size != want:
            raise ValueError(f"{type_name(ggml_type)} [{n_rows}, {n_cols}] needs {want} uint8 bytes, got "
                             f"{raw.size} of {raw.dtype}")
        blocks = np.ascontiguousarray(raw).reshape(-1, want // (n_rows * n_cols // QK_K))  # [nb, bytes]
        if ggml_type == T.Q4_K:
            q, ds, dm = q4_k_parts(blocks)  # [nb, 256], [nb, 8], [nb, 8]
            scale, offset = np.repeat(ds, 2, axis=1), np.repeat(dm, 2, axis=1)  # a sub-block's two chunks
        else:
            q, scale = q6_k_parts(blocks)  # [nb, 256], [nb, 16]
            offset = None
        def on_device(a: np.ndarray, dtype, cols: int) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(a.astype(dtype).reshape(n_rows, cols))).to(device)

        off = on_device(offset, np.float32, n_cols // CHUNK) if offset is not None else None
        return cls(on_device(q, np.int8, n_cols), on_device(scale, np.float32, n_cols // CHUNK), off)

    @property
    def nbytes(self) -> int:
        """Bytes held (qs, scale, offset): what a GEMV reads per token."""
        return self.qs.numel() + 4 * self.scale.numel() + (4 * self.offset.numel() if self.offset is not None
                                                             else 0)

    def dequantize(self, r0: int = 0, r1: int | None = None) -> Tensor:
        """float32 rows r0..r1 (all by default), equal bit for bit to quants.dequantize of the file's
        blocks."""
        qs, scale = self.qs[r0:r1], self.scale[r0:r1]
        n, k = qs.shape
        w = qs.view(n, k // CHUNK, CHUNK).to(torch.float32) * scale[:, :, None]  # one rounding
        if self.offset is not None:
            w = w - self.offset[r0:r1][:, :, None]  # the second
        return w.reshape(n, k)

    def parts(self) -> tuple:
        return self.qs, self.scale, self.offset

    def __repr__(self) -> str:
        kind = "Q4_K" if self.offset is not None else "Q6_K"
        return f"ScaledWeight({kind}, {list(self.shape)}, device={self.device})"


def scaled_linear(x: Tensor, w: ScaledWeight, out: Tensor | None = None) -> Tensor:
    """x float32 [..., K] @ w.T -> float32 [..., N] (into `out` when given: dense_q8.linear_by_gemv); see the
    module doc for which path runs where."""
    return linear_by_gemv(x, w, lambda x2, out2: _scaled_gemv(x2, w, out2), out)


def _scaled_gemv(x2: Tensor, w: ScaledWeight, out: Tensor | None = None) -> Tensor | None:
    """The CUDA GEMV's scaled form: float32 [T, N] (into `out` when given), or None where it is off or does
    not serve."""
    if not cuda_gemv_on():
        return None
    if out is None:
        out = torch.empty((x2.shape[0], w.shape[0]), dtype=torch.float32, device=x2.device)
    return out if launch_cuda_gemv(x2, w.qs, w.scale, out, offset=w.offset) else None
