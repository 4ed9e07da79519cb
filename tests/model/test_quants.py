"""Block formats: dequantize equals gguf.quants.dequantize bit for bit; quantize round trips; error lines."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from strata_ray.model import quants
from strata_ray.model.gguf_file import TensorInfo
from strata_ray.model.hparams import ModelFormatError

Q = gguf.GGMLQuantizationType
SUPPORTED_LINE = "(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K)"


def random_blocks(qtype: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for n_blocks blocks; every fp16 scale field finite (a NaN/inf d is no real block)."""
    _, size = quants.BLOCK[qtype]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    f16_offsets = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208], Q.F16: [0]}.get(qtype, [])
    for off in f16_offsets:
        d = rng.uniform(-2, 2, n_blocks).astype(np.float16)
        b[:, off : off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.BF16:  # keep exponents finite
        b[:, 1] &= 0x7E
    if qtype == Q.F32:
        b[:, 3] &= 0x7E
    return b


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K])
def test_dequantize_bit_exact_vs_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    elems, size = quants.BLOCK[qtype]
    per_row = 512 // elems if elems > 1 else 64
    rows = 6
    raw = random_blocks(qtype, rows * per_row, rng).reshape(rows, per_row * size)  # uint8 [rows, row_bytes]
    shape = (2, 3, per_row * elems)
    ours = quants.dequantize(raw.reshape(2, 3, -1), qtype, shape)
    typed = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype)
    ref = gguf.quants.dequantize(raw.view(typed) if typed else raw, qtype).reshape(shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))  # same bits, not just close


def test_dequantize_accepts_typed_views():
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    np.testing.assert_array_equal(quants.dequantize(x, Q.F32, (2, 32)), x)
    np.testing.assert_array_equal(
        quants.dequantize(x.astype(np.float16), Q.F16, (2, 32)), x.astype(np.float16)
    )


# rms error of a standard-normal row after a round trip (the 4-bit formats step ~range/15)
ROUND_TRIP_RMS = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.12, Q.Q4_K: 0.12, Q.Q6_K: 0.03}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_RMS))
def test_quantize_round_trip(qtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 512)).astype(np.float32)
    q = quants.quantize(x, qtype)
    assert q.dtype == np.uint8 and q.shape == (3, 4, quants.row_bytes(512, qtype))
    y = quants.dequantize(q, qtype, x.shape)
    typed = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype)
    ref = gguf.quants.dequantize(q.view(typed) if typed else q, qtype)  # blocks are valid for ggml too
    np.testing.assert_array_equal(y, ref)
    rms = float(np.sqrt(np.mean((y - x) ** 2)))
    assert rms <= ROUND_TRIP_RMS[qtype], rms


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0])
def test_quantize_matches_gguf_where_gguf_can(qtype):
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    np.testing.assert_array_equal(quants.quantize(x, qtype), gguf.quants.quantize(x, qtype).view(np.uint8))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quant_encoder_edge_rows(qtype):
    rows = np.zeros((4, 256), dtype=np.float32)
    rows[1] = 3.0  # constant positive
    rows[2] = np.linspace(-5, -1, 256)  # all negative
    rows[3, ::2] = 1e-3  # tiny sub-blocks next to ...
    rows[3, 128:] = 50.0  # ... large ones
    y = quants.dequantize(quants.quantize(rows, qtype), qtype, rows.shape)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y[0], 0)
    np.testing.assert_allclose(y[1:3], rows[1:3], atol=0.2)
    np.testing.assert_allclose(y[3, 128:], 50.0, rtol=0.05)


def test_q6_k_scales_are_signed():
    """An all-negative extreme must survive: q spans -32..31 and the int8 scale carries the sign."""
    x = np.full((1, 256), -1.0, dtype=np.float32)
    x[0, 0] = 1.0
    y = quants.dequantize(quants.quantize(x, Q.Q6_K), Q.Q6_K, x.shape)
    np.testing.assert_allclose(y, x, atol=0.05)


def test_block_table_and_row_bytes():
    assert quants.BLOCK[Q.Q8_0] == (32, 34) and quants.BLOCK[Q.Q4_K] == (256, 144)
    assert quants.BLOCK[Q.Q6_K] == (256, 210) and quants.BLOCK[Q.BF16] == (1, 2)
    assert quants.row_bytes(512, Q.Q4_0) == 16 * 18 and quants.row_bytes(512, Q.IQ2_XXS) == 2 * 66
    with pytest.raises(
        ModelFormatError, match=r"^row of 100 elements is not a multiple of the Q8_0 block \(32\)$"
    ):
        quants.row_bytes(100, Q.Q8_0)
    assert quants.type_name(12) == "Q4_K" and quants.type_name(999) == "type999"


def test_unsupported_type_names_tensor_and_type():
    data = np.zeros((2, 66), dtype=np.uint8)
    info = TensorInfo("blk.0.ffn_up_exps.weight", int(Q.IQ2_XXS), (2, 256), data, data.nbytes)
    with pytest.raises(ModelFormatError) as e:
        quants.dequantize_tensor(info)
    assert str(e.value) == f"tensor blk.0.ffn_up_exps.weight has unsupported type IQ2_XXS {SUPPORTED_LINE}"
    with pytest.raises(ModelFormatError, match=r"^quantize target has unsupported type Q5_K"):
        quants.quantize(np.zeros((1, 256), np.float32), Q.Q5_K)


def test_dequantize_tensor_reads_info(tmp_path):
    x = np.random.default_rng(5).standard_normal((8, 256)).astype(np.float32)
    q = quants.quantize(x, Q.Q4_K)
    info = TensorInfo("t", int(Q.Q4_K), x.shape, q, q.nbytes)
    np.testing.assert_array_equal(quants.dequantize_tensor(info), quants.dequantize(q, Q.Q4_K, x.shape))
