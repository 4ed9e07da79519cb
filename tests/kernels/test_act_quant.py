"""Activation quantization and the fixed exp: numba == numpy spec bit for bit; fexp ~ math.exp. The GPU
quantizer (expert_gpu.quantize_act_gpu, Triton) == the spec bit for bit too: under Triton's CPU interpreter in
CI, compiled on a CUDA machine (-m gpu)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from strata_ray.kernels.act_quant import fexp_array, quantize_act, quantize_act_sums
from strata_ray.kernels.contract import TINY, KernelError
from strata_ray.kernels.spec import act_quant_ref, fexp_ref, rint_ref
from tests.kernels.triton_interpret import interpret

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _activations(rng, n_rows=64, n=512):
    x = rng.standard_normal((n_rows, n)) * np.exp(rng.uniform(-30, 8, (n_rows, 1)))
    x = x.astype(np.float32)
    x[0, :32] = 0.0  # zero block
    x[1, 32:64] = 1e-20  # below TINY: a zero block by rule
    x[2, :32] = np.float32(TINY)  # exactly TINY: live
    x[3, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves land on ties after scaling
    x[4, :32] = -7.0  # all equal: q = -127
    return x


def test_numba_matches_spec_bitwise(rng):
    x = _activations(rng)
    for got, want in zip(quantize_act_sums(x), act_quant_ref(x), strict=True):
        assert got.dtype == want.dtype
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_the_block_max_found_at_every_position(rng):
    """act_quant.block_amax keeps 8 running maxima (positions i, i + 8, ...) and folds them in pairs: the
    block's largest |x| at each of its 32 positions, of either sign, beside values just below it, -0.0 and
    subnormals, gives the spec's scale and codes."""
    x = rng.uniform(-1.0, 1.0, (64, 32)).astype(np.float32)
    x[:, 5] = -0.0
    x[:, 6] = np.float32(1e-40)  # subnormal
    for i in range(64):
        pos, sign = i % 32, 1.0 if i < 32 else -1.0
        x[i, pos] = sign * 3.0
        x[i, (pos + 8) % 32] = np.nextafter(np.float32(3.0), np.float32(0.0))  # one ulp below, another chain
    x = x.reshape(8, 256)
    for got, want in zip(quantize_act_sums(x), act_quant_ref(x), strict=True):
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert np.all(quantize_act_sums(x)[1] == np.float32(3.0) / np.float32(127.0))


def test_quantization_properties(rng):
    x = _activations(rng)
    q, d, s = act_quant_ref(x)
    assert np.all(q[0, :32] == 0) and d[0, 0] == 0 and s[0, 0] == 0
    assert np.all(q[1, 32:64] == 0) and d[1, 1] == 0
    assert d[2, 0] > 0 and np.all(q[2, :32] == 127)
    assert np.all(q[4, :32] == -127)
    assert np.abs(q.astype(np.int32)).max() <= 127
    assert np.array_equal(s, q.reshape(len(x), -1, 32).astype(np.int32).sum(axis=2))
    # Reconstruction error is at most half a step of each block's scale.
    rec = q.reshape(len(x), -1, 32) * d[:, :, None]
    err = np.abs(rec - x.reshape(len(x), -1, 32))
    live = d > 0
    assert np.all(err[live] <= d[live][:, None] * 0.5001)


def test_quantize_act_interface(rng):
    x = rng.standard_normal((3, 64)).astype(np.float32)
    q, d = quantize_act(x)
    assert q.shape == (3, 64) and q.dtype == np.int8 and d.shape == (3, 2) and d.dtype == np.float32
    with pytest.raises(KernelError, match="multiple of 32"):
        quantize_act(np.zeros((2, 33), np.float32))


def test_rint_is_round_half_even():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.49, 3.7], np.float32)
    assert np.array_equal(rint_ref(v), np.rint(v))


def test_fexp_numba_matches_spec_bitwise():
    x = np.linspace(-120, 120, 100_001, dtype=np.float32)
    assert np.array_equal(fexp_array(x).view(np.int32), fexp_ref(x).view(np.int32))


def test_fexp_close_to_math_exp():
    x = np.linspace(-86, 88, 200_001, dtype=np.float32)
    got = fexp_ref(x).astype(np.float64)
    want = np.array([math.exp(v) for v in x.astype(np.float64)])
    assert np.max(np.abs(got / want - 1)) < 5e-7
    # Clamped outside the range, finite and positive everywhere.
    edge = fexp_ref(np.array([-1e4, -100, 100, 1e4], np.float32))
    assert np.all(np.isfinite(edge)) and np.all(edge > 0)


def test_poisoned_blocks_are_the_same_everywhere(rng):
    """A block holding a NaN or an infinity: q = 0, d = NaN, s = 0 (contract step 1), numba == spec, beside
    untouched finite blocks; a NaN among zeros (which the block max skips) and among tiny values too."""
    x = rng.standard_normal((6, 96)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 40] = np.inf
    x[2, 95] = -np.inf
    x[3, :32] = 0.0
    x[3, 17] = np.nan  # a NaN among zeros
    x[4, 32:64] = 1e-25  # below TINY, a zero block but for the NaN
    x[4, 33] = np.nan
    finite = act_quant_ref(np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))
    got, want = quantize_act_sums(x), act_quant_ref(x)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8))
    q, d, s = want
    poisoned = [(0, 0), (1, 1), (2, 2), (3, 0), (4, 1)]
    for r, b in poisoned:
        assert np.isnan(d[r, b]) and s[r, b] == 0 and not q[r, 32 * b : 32 * b + 32].any()
    keep = np.ones(d.shape, bool)
    keep[tuple(zip(*poisoned, strict=True))] = False
    assert np.array_equal(d[keep], finite[1][keep]) and np.array_equal(s[keep], finite[2][keep])


