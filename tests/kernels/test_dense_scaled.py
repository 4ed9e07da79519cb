"""Dense Q4_K / Q6_K weights kept as int8 codes with float32 chunk scales (strata_ray/kernels/dense_scaled.py)
and the CUDA GEMV's scaled form (strata_ray/kernels/dense_q8_cuda.py).

CPU tests run in CI. GPU tests: python -m pytest -m gpu tests/kernels/test_dense_scaled.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata_ray.kernels.dense_q8_cuda import gemv_reference
from strata_ray.kernels.dense_scaled import ScaledWeight, scaled_linear
from strata_ray.model import quants
from strata_ray.model.quants import T

F32 = np.float32


def _blocks(n: int, k: int, t: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row bytes]: quants' own encoder over a random matrix (rows of different magnitudes)."""
    rng = np.random.default_rng(seed + 13 * n + k + t)
    x = rng.standard_normal((n, k)).astype(F32) * rng.uniform(0.01, 3.0, (n, 1)).astype(F32)
    return quants.quantize(x, t).reshape(n, -1)


def _weight(n: int, k: int, t: int, seed: int = 0) -> tuple[ScaledWeight, np.ndarray]:
    raw = _blocks(n, k, t, seed)
    return ScaledWeight.from_blocks(raw, n, k, t), raw


