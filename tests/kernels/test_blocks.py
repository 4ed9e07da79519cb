"""Block readers: fp16 decoding exact, numba integer block dots and scales == numpy spec, spec ~ gguf-py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TYPE_SETS, layer_for

from strata_ray.kernels.blocks import f16_to_f32, row_block_ints, row_scales
from strata_ray.kernels.contract import Q4_0, Q4_K, Q6_K, Q8_0
from strata_ray.kernels.reference import dequantize_rows
from strata_ray.kernels.spec import act_quant_ref, decode_int_blocks


def test_f16_every_finite_half_exact():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = np.isfinite(bits.view(np.float16))
    want = bits.view(np.float16).astype(np.float32)
    lo, hi = (bits & 0xFF).astype(np.uint8), (bits >> 8).astype(np.uint8)
    got = np.array([f16_to_f32(a, b) for a, b in zip(lo[finite], hi[finite], strict=True)], np.float32)
    assert np.array_equal(got.view(np.uint32), want[finite].view(np.uint32))


@pytest.mark.parametrize("wtype", [Q8_0, Q4_0, Q4_K, Q6_K])
def test_block_dots_and_scales_match_spec_and_gguf(wtype, rng):
    name = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}[wtype]
    rows = layer_for(name).gate[0][:8]  # [8, RB]
    wi, d, dmin, m = decode_int_blocks(rows, wtype)
    nb = wi.shape[1]
    # Extreme codes (+-127 everywhere, zero blocks) as well as random ones.
    x = rng.standard_normal((4, nb * 32)).astype(np.float32)
    x[1] = 1.0
    x[2] = -1.0
    x[3, :64] = 0.0
    q, _, s = act_quant_ref(x)
    for r in range(len(rows)):
        for a in range(len(x)):
            got = np.empty(nb, np.int32)
            row_block_ints(rows[r], wtype, q[a], s[a], got)
            want = (wi[r] * q[a].reshape(nb, 32).astype(np.int32)).sum(axis=1)
            assert np.array_equal(got, want)
        got = (np.empty(nb, np.float32), np.zeros(nb, np.float32), np.zeros(nb, np.int32))
        row_scales(rows[r], wtype, *got)
        for g, want in zip(got, (d[r], dmin[r], m[r]), strict=True):
            assert np.array_equal(g, want)
    # The integer form dequantizes to gguf-py's values (up to fp32 rounding of the products).
    deq = (wi * d[:, :, None] - (m * dmin)[:, :, None]).reshape(len(rows), -1)
    ref = dequantize_rows(rows, wtype)
    assert np.allclose(deq, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_type_sets_cover_every_quant_type():
    assert {t for ts in TYPE_SETS.values() for t in ts} == {Q8_0, Q4_0, Q4_K, Q6_K}


@pytest.mark.parametrize("wtype", [Q8_0, Q4_0])
@pytest.mark.parametrize("n", [96, 320])
def test_block_dots_rows_not_a_multiple_of_8_blocks(wtype, n, rng):
    """Rows of 3 and 10 blocks: the one-block tail path of the grouped dots."""
    from strata_ray.kernels.random_weights import random_blocks

    rows = random_blocks(rng, wtype, (4, n))
    wi, _, _, _ = decode_int_blocks(rows, wtype)
    q, _, s = act_quant_ref(rng.standard_normal((1, n)).astype(np.float32))
    for r in range(len(rows)):
        got = np.empty(n // 32, np.int32)
        row_block_ints(rows[r], wtype, q[0], s[0], got)
        assert np.array_equal(got, (wi[r] * q[0].reshape(-1, 32).astype(np.int32)).sum(axis=1))
