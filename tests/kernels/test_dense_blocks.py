"""Dense quantized matrices on the CPU as their blocks, computed by the contract's kernels
(strata_ray/kernels/dense_blocks.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import strata_ray.kernels.dense_blocks as db
import strata_ray.kernels.dense_q8 as dq
from strata_ray.kernels.dense_blocks import BlockMatrix, block_linear
from strata_ray.kernels.spec import matmul_spec
from strata_ray.model import quants
from strata_ray.model.quants import T

F32 = np.float32


def _matrix(n: int, k: int, t: int, seed: int = 0) -> tuple[BlockMatrix, np.ndarray]:
    rng = np.random.default_rng(seed + 7 * n + k + t)
    x = rng.standard_normal((n, k)).astype(F32) * rng.uniform(0.05, 2.0, (n, 1)).astype(F32)
    raw = quants.quantize(x, t).reshape(n, -1)
    return BlockMatrix(raw, n, k, t), raw


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("n,k,tok", [(32, 256, 1), (64, 512, 3), (224, 768, 16)])
def test_decode_rows_are_the_contract_rows(t, n, k, tok):
    """At most 16 tokens: each token's rows are the contract's (int8 activations, exact block dots, the
    float32 fold), bit for bit."""
    w, raw = _matrix(n, k, t)
    x = np.random.default_rng(k + tok).standard_normal((tok, k)).astype(F32) * 2
    got = block_linear(torch.from_numpy(x), w).numpy()
    want = matmul_spec(raw, t, x)  # [T, N]
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_rows_do_not_depend_on_the_batch_or_the_threads(monkeypatch):
    """A token's rows alone or among 16, on the calling thread or split over the pool: the same bits."""
    w, _ = _matrix(1024, 2048, T.Q8_0)  # 2.2 MB: the pool's threads
    assert w.nbytes >= db.SINGLE_THREAD_BYTES
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((16, 2048)).astype(F32))
    batch = block_linear(x, w)
    assert torch.equal(block_linear(x[5:6], w), batch[5:6])
    monkeypatch.setattr(db, "SINGLE_THREAD_BYTES", 1 << 40)  # every call on the calling thread
    assert torch.equal(block_linear(x, w), batch)


def test_prompt_calls_are_the_reference_linear(monkeypatch):
    """More than 16 tokens: F.linear over the file's values, a slice of rows at a time."""
    w, raw = _matrix(96, 512, T.Q4_K)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((2, 20, 512)).astype(F32))
    dense = torch.from_numpy(quants.dequantize(raw.reshape(-1), T.Q4_K, (96, 512)))
    monkeypatch.setattr(dq, "DEQUANT_CHUNK_BYTES", 4 * 512 * 40)  # slices of 40 rows: 40, 40, 16
    got = block_linear(x, w)
    assert got.shape == (2, 20, 96)
    torch.testing.assert_close(got, F.linear(x, dense), rtol=1e-5, atol=1e-5)


def test_dequantize_and_rows_are_the_files_values():
    w, raw = _matrix(64, 256, T.Q6_K)
    full = quants.dequantize(raw.reshape(-1), T.Q6_K, (64, 256))
    assert np.array_equal(w.dequantize().numpy(), full)
    assert np.array_equal(w.dequantize(8, 12).numpy(), full[8:12])
    idx = torch.tensor([[3, 0], [63, 3]])
    assert torch.equal(w.rows(idx), torch.from_numpy(full)[idx])
    assert w.nbytes == raw.size and w.shape == (64, 256) and "Q6_K" in repr(w)


def test_bad_input_is_one_line():
    raw = _matrix(32, 256, T.Q8_0)[1]
    cases = [
        (lambda: BlockMatrix(raw, 32, 256, T.F16), "not F16"),
        (lambda: BlockMatrix(raw[:16], 16, 256, T.Q8_0), "multiple of 32 rows"),
        (lambda: BlockMatrix(raw[:31], 32, 256, T.Q8_0), "needs 8704 uint8 bytes, got 8432"),
        (lambda: block_linear(torch.zeros(1, 128), BlockMatrix(raw, 32, 256, T.Q8_0)), "float32 CPU x"),
        (lambda: block_linear(torch.zeros(1, 256, dtype=torch.float64), BlockMatrix(raw, 32, 256, T.Q8_0)),
         "float32 CPU x"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            fn()
        assert "\n" not in str(e.value)
