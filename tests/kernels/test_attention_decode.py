"""Split-K attention of a few queries over the KV cache (strata_ray/kernels/attention_decode.py).

The kernels run on the GPU (python -m pytest -m gpu tests/kernels/test_attention_decode.py) and under the
Triton interpreter (opt-in):
    STRATA_TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_attention_decode.py
"""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.attention_decode import (
    BEFORE_39,
    TILES,
    DeviceAttention,
    _dot_precision,
    attention_decode,
    attn_tiles_value,
    tiles_now,
)
from strata_ray.model import ops
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()


def _qkv(T, S, H, Hkv, D, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    k, v = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    return q.to(device), k.to(device), v.to(device)


def _reference(q, k, v, off, scale):
    with torch.no_grad():  # plain torch on the CPU: never the kernel under test
        return ops.attention(q.cpu(), k.cpu(), v.cpu(), off, scale)


def _cases(device, H, Hkv, D, shapes):
    scale = D**-0.5
    for T, S in shapes:
        q, k, v = _qkv(T, S, H, Hkv, D, device, seed=T * 1000 + S)
        off = S - T
        got = attention_decode(q, k, v, off, scale)
        assert got.shape == (T, H, D) and torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu(), _reference(q, k, v, off, scale), rtol=1e-4, atol=2e-5)
        for t in {0, T - 1}:  # a token alone, over the keys it sees, gives its row of the batch
            alone = attention_decode(q[t : t + 1], k[: off + t + 1], v[: off + t + 1], off + t, scale)
            assert torch.equal(alone, got[t : t + 1]), (T, S, t)


def test_bad_shapes():
    q, k, v = _qkv(1, 4, 4, 3, 32, "cpu")
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention_decode(q, k, v, 3, 1.0)
    q, k, v = _qkv(2, 4, 4, 2, 32, "cpu")
    with pytest.raises(ValueError, match="S >= offset"):
        attention_decode(q, k, v, 3, 1.0)
    attn = DeviceAttention(4, 2, 32, 100, torch.device("cpu"))
    with pytest.raises(ValueError, match="q must be float32"):
        attn(q, torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError, match="64-byte aligned"):
        attn.table_row(k, torch.zeros(33)[1:])


def _device_cases(device, H, Hkv, D, positions, capacity, programs, T=1):
    """DeviceAttention over caches of `capacity` rows (more than the keys), appending each step's k, v at the
    position in a device cell: the bits of attention_decode over the keys so far, for each position (with
    `programs` programs a kv head, fewer than the splits: each walks several)."""
    attn = DeviceAttention(H, Hkv, D, capacity, torch.device(device), n_tok=T, programs=programs)
    caches = torch.full((2, capacity, Hkv, D), float("nan"), device=device)  # rows past the keys: never read
    table = torch.tensor(attn.table_row(caches[0], caches[1]), dtype=torch.int64, device=device)
    pos = torch.zeros(1, dtype=torch.int64, device=device)
    scale = D**-0.5
    for at in positions:
        q, k, v = _qkv(T, at + T, H, Hkv, D, device, seed=at)
        caches[:, :at] = torch.stack((k[:at], v[:at]))  # the keys before, as a cache holds them
        pos.fill_(at)
        attn.append(table, pos, k[at:], v[at:])
        assert torch.equal(caches[0, : at + T], k) and torch.equal(caches[1, : at + T], v)
        got = attn(q, table, pos, scale)
        assert torch.equal(got, attention_decode(q, k, v, at, scale)), (at, T)


# the default, a small split of 16-key steps pipelined with a head's values combined 16 a program, a long
# split of many tiles with 64 (past the interpreted heads' 32: clamped), and the default before session 39
# (two tiles a split, whole heads combined); the bits differ between forms, every form keeps a token's bits
# alone, in a window and in the graphs' form
TILE_FORMS = [str(TILES), "32x16x4x2x16", "128x32x4x3x64", str(BEFORE_39)]
each_tiling = pytest.mark.parametrize("tiles", TILE_FORMS)


def test_tiles_are_the_default_unless_set(monkeypatch):
    monkeypatch.delenv("STRATA_ATTN_TILES", raising=False)
    assert tiles_now() == TILES
    monkeypatch.setenv("STRATA_ATTN_TILES", "32x16x4x2x64")
    assert tiles_now() == (32, 16, 4, 2, 64) and str(tiles_now()) == "32x16x4x2x64"
    for bad in ("32x16x4x1", "32x64x4x1x64", "24x16x4x1x64", "32x16x16x1x64", "32x16x4x0x64", "x16x4x1x64",
                "32x16x4x1x48", "32x16x4x1x64x1", "32x16x4x1x2048"):
        with pytest.raises(ValueError, match="SPLITxBKxWARPSxSTAGESxDC"):
            attn_tiles_value(bad)
    monkeypatch.setenv("STRATA_ATTN_TILES", "")  # set but empty: the default, as config.py reads it
    assert tiles_now() == TILES
    monkeypatch.setenv("STRATA_ATTN_TILES", "64x32")
    with pytest.raises(ValueError, match=r"^STRATA_ATTN_TILES: invalid value '64x32' \(allowed: SPLITx"):
        tiles_now()