@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("n,k", [(1, 256), (33, 512), (222, 768), (5, 2048)])
def test_dequantize_is_the_files_values_bit_for_bit(t, n, k):
    w, raw = _weight(n, k, t)
    want = quants.dequantize(raw.reshape(-1), t, (n, k))
    assert np.array_equal(w.dequantize().numpy().view(np.int32), want.view(np.int32))
    assert (w.offset is not None) == (t == T.Q4_K)
    assert w.nbytes == n * k + 4 * (n * k // 16) * (2 if t == T.Q4_K else 1)


def test_rows_slices_and_moves():
    w, _ = _weight(40, 512, T.Q4_K)
    full = w.dequantize()
    idx = torch.tensor([[3, 0], [39, 3]])
    assert torch.equal(w.rows(idx), full[idx])
    assert torch.equal(w.row_slice(7, 12).dequantize(), full[7:12])
    assert torch.equal(w.dequantize(7, 12), full[7:12])
    assert torch.equal(w.to("cpu").dequantize(), full)
    assert "Q4_K" in repr(w) and "Q6_K" in repr(_weight(2, 256, T.Q6_K)[0])


def test_linear_on_cpu_is_the_reference_linear():
    """The CPU path is F.linear over the file's values: the bits of a float32 copy of the matrix."""
    for t in (T.Q4_K, T.Q6_K):
        w, raw = _weight(33, 512, t)
        x = torch.from_numpy(np.random.default_rng(1).standard_normal((3, 2, 512)).astype(F32))
        dense = torch.from_numpy(quants.dequantize(raw.reshape(-1), t, (33, 512)))
        assert torch.equal(scaled_linear(x, w), F.linear(x, dense))


def test_bad_input_is_one_line():
    raw = _blocks(2, 256, T.Q4_K)
    cases = [
        (lambda: ScaledWeight.from_blocks(raw, 2, 256, T.Q8_0), "holds Q4_K or Q6_K, not Q8_0"),
        (lambda: ScaledWeight.from_blocks(raw, 2, 128, T.Q4_K), "K must be a multiple of 256"),
        (lambda: ScaledWeight.from_blocks(raw[:1], 2, 256, T.Q4_K), "needs 288 uint8 bytes, got 144"),
        (lambda: ScaledWeight(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 3)),
         "scale must be float32"),
        (lambda: scaled_linear(torch.zeros(1, 128), ScaledWeight.from_blocks(raw, 2, 256, T.Q4_K)),
         "does not end in K=256"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            fn()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("n,k,tok", [(1, 256, 1), (33, 512, 3), (222, 768, 2), (3, 4096, 4)])
def test_gemv_twin_is_the_dot_within_float32_rounding(t, n, k, tok):
    """The GEMV's scaled form (a chunk's product times its scale, minus its offset times the chunk's sum of
    x) against the exact dot of the file's values, within a float32 bound."""
    w, raw = _weight(n, k, t)
    x = np.random.default_rng(k).standard_normal((tok, k)).astype(F32)
    off = w.offset.numpy() if w.offset is not None else None
    got = gemv_reference(x, w.qs.numpy(), w.scale.numpy(), off)
    vals = quants.dequantize(raw.reshape(-1), t, (n, k)).astype(np.float64)
    exact = x.astype(np.float64) @ vals.T
    # bound: the products' and the offsets' magnitudes (the offset term can cancel most of a Q4_K dot)
    q = w.qs.numpy().astype(np.float64) * np.repeat(w.scale.numpy().astype(np.float64), 16, axis=1)
    mag = np.abs(x.astype(np.float64)) @ np.abs(q).T
    if off is not None:
        mag += np.abs(x.astype(np.float64)) @ np.repeat(np.abs(off.astype(np.float64)), 16, axis=1).T
    assert got.dtype == F32 and got.shape == (tok, n)
    assert (np.abs(got - exact) <= 16 * np.finfo(F32).eps * mag + 1e-30).all()


def test_gemv_twin_rows_do_not_depend_on_the_other_tokens_or_rows():
    w, _ = _weight(40, 512, T.Q4_K)
    qs, s, b = w.qs.numpy(), w.scale.numpy(), w.offset.numpy()
    x = np.random.default_rng(2).standard_normal((5, 512)).astype(F32)
    all_of_them = gemv_reference(x, qs, s, b)
    assert np.array_equal(gemv_reference(x[2:3], qs, s, b), all_of_them[2:3])
    assert np.array_equal(gemv_reference(x, qs[7:9], s[7:9], b[7:9]), all_of_them[:, 7:9])


# ---- GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("n,k", [(1, 2048), (33, 256), (222, 512), (64, 4096), (2200, 2048), (5, 1280)])
def test_gpu_kernel_gives_the_twins_bits(t, n, k):
    """The CUDA GEMV's scaled form == its numpy twin bit for bit, at 1-16 tokens (batch invariant), and
    scaled_linear takes it; every output element written."""
    pytest.importorskip("cupy")
    from strata_ray.kernels.dense_q8_cuda import launch_cuda_gemv

    w_host, _ = _weight(n, k, t)
    w = w_host.to("cuda")
    off = w_host.offset.numpy() if w_host.offset is not None else None
    rng = np.random.default_rng(n + k)
    for tok in (1, 3, 5, 16):
        x = rng.standard_normal((tok, k)).astype(F32)
        want = gemv_reference(x, w_host.qs.numpy(), w_host.scale.numpy(), off)
        out = torch.full((tok, n), float("nan"), device="cuda")
        assert launch_cuda_gemv(torch.from_numpy(x).cuda(), w.qs, w.scale, out, offset=w.offset)
        assert np.array_equal(out.cpu().numpy().view(np.int32), want.view(np.int32)), tok
        got = scaled_linear(torch.from_numpy(x).cuda(), w)
        assert np.array_equal(got.cpu().numpy().view(np.int32), want.view(np.int32)), tok
    # a prompt chunk: cuBLAS over the file's values
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(F32)).cuda()
    torch.testing.assert_close(scaled_linear(x, w), F.linear(x, w.dequantize()))


def test_row_groups_fuse_into_one_matrix_of_views():
    """fuse_rows over ScaledWeights of one kind: views of one matrix (stored once), the same values; kinds
    (Q4_K with offsets, Q6_K without) never mix."""
    from strata_ray.kernels.dense_q8 import fuse_rows

    parts = [_weight(n, 512, T.Q4_K, seed=n)[0] for n in (33, 7, 2)]
    views = fuse_rows(parts)
    whole, _ = views[0].fused
    assert whole.shape == (42, 512) and [v.fused[1] for v in views] == [0, 33, 40]
    for v, p in zip(views, parts, strict=True):
        assert torch.equal(v.dequantize(), p.dequantize())
        assert v.qs.data_ptr() == whole.qs[v.fused[1]].data_ptr()
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 512)).astype(F32))
    from strata_ray.model.ops import linear_rows

    assert all(torch.equal(a, scaled_linear(x, p)) for a, p in zip(linear_rows(x, views), parts, strict=True))
    with pytest.raises(ValueError, match="share their width, kind"):
        fuse_rows([parts[0], _weight(4, 512, T.Q6_K)[0]])