def test_the_quotient_is_a_division_not_a_reciprocal_product():
    """x / d, correctly rounded: here x / d is 56.5 exactly (a tie: 56) while x * (1 / d) is 56.500004
    (57). A quantizer that multiplied by the reciprocal would differ in this code."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = np.array(0x401468C0, np.uint32).view(np.float32)  # amax
    x[0, 1] = np.array(0x3F840C93, np.uint32).view(np.float32)
    d = x[0, 0] / np.float32(127)
    assert x[0, 1] / d == np.float32(56.5) and rint_ref(x[0, 1] * (np.float32(1) / d)) == 57
    for q, _, _ in (quantize_act_sums(x), act_quant_ref(x)):
        assert q[0, 1] == 56 and q[0, 0] == 127


def _gpu_quantizer_matches_the_spec(device: str) -> None:
    """quantize_act_gpu at widths of 1, 3 and 65 blocks (its programs take up to 64 blocks: a masked tail in
    the 3-block and the 65-block rows' last program), over zero, tiny, exactly-TINY, tie and poisoned blocks
    (a NaN, +-inf, a NaN among zeros): every element written (outputs poisoned first), the spec's bits."""
    from strata_ray.kernels.expert_gpu import quantize_act_gpu

    rng = np.random.default_rng(11)
    for n in (32, 96, 2080):
        x = _activations(rng, n_rows=9, n=max(n, 64))[:, :n].copy()
        x[5, n - 7] = np.nan  # the last block of each row below is poisoned
        x[6, n - 1] = np.inf
        x[7, n - 32 :] = 0.0
        x[7, n - 3] = np.nan
        x[8, 0] = -np.inf
        nb = n // 32
        out = (torch.full((9, n), -3, dtype=torch.int8, device=device),
               torch.full((9, nb), 12345.0, dtype=torch.float32, device=device),
               torch.full((9, nb), -99, dtype=torch.int32, device=device))
        got = quantize_act_gpu(torch.from_numpy(x).to(device), out=out)
        assert all(g is o for g, o in zip(got, out, strict=True))
        for g, w in zip(got, act_quant_ref(x), strict=True):
            assert np.array_equal(g.cpu().numpy().view(np.uint8), w.view(np.uint8)), n
        assert np.isnan(got[1][5:8, nb - 1].cpu().numpy()).all() and np.isnan(got[1][8, 0].cpu().numpy())


@interpret
def test_the_gpu_quantizer_gives_the_specs_bits_interpreted():
    _gpu_quantizer_matches_the_spec("cpu")


@pytest.mark.gpu
@cuda
def test_the_gpu_quantizer_gives_the_specs_bits_on_cuda():
    _gpu_quantizer_matches_the_spec("cuda")


def test_the_gpu_quantizer_refuses_a_wrong_out():
    pytest.importorskip("triton")
    from strata_ray.kernels.expert_gpu import quantize_act_gpu

    x = torch.zeros((2, 64))
    good = (torch.empty((2, 64), dtype=torch.int8), torch.empty((2, 2)),
            torch.empty((2, 2), dtype=torch.int32))
    for bad in ((good[0], good[1].double(), good[2]), (good[0][:1], good[1], good[2]),
                (good[0], torch.empty((2, 4))[:, ::2], good[2])):
        with pytest.raises(KernelError, match="out must be contiguous"):
            quantize_act_gpu(x, out=bad)


def _triton_exp_and_swiglu_match_the_spec(device: str) -> None:
    """triton_blocks.fexp and swiglu (the GPU rows' SwiGLU) == the spec's bits over the whole float range the
    fixed exp clamps (below EXP_LO and above EXP_HI too), ties of its rounding, and signed zeros."""
    from strata_ray.kernels.spec import swiglu_ref
    from strata_ray.kernels.triton_blocks import triton
    from tests.kernels.exp_probe import exp_swiglu_kernel

    rng = np.random.default_rng(12)
    g = np.concatenate([np.linspace(-200, 200, 40_001, dtype=np.float32), [-1e30, 1e30, -0.0, 0.0],
                        (np.arange(-300, 300) + 0.5).astype(np.float32) / np.float32(1.4426950408889634),
                        rng.standard_normal(5_000).astype(np.float32) * 30]).astype(np.float32)
    u = rng.standard_normal(g.size).astype(np.float32)
    e = torch.full((g.size,), float("nan"), device=device)
    s = torch.full((g.size,), float("nan"), device=device)
    g_dev, u_dev = torch.from_numpy(g).to(device), torch.from_numpy(u).to(device)
    exp_swiglu_kernel[(triton.cdiv(g.size, 1024),)](g_dev, u_dev, e, s, g.size, BLOCK=1024,
                                                     enable_fp_fusion=False)
    assert np.array_equal(e.cpu().numpy().view(np.int32), fexp_ref(g).view(np.int32))
    assert np.array_equal(s.cpu().numpy().view(np.int32), swiglu_ref(g, u).view(np.int32))


@interpret
def test_the_triton_exp_and_swiglu_give_the_specs_bits_interpreted():
    _triton_exp_and_swiglu_match_the_spec("cpu")


@pytest.mark.gpu
@cuda
def test_the_triton_exp_and_swiglu_give_the_specs_bits_on_cuda():
    _triton_exp_and_swiglu_match_the_spec("cuda")