def test_device_attention_keeps_the_tiles_it_was_made_with(monkeypatch):
    monkeypatch.setenv("STRATA_ATTN_TILES", "32x16x4x2x16")
    attn = DeviceAttention(4, 2, 32, 100, torch.device("cpu"))
    monkeypatch.setenv("STRATA_ATTN_TILES", "128x32x4x1x64")
    assert attn.tiles == (32, 16, 4, 2, 16) and attn.ns == 4  # ceil(100 / 32) splits in its scratch


@interpret
def test_interpreted_device_attention_launches_with_its_own_tiles(monkeypatch):
    """A DeviceAttention made under one tiling and called after the variable changed gives the bits of its
    own tiling (a graph captured at load keeps them), not the new one's."""
    pytest.importorskip("triton")
    monkeypatch.setenv("STRATA_ATTN_TILES", "32x16x4x2x16")
    H, Hkv, D, at = 4, 2, 32, 150
    attn = DeviceAttention(H, Hkv, D, 256, torch.device("cpu"), programs=3)
    caches = torch.zeros((2, 256, Hkv, D))
    table = torch.tensor(attn.table_row(caches[0], caches[1]), dtype=torch.int64)
    q, k, v = _qkv(1, at + 1, H, Hkv, D, "cpu", seed=7)
    caches[:, : at + 1] = torch.stack((k, v))
    own = attention_decode(q, k, v, at, D**-0.5)
    monkeypatch.setenv("STRATA_ATTN_TILES", "128x64x8x1x32")
    other = attention_decode(q, k, v, at, D**-0.5)
    got = attn(q, table, torch.tensor([at]), D**-0.5)
    assert torch.equal(got, own) and not torch.equal(own, other)


@interpret
@each_tiling
def test_interpreted_device_attention_gives_attention_decode_bits(monkeypatch, tiles):
    pytest.importorskip("triton")
    monkeypatch.setenv("STRATA_ATTN_TILES", tiles)
    split = tiles_now().split
    _device_cases("cpu", 4, 2, 32, [0, 32, 221, 2 * split + 40], capacity=max(6 * split, 256), programs=2)
    _device_cases("cpu", 4, 2, 32, [5, 3 * split], capacity=4 * split, programs=3, T=3)


@interpret
@each_tiling
def test_interpreted_matches_reference(monkeypatch, tiles):
    pytest.importorskip("triton")
    monkeypatch.setenv("STRATA_ATTN_TILES", tiles)
    split = tiles_now().split
    # up to 18 splits: the combine's second chunk of 16
    shapes = [(1, 1), (1, 33), (3, 222), (2, split + 1), (5, 2 * split + 40), (2, 17 * split + 9)]
    _cases("cpu", 4, 2, 32, shapes)


def test_dot_precision_is_tf32x3_unless_set(monkeypatch):
    monkeypatch.delenv("STRATA_ATTN_DOT", raising=False)
    assert _dot_precision() == "tf32x3"
    monkeypatch.setenv("STRATA_ATTN_DOT", "ieee")
    assert _dot_precision() == "ieee"
    monkeypatch.setenv("STRATA_ATTN_DOT", "tf32")
    with pytest.raises(ValueError, match="tf32x3 or ieee"):
        _dot_precision()


# both forms of the key tiles' products (the tensor cores' tf32x3, the default; float32 FMAs)
both_precisions = pytest.mark.parametrize("precision", ["tf32x3", "ieee"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@both_precisions
@each_tiling
def test_gpu_matches_reference_80b_heads(monkeypatch, precision, tiles):
    """The 80b-a3b's heads (16 query heads over 2 kv heads of 256), 1 to 16 tokens, up to 8K keys."""
    monkeypatch.setenv("STRATA_ATTN_DOT", precision)
    monkeypatch.setenv("STRATA_ATTN_TILES", tiles)
    _cases("cuda", 16, 2, 256, [(1, 1), (1, 33), (16, 222), (3, 1000), (1, 8192), (16, 8200)])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@both_precisions
@each_tiling
def test_gpu_device_attention_gives_attention_decode_bits(monkeypatch, precision, tiles):
    """The 80b-a3b's heads: DeviceAttention (the decode graphs' form) against attention_decode, bit for bit,
    up to 8K keys, with 256 programs a kv head and with 7 (each walking many splits)."""
    monkeypatch.setenv("STRATA_ATTN_DOT", precision)
    monkeypatch.setenv("STRATA_ATTN_TILES", tiles)
    _device_cases("cuda", 16, 2, 256, [0, 1, 33, 1000, 8191], capacity=8300, programs=256)
    _device_cases("cuda", 16, 2, 256, [222, 8191], capacity=8300, programs=7)
