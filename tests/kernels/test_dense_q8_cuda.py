"""The CUDA C dense Q8_0 GEMV (strata_ray/kernels/dense_q8_cuda.py): its numpy twin on CPU (the exact fma,
the sums against float64), and on the GPU the kernel's bits against the twin's at awkward sizes.

GPU tests: python -m pytest -m gpu tests/kernels/test_dense_q8_cuda.py (cupy needed).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from strata_ray.kernels.dense_q8 import Q8Weight
from strata_ray.kernels.dense_q8_cuda import (
    LOADS_A_GROUP,
    TT_MAX,
    X_SMEM_BYTES,
    chunks_a_lane,
    ctas_an_sm,
    cuda_gemv_on,
    cuda_gemv_serves,
    fma32,
    gemv_reference,
    rows_a_group,
    tokens_a_cta,
)

F32 = np.float32


def _round32(v: Fraction) -> np.float32:
    """The float32 nearest to an exact rational (ties to even), by comparing the neighbours exactly."""
    f = np.float32(float(v))
    cands = [np.nextafter(f, F32(-np.inf)), f, np.nextafter(f, F32(np.inf))]
    def key(c):
        return (abs(Fraction(float(c)) - v), int(np.array(c).view(np.int32)) & 1)
    return min(cands, key=key)


def _exact_fma(a, b, c) -> np.float32:
    return _round32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def test_fma32_is_one_rounding_where_float64_would_round_twice():
    """a * b + c = 1 + 2^-23 + 2^-24 - 2^-70: just under a float32 midpoint. float64 first rounds it onto the
    midpoint, and the tie then goes to the even neighbour (wrong); one rounding keeps 1 + 2^-23."""
    a, b, c = F32(1 + 2**-23), F32(2**-24 * (1 - 2**-23)), F32(1 + 2**-23)
    naive = F32(np.float64(a) * np.float64(b) + np.float64(c))
    assert naive == F32(1 + 2**-22)  # the double rounding this guards against
    assert fma32(np.array([a]), np.array([b]), np.array([c]))[0] == F32(1 + 2**-23) == _exact_fma(a, b, c)


def test_fma32_matches_exact_rationals():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(400).astype(F32)
    b = (rng.standard_normal(400) * 2.0 ** rng.integers(-30, 30, 400)).astype(F32)
    c = (rng.standard_normal(400) * 2.0 ** rng.integers(-30, 30, 400)).astype(F32)
    c[:50] = -(a[:50] * b[:50])  # cancellation
    c[50:60] = 0.0
    got = fma32(a, b, c)
    want = np.array([_exact_fma(x, y, z) for x, y, z in zip(a, b, c, strict=True)], F32)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def _matrix(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(qs int8 [n, k], d float16 [n, k / 32]) of gguf-py's Q8_0 quantization of a random matrix."""
    rng = np.random.default_rng(seed + 7 * n + k)
    raw = gguf_quants.quantize(rng.standard_normal((n, k)).astype(F32), GGMLQuantizationType.Q8_0)
    w = Q8Weight.from_blocks(raw, n, k)
    return w.qs.numpy(), w.d.numpy()


@pytest.mark.parametrize("n,k,t", [(1, 32, 1), (33, 96, 3), (222, 512, 2), (5, 2048, 1), (3, 4096, 4),
                                   (7, 1280, 1)])
def test_reference_is_the_dot_within_float32_rounding(n, k, t):
    qs, d = _matrix(n, k)
    x = np.random.default_rng(k).standard_normal((t, k)).astype(F32)
    got = gemv_reference(x, qs, d)
    w = qs.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)  # [N, K] exact
    exact = x.astype(np.float64) @ w.T
    bound = 8 * np.finfo(F32).eps * (np.abs(x.astype(np.float64)) @ np.abs(w).T) + 1e-30
    assert got.dtype == F32 and got.shape == (t, n)
    assert (np.abs(got - exact) <= bound).all()


def test_reference_rows_do_not_depend_on_the_other_tokens_or_rows():
    qs, d = _matrix(40, 640)
    x = np.random.default_rng(1).standard_normal((5, 640)).astype(F32)
    all_of_them = gemv_reference(x, qs, d)
    assert np.array_equal(gemv_reference(x[2:3], qs, d), all_of_them[2:3])
    assert np.array_equal(gemv_reference(x, qs[7:9], d[7:9]), all_of_them[:, 7:9])


