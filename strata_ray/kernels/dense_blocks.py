"""Dense quantized matrices on the CPU as their GGUF blocks, computed by the expert contract's kernels
(opt-in: STRATA_CPU_DENSE_BLOCKS=1).

The CPU forward dequantizes every dense matrix to float32 at load and calls F.linear: the reference's
arithmetic, but 4 bytes a weight held in RAM and read by every decode token. A CPU decode token is bound by
those reads: the synthetic `small` model reads ~130 MB of float32 projections a token against its file's
35 MB of Q8_0, and a 30B-A3B's LM head alone is 1.24 GB (62 ms a token at the 2-core VM's ~20 GB/s).

With the switch on, the loader keeps a dense Q8_0 / Q4_0 / Q4_K / Q6_K matrix as its blocks (`BlockMatrix`:
a view of the file map, no copy) and a call of at most GEMV_MAX_TOKENS tokens (decode, verify windows)
computes its rows as the expert path does: each token's activations quantized to int8 blocks, exact integer
block dots, the contract's float32 fold (DESIGN section 7). As llama.cpp does on the CPU (int8 activations
against quantized weights), not the float32 reference: the rows are deterministic and batch invariant
(a token's row does not depend on the other tokens, rows or threads) and equal the GPU expert kernels' bits
for the same weights. Longer calls (prompt chunks, compute-bound) take F.linear over the dequantized rows,
the reference's arithmetic, a slice of rows at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from strata_ray.model.quants import T, dequantize, row_bytes, type_name

from .act_quant import quantize_act_sums
from .contract import QK, readonly_blocks
from .cpu_pool import SINGLE_THREAD_BYTES, default_pool
from .dense_q8 import GEMV_MAX_TOKENS, dequantized_linear
from .expert_cpu_kernels import down_share

TYPES = (T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K)  # the contract's weight types


class BlockMatrix:
    """A dense matrix [N, K] as its GGUF block bytes `blocks` uint8 [1, N, row bytes] (one 'expert' for the
    contract kernels) of type `wtype`, on the host."""

    def __init__(self, raw: np.ndarray, n_rows: int, n_cols: int, wtype: int):
        if wtype not in TYPES:
            kinds = ", ".join(type_name(t) for t in TYPES)
            raise ValueError(f"BlockMatrix holds {kinds}, not {type_name(wtype)}")
        if n_rows <= 0 or n_rows % QK:
            raise ValueError(f"BlockMatrix needs a positive multiple of {QK} rows, got {n_rows}")
        rb = row_bytes(n_cols, wtype)  # ModelFormatError where K is not whole blocks
        if raw.dtype != np.uint8 or raw.size != n_rows * rb:
            raise ValueError(f"{type_name(wtype)} [{n_rows}, {n_cols}] needs {n_rows * rb} uint8 bytes, got "
                             f"{raw.size} of {raw.dtype}")
        # [1, N, RB]: a view of a file map; read-only and a plain-int type whatever the caller passed, the
        # argument types the expert kernels are compiled for (another type would be another compile)
        self.blocks = readonly_blocks(raw).reshape(1, n_rows, rb)
        self.wtype = int(wtype)
        self.shape = torch.Size((n_rows, n_cols))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return self.blocks.size

    def _values(self, part: np.ndarray) -> Tensor:
        """float32 [M, K]: the file's values (quants.dequantize) of block rows part uint8 [M, RB]."""
        return torch.from_numpy(dequantize(part.reshape(-1), self.wtype, (part.shape[0], self.shape[1])))

    def dequantize(self, r0: int = 0, r1: int | None = None) -> Tensor:
        """float32 rows r0..r1 (all by default)."""
        return self._values(self.blocks[0, r0:r1])

    def rows(self, idx: Tensor | Sequence[int]) -> Tensor:
        """Dequantized rows float32 [*idx.shape, K] (an embedding lookup)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        return self._values(self.blocks[0][idx.reshape(-1).numpy()]).reshape(*idx.shape, self.shape[1])

    def __repr__(self) -> str:
        return f"BlockMatrix({type_name(self.wtype)}, {list(self.shape)})"


def block_rows(x2: np.ndarray, w: BlockMatrix) -> np.ndarray:
    """f32 [T, N]: the contract rows of w for each token of x2 f32 [T, K] (quantized here), on the calling
    thread below SINGLE_THREAD_BYTES of blocks, else split over the CPU pool's threads by 32-row tiles."""
    n_tok = x2.shape[0]
    xq, xd, xs = quantize_act_sums(x2)
    out = np.empty((n_tok, w.shape[0]), np.float32)
    ents = np.arange(n_tok, dtype=np.int64)
    g_start, g_exp = np.array([0, n_tok], np.int64), np.zeros(1, np.int64)
    pool = default_pool()
    shares = 1 if w.nbytes < SINGLE_THREAD_BYTES else min(pool.n_threads, w.shape[0] // QK)
    pool.run(down_share, [(w.blocks, w.wtype, xq, xd, xs, ents, g_start, g_exp, t, shares, out)
                          for t in range(shares)])
    return out


def block_linear(x: Tensor, w: BlockMatrix) -> Tensor:
    """x float32 [..., K] @ w.T -> float32 [..., N]: the contract rows for at most GEMV_MAX_TOKENS tokens,
    else F.linear over the dequantized rows (see the module doc)."""
    n, k = w.shape
    if x.dtype != torch.float32 or x.dim() == 0 or x.shape[-1] != k or x.device.type != "cpu":
        raise ValueError(f"block_linear needs float32 CPU x [..., {k}], got {x.dtype} {list(x.shape)} on "
                         f"{x.device}")
    n_tok = x.numel() // k
    if n_tok <= GEMV_MAX_TOKENS:
        x2 = x.reshape(n_tok, k).contiguous().numpy()
        return torch.from_numpy(block_rows(x2, w)).reshape(*x.shape[:-1], n)
    return dequantized_linear(x, w)

