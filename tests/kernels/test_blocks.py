"""Block readers: fp16 decoding exact, numba integer block dots and scales == numpy spec, spec ~ gguf-py."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from strata_ray.kernels.block_dots import (
    HALF_ROWS,
    HAS_AVX2,
    HAS_VNNI,
    ROWS,
    row_dots_intrinsic,
    tile_dots_intrinsic,
)
from strata_ray.kernels.blocks import f16_to_f32, row_block_ints, row_scales, tile_sums, tile_sums_half
from strata_ray.kernels.contract import Q4_0, Q4_K, Q6_K, Q8_0
from strata_ray.kernels.random_weights import random_blocks
from strata_ray.kernels.reference import dequantize_rows
from strata_ray.kernels.spec import act_quant_ref, decode_int_blocks, matmul_spec
from tests.kernels.layers import TYPE_SETS, layer_for

NAMES = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
# Byte offsets of the fp16 scales in a block / super-block, and the block size.
SCALE_AT = {Q8_0: ((0,), 34), Q4_0: ((0,), 18), Q4_K: ((0, 2), 144), Q6_K: ((208,), 210)}


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
    rows = random_blocks(rng, wtype, (4, n))
    wi, _, _, _ = decode_int_blocks(rows, wtype)
    q, _, s = act_quant_ref(rng.standard_normal((1, n)).astype(np.float32))
    for r in range(len(rows)):
        got = np.empty(n // 32, np.int32)
        row_block_ints(rows[r], wtype, q[0], s[0], got)
        assert np.array_equal(got, (wi[r] * q[0].reshape(-1, 32).astype(np.int32)).sum(axis=1))


def _edge_rows(rng, wtype, n):
    """ROWS rows of random blocks with edge values: subnormal, negative and zero fp16 scales, and for
    Q8_0 weight bytes of -128 (outside gguf's quantizer range but valid block bytes)."""
    rows = random_blocks(rng, wtype, (ROWS, n))
    offsets, size = SCALE_AT[wtype]
    halves = np.array([0x0001, 0x83FF, 0x0400, 0xB800, 0x0000, 0x3C00], np.uint16)
    halves = halves.view(np.uint8).reshape(-1, 2)
    for r in range(0, ROWS, 3):
        for k, blk in enumerate(range(0, rows.shape[1], size)):
            o = blk + offsets[(r + k) % len(offsets)]
            rows[r, o:o + 2] = halves[(r + k) % len(halves)]
    if wtype == Q8_0:
        rows[1, 2:34] = 0x80
        rows[2, 36:68] = 0x7F
    return rows


@njit
def _tile(w, wtype, aq, ad, asum, a):
    acc = np.full((2, ROWS), np.float32(np.nan))
    tile_sums(w, 0, wtype, aq, ad, asum, np.array([a], np.int64), acc)
    return acc[0]


@pytest.mark.parametrize("wtype", [Q8_0, Q4_0, Q4_K, Q6_K])
def test_tile_sums_match_spec_bitwise(wtype, rng):
    """The tile form (16 rows' ordered block sums, scale terms in vector form) == the numpy spec."""
    sizes = (256, 512) if wtype in (Q4_K, Q6_K) else (96, 256, 320)
    for n in sizes:
        rows = _edge_rows(rng, wtype, n)
        x = rng.standard_normal((3, n)).astype(np.float32) * np.float32(3.0)
        x[1, : n // 2] = 127.0
        x[2, 32:64] = 0.0
        q, d, s = act_quant_ref(x)
        want = matmul_spec(rows, wtype, x)  # [3, ROWS]
        for a in range(len(x)):
            got = _tile(rows, wtype, q, d, s, a)
            assert np.array_equal(got.view(np.uint32), want[a].view(np.uint32)), (NAMES[wtype], n, a)


@njit
def _tile_many(w, wtype, aq, ad, asum, arow):
    acc = np.full((arow.shape[0] + 1, ROWS), np.float32(np.nan))
    tile_sums(w, 0, wtype, aq, ad, asum, arow, acc)
    return acc


@pytest.mark.parametrize("wtype", [Q8_0, Q4_0, Q4_K, Q6_K])
def test_tile_sums_several_tokens_match_spec_bitwise(wtype, rng):
    """1, 3, 5 and 33 activation rows per tile call (chunks of 1..TOKENS sharing the unpacked weights,
    rows in any order, one row twice): each token's sums == the spec's, and rows past them untouched."""
    n = 320 if wtype in (Q8_0, Q4_0) else 512  # Q8_0/Q4_0: 10 blocks, so the one-block tail too
    rows = _edge_rows(rng, wtype, n)
    x = rng.standard_normal((40, n)).astype(np.float32) * np.float32(3.0)
    x[7] = -1.0
    q, d, s = act_quant_ref(x)
    want = matmul_spec(rows, wtype, x)  # [40, ROWS]
    for count in (1, 3, 5, 33):
        arow = rng.permutation(40)[:count].astype(np.int64)
        if count > 3:
            arow[2] = arow[count - 1]
        got = _tile_many(rows, wtype, q, d, s, arow)
        assert np.array_equal(got[:count].view(np.uint32), want[arow].view(np.uint32)), (NAMES[wtype], count)
        assert np.isnan(got[count]).all()


@njit
def _half_many(w, r0, wtype, aq, ad, asum, arow):
    acc = np.full((arow.shape[0] + 1, HALF_ROWS), np.float32(np.nan))
    tile_sums_half(w, r0, wtype, aq, ad, asum, arow, acc)
    return acc


@pytest.mark.parametrize("wtype", [Q8_0, Q4_0, Q4_K, Q6_K])
def test_half_tiles_are_the_whole_tiles_halves(wtype, rng):
    """tile_sums_half (8 rows: the CPU team's gate/up units) at rows 0 and 8 == the whole tile's two halves,
    bit for bit, for 1, 5 and 33 activation rows (chunks of 1..TOKENS, the one-block tail on Q8_0/Q4_0);
    rows past the activations untouched."""
    n = 320 if wtype in (Q8_0, Q4_0) else 512
    rows = _edge_rows(rng, wtype, n)
    x = rng.standard_normal((40, n)).astype(np.float32) * np.float32(3.0)
    q, d, s = act_quant_ref(x)
    for count in (1, 5, 33):
        arow = rng.permutation(40)[:count].astype(np.int64)
        whole = _tile_many(rows, wtype, q, d, s, arow)
        for r0 in (0, HALF_ROWS):
            got = _half_many(rows, r0, wtype, q, d, s, arow)
            half = whole[:count, r0:r0 + HALF_ROWS]
            assert np.array_equal(got[:count].view(np.uint32), half.view(np.uint32)), (wtype, count, r0)
            assert np.isnan(got[count]).all()


def test_a_tile_is_whole_sums_of_rows():
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        tile_dots_intrinsic(Q4_0, rows=12)


@pytest.mark.parametrize("form", ["generic", "avx2", "vnni"])
@pytest.mark.parametrize("wtype", [Q8_0, Q4_0, Q4_K, Q6_K])
def test_row_dots_every_form_agrees(wtype, form, rng):
    """Both forms of the 4-product sums (vpdpbusd and widened multiplies) give the spec's integers."""
    if (form == "vnni" and not HAS_VNNI) or (form == "avx2" and not HAS_AVX2):
        pytest.skip(f"this CPU cannot run the {form} form")
    dots = row_dots_intrinsic(wtype, form=form)

    @njit
    def run(row, aq, asum, out):
        dots(row, 0, aq, asum, out)

    rows = _edge_rows(rng, wtype, 256)
    wi, _, _, _ = decode_int_blocks(rows, wtype)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[1] = -1.0
    q, _, s = act_quant_ref(x)
    for r in range(len(rows)):
        for a in range(len(x)):
            got = np.empty(8, np.int32)
            run(rows[r], q[a], s[a], got)
            assert np.array_equal(got, (wi[r] * q[a].reshape(8, 32).astype(np.int32)).sum(axis=1))
