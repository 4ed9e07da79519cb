"""KVCache (strata_ray/model/state.py): appends, and the reserve / advance pair the decode graphs use."""

from __future__ import annotations

import pytest
import torch

from strata_ray.model.state import KVCache


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)


def test_append_returns_everything_so_far_across_growth():
    cache, ks, vs = KVCache(), [], []
    for step, n in enumerate((3, 1, 70, 1, 200)):  # past 64, then past 128 and 256: the capacity doubles
        k, v = _rows(n, step)
        ks.append(k)
        vs.append(v)
        k_all, v_all = cache.append(k, v)
        assert torch.equal(k_all, torch.cat(ks)) and torch.equal(v_all, torch.cat(vs))
    assert cache.length == 275


def test_reserve_then_write_then_advance_is_an_append():
    cache, ref = KVCache(), KVCache()
    k, v = _rows(5, 0)
    cache.append(k, v)
    ref.append(k, v)
    at = cache.reserve(6, k)
    assert at == cache.reserve(6, k)  # no growth, no move
    keys, values = cache.buffers()
    assert (keys.data_ptr(), values.data_ptr()) == at and keys.shape[0] >= 6
    k1, v1 = _rows(1, 1)
    keys[5:6], values[5:6] = k1, v1  # what the graph's append kernel writes
    cache.advance(1)
    k_all, v_all = ref.append(k1, v1)
    assert cache.length == 6 and torch.equal(cache.buffers()[0][:6], k_all)
    assert torch.equal(cache.buffers()[1][:6], v_all)
    moved = cache.reserve(1000, k)  # growth moves the buffers and keeps the rows
    assert moved != at and torch.equal(cache.buffers()[0][:6], k_all)


def test_reserve_on_an_empty_cache_and_refusals():
    cache = KVCache()
    with pytest.raises(ValueError, match="before any reserve"):
        cache.buffers()
    with pytest.raises(ValueError, match="past the 0 tokens reserved"):
        cache.advance(1)
    k, _ = _rows(1, 0)
    cache.reserve(1, k)
    assert cache.buffers()[0].shape[1:] == k.shape[1:] and cache.length == 0
    cache.advance(1)
    with pytest.raises(ValueError, match="past the 64 tokens reserved"):
        cache.advance(64)
