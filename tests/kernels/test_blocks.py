"""Block readers: fp16 decoding exact, numba integer weights == numpy spec, spec ~ gguf-py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TYPE_SETS, layer_for

from strata_ray.kernels.blocks import f16_to_f32, row_scales, unpack_row
from strata_ray.kernels.contract import Q4_0, Q4_K, Q6_K, Q8_0
from strata_ray.kernels.reference import dequantize_rows
from strata_ray.kernels.spec import decode_int_blocks


def test_f16_every_finite_half_exact():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = np.isfinite(bits.view(np.float16))
    want = bits.view(np.float16).astype(np.float32)
    lo, hi = (bits & 0xFF).astype(np.uint8), (bits >> 8).astype(np.uint8)
    got = np.array([f16_to_f32(a, b) for a, b in zip(lo[finite], hi[finite], strict=True)], np.float32)
    assert np.array_equal(got.view(np.uint32), want[finite].view(np.uint32))


@pytest.mark.parametrize("wtype", [Q8_0, Q4_0, Q4_K, Q6_K])
def test_unpack_matches_spec_and_gguf(wtype):
    name = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}[wtype]
    rows = layer_for(name).gate[0][:8]  # [8, RB]
    wi, d, dmin, m = decode_int_blocks(rows, wtype)
    nb = wi.shape[1]
    for r in range(len(rows)):
        w = np.empty(nb * 32, np.float32)
        unpack_row(rows[r], wtype, w, 32)
        assert np.array_equal(w, wi[r].reshape(-1).astype(np.float32))
        got = (np.empty(nb, np.float32), np.empty(nb, np.float32), np.empty(nb, np.int32))
        row_scales(rows[r], wtype, *got)
        for g, want in zip(got, (d[r], dmin[r], m[r]), strict=True):
            assert np.array_equal(g, want)
    # The integer form dequantizes to gguf-py's values (up to fp32 rounding of the products).
    deq = (wi * d[:, :, None] - (m * dmin)[:, :, None]).reshape(len(rows), -1)
    ref = dequantize_rows(rows, wtype)
    assert np.allclose(deq, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_type_sets_cover_every_quant_type():
    assert {t for ts in TYPE_SETS.values() for t in ts} == {Q8_0, Q4_0, Q4_K, Q6_K}