def test_launch_choices():
    assert [chunks_a_lane(k) for k in (32, 512, 544, 2048, 4096)] == [1, 1, 2, 4, 8]
    assert tokens_a_cta(2048) == TT_MAX and tokens_a_cta(4096) == 3 and tokens_a_cta(12288) == 1
    assert tokens_a_cta(2048, 1) == 1 and tokens_a_cta(4096, 16) == 3
    assert cuda_gemv_serves(2048) and cuda_gemv_serves(96)
    assert not cuda_gemv_serves(48) and not cuda_gemv_serves(X_SMEM_BYTES // 4 + 32)
    full = [rows_a_group(151936, k, 132) for k in (32, 512, 1024, 2048, 4096)]
    assert full == [max(1, LOADS_A_GROUP // chunks_a_lane(k)) for k in (32, 512, 1024, 2048, 4096)]
    assert rows_a_group(2048, 512, 132) == 1  # a small matrix: every warp of the wave some rows
    assert ctas_an_sm(80, 8192) == 3  # 80 registers: 2560 a warp, 25 warps
    assert ctas_an_sm(126, 32768) == 2
    assert ctas_an_sm(32, 4096) == 8  # the 64 warps an SM
    assert ctas_an_sm(40, 200000) == 1


def test_launch_geometry(monkeypatch):
    """The grid, block and shared memory launch_cuda_gemv asks for (a stand-in kernel and launcher: the real
    ones need a GPU, where test_gpu_kernel_gives_the_twins_bits runs them): one wave of CTAs shared by the
    token groups, fewer for a small matrix, TT tokens' activations staged."""
    import types

    import strata_ray.kernels.dense_q8_cuda as dqc
    import strata_ray.kernels.nvrtc as nvrtc

    launched = []
    monkeypatch.setattr(dqc, "_kernel",
                        lambda k, rpw, tt, dev, scaled=False, offset=False, ctas=1: types.SimpleNamespace(
                            num_regs=80, rpw=rpw, tt=tt, scaled=scaled, offset=offset, ctas=ctas))
    monkeypatch.setattr(dqc, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(dqc, "_wave", dqc._wave.__wrapped__)
    monkeypatch.setattr(nvrtc, "device_index", lambda t: 0)
    monkeypatch.setattr(nvrtc, "_FAILED", set())
    monkeypatch.setattr(nvrtc, "launch", lambda kern, grid, block, args, dev, shared_mem=0, pdl=False:
                        launched.append((kern.rpw, kern.tt, grid, block, shared_mem,
                                         *(int(a) for a in args[6:9]), pdl)))

    def launch(t, n, k):
        qs = torch.zeros(n, k, dtype=torch.int8)
        d = torch.zeros(n, k // 32, dtype=torch.float16)
        assert dqc.launch_cuda_gemv(torch.zeros(t, k), qs, d, torch.zeros(t, n))
        *geometry, pdl = launched.pop()
        assert pdl  # the kernel waits for the kernel before (pdl_wait): it may start early
        return tuple(geometry)

    def launch_scaled(t, n, k):  # dense_scaled's form with offsets: each token's chunk sums staged too
        qs = torch.zeros(n, k, dtype=torch.int8)
        s_, b = torch.zeros(n, k // 16), torch.zeros(n, k // 16)
        assert dqc.launch_cuda_gemv(torch.zeros(t, k), qs, s_, torch.zeros(t, n), offset=b)
        return launched.pop()[:-1]

    # (RPW, TT, grid, block, shared bytes, n_tok, N, token groups)
    assert launch(1, 12352, 2048) == (1, 1, (396,), 256, 8192, 1, 12352, 1)  # 3 CTAs an SM by registers
    assert launch(16, 12352, 2048) == (1, 4, (396,), 256, 32768, 16, 12352, 4)  # 99 CTAs a token group
    assert launch(5, 2048, 4096) == (1, 3, (396,), 256, 49152, 5, 2048, 2)  # 198 CTAs a group of 3 tokens
    assert launch(1, 2048, 4096) == (1, 1, (256,), 256, 16384, 1, 2048, 1)  # a row a warp: 256 CTAs
    assert launch(1, 151936, 512) == (4, 1, (396,), 256, 2048, 1, 151936, 1)
    assert launch(1, 3, 32) == (1, 1, (1,), 256, 128, 1, 3, 1)
    assert launch_scaled(1, 12352, 2048) == (1, 1, (396,), 256, 8704, 1, 12352, 1)
    assert launch_scaled(5, 2048, 4096) == (1, 2, (396,), 256, 34816, 5, 2048, 3)  # 3 tokens: over 48 KiB
    with pytest.raises(ValueError, match="offsets go with float32"):
        dqc.launch_cuda_gemv(torch.zeros(1, 64), torch.zeros(2, 64, dtype=torch.int8),
                             torch.zeros(2, 2, dtype=torch.float16), torch.zeros(1, 2),
                             offset=torch.zeros(2, 4))
    assert not dqc.launch_cuda_gemv(torch.zeros(1, 48), torch.zeros(2, 48, dtype=torch.int8),
                                    torch.zeros(2, 1, dtype=torch.float16), torch.zeros(1, 2))  # K % 32
    # STRATA_GEMV_MIN_CTAS reaches the kernel's build (and its wave, from that kernel's registers)
    monkeypatch.setattr(nvrtc, "launch", lambda kern, grid, block, args, dev, shared_mem=0, pdl=False:
                        launched.append(kern.ctas))
    monkeypatch.setenv("STRATA_GEMV_MIN_CTAS", "3")
    dqc.launch_cuda_gemv(torch.zeros(1, 2048), torch.zeros(8, 2048, dtype=torch.int8),
                         torch.zeros(8, 64, dtype=torch.float16), torch.zeros(1, 8))
    assert launched.pop() == 3


def test_the_switch(monkeypatch):
    monkeypatch.setenv("STRATA_DENSE_CUDA", "0")
    assert not cuda_gemv_on()


def test_a_kernel_that_cannot_be_built_leaves_the_launch_to_triton(refusing_nvrtc, caplog):
    """None (q8_gemv then runs the Triton GEMV), one warning, no second try."""
    import strata_ray.kernels.dense_q8_cuda as dqc

    tries = refusing_nvrtc(dqc)
    with caplog.at_level("WARNING", logger="strata_ray.kernels.nvrtc"):
        assert dqc.cuda_gemv_kernel(2048, 1, 1, 0) is None
        assert dqc.cuda_gemv_kernel(2048, 1, 1, 0) is None
    assert tries == [(2048, 1, 1, 0, False, False, 1)]  # the last: STRATA_GEMV_MIN_CTAS (unset: 1)
    assert [r.getMessage() for r in caplog.records] == [
        "the CUDA C dense GEMV could not be built (RuntimeError: nvrtc: error: invalid value for "
        "--gpu-architecture); the Triton GEMV or the dequantized linear takes its launches"]


# ---- GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(1, 2048), (33, 96), (222, 512), (64, 4096), (1000, 2048), (2200, 2048),
                                 (5, 1280), (3, 32)])
def test_gpu_kernel_gives_the_twins_bits(n, k):
    pytest.importorskip("cupy")
    from strata_ray.kernels.dense_q8_cuda import launch_cuda_gemv

    qs, d = _matrix(n, k)
    w = Q8Weight(torch.from_numpy(qs), torch.from_numpy(d)).to("cuda")
    rng = np.random.default_rng(n + k)
    for t in (1, 3, 5, 16):  # 5: a ragged token group
        x = rng.standard_normal((t, k)).astype(F32)
        want = gemv_reference(x, qs, d)
        buf = torch.from_numpy(np.concatenate([np.zeros(1, F32), x.ravel()])).cuda()
        for xg in (buf[1:].view(t, k).clone(), buf[1:].view(t, k)):  # 16-byte aligned, then 4-byte only
            out = torch.full((t, n), float("nan"), device="cuda")
            assert launch_cuda_gemv(xg, w.qs, w.d, out)
            got = out.cpu().numpy()
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), (t, xg.data_ptr() % 16)


def test_the_register_cap_is_asked_for_only_where_set(monkeypatch):
    """STRATA_GEMV_MIN_CTAS adds MIN_CTAS to the options; unset, the options (so the code) are as before."""
    from strata_ray.kernels import dense_q8_cuda as dqc

    monkeypatch.delenv("STRATA_GEMV_MIN_CTAS", raising=False)
    assert dqc.min_ctas() == 1
    assert not any(o.startswith("-DMIN_CTAS") for o in dqc.build_options(4096, 1, 1, min_ctas=dqc.min_ctas()))
    monkeypatch.setenv("STRATA_GEMV_MIN_CTAS", "3")
    assert dqc.min_ctas() == 3 and dqc.build_options(4096, 1, 1, min_ctas=3)[-1] == "-DMIN_CTAS=3"
    assert "#ifdef MIN_CTAS" in dqc._SOURCE and "__launch_bounds__(WARPS * 32, MIN_CTAS)" in dqc._SOURCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(64, 4096), (2200, 2048), (1, 2048)])
def test_gpu_kernel_with_capped_registers_gives_the_twins_bits(monkeypatch, n, k):
    """Compiled for 3 CTAs an SM (STRATA_GEMV_MIN_CTAS=3: 80 registers, spills at 4096-wide rows): the same
    bits as the numpy twin, so the same as without the cap."""
    pytest.importorskip("cupy")
    from strata_ray.kernels.dense_q8_cuda import launch_cuda_gemv

    monkeypatch.setenv("STRATA_GEMV_MIN_CTAS", "3")
    qs, d = _matrix(n, k)
    w = Q8Weight(torch.from_numpy(qs), torch.from_numpy(d)).to("cuda")
    rng = np.random.default_rng(n + k)
    for t in (1, 3, 5):
        x = rng.standard_normal((t, k)).astype(F32)
        out = torch.full((t, n), float("nan"), device="cuda")
        assert launch_cuda_gemv(torch.from_numpy(x).cuda(), w.qs, w.d, out)
        assert np.array_equal(out.cpu().numpy().view(np.int32), gemv_reference(x, qs, d).view(np.int32)), t
