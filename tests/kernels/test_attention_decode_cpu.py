"""One query's attention as one numba call (strata_ray/kernels/attention_decode_cpu.py) against its torch twin
ops.attention_one_query at awkward key counts and head groupings; which calls take it."""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.attention_decode_cpu import ONE_QUERY_MAX_WORK, one_query_cpu, one_query_cpu_serves
from strata_ray.model import ops


def _inputs(H, Hkv, D, S, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, D, generator=g)
    k, v = torch.randn(2, S, Hkv, D, generator=g) * 2
    return q, k, v


@pytest.mark.parametrize(("H", "Hkv", "D"), [(4, 2, 32), (3, 1, 20), (16, 2, 128), (2, 2, 8)])
@pytest.mark.parametrize("S", [1, 33, 222])
def test_equals_the_reference_to_rounding(H, Hkv, D, S):
    q, k, v = _inputs(H, Hkv, D, S, seed=S + D)
    got = one_query_cpu(q, k, v, D**-0.5)
    assert got.shape == (1, H, D) and torch.isfinite(got).all()
    torch.testing.assert_close(got, ops.attention_one_query(q, k, v, D**-0.5), rtol=1e-4, atol=1e-5)


def test_a_head_reads_its_own_kv_head_and_strided_caches_their_values():
    q, k, v = _inputs(4, 2, 16, 9, seed=1)
    got = one_query_cpu(q, k, v, 0.25)
    for h in range(4):  # head h reads kv head h // 2: alone, as a one-head attention
        alone = one_query_cpu(q[:, h : h + 1], k[:, h // 2 : h // 2 + 1], v[:, h // 2 : h // 2 + 1], 0.25)
        assert torch.equal(alone[0, 0], got[0, h])
    wide = torch.cat((k, v), dim=1)  # k, v as strided views of one buffer
    assert torch.equal(one_query_cpu(q, wide[:, :2], wide[:, 2:], 0.25), got)


def test_refuses_shapes_that_do_not_match():
    q, k, v = _inputs(4, 2, 16, 5, seed=2)
    for bad in ((q, k, v[:4]), (q, k[..., :8], v[..., :8]), (q, k[:0], v[:0]), (q[:, :3], k, v)):
        with pytest.raises(ValueError, match="one_query_cpu"):
            one_query_cpu(*bad, 1.0)


def test_which_calls_take_it(monkeypatch):
    q, k, v = _inputs(4, 2, 32, 40, seed=3)
    assert one_query_cpu_serves(q, k, v)
    assert not one_query_cpu_serves(q.double(), k.double(), v.double())
    assert not one_query_cpu_serves(q, k, v.double())
    assert not one_query_cpu_serves(q, k[:0], v[:0])
    assert not one_query_cpu_serves(q[:, :3], k, v)  # heads that do not group over the kv heads
    long = torch.zeros(ONE_QUERY_MAX_WORK // (4 * 32) + 1, 2, 32)  # past the bound: torch's batched products
    assert not one_query_cpu_serves(q, long, long)
    # anything autograd tracks keeps the torch form (its gradient flows): the query, or the cache alone
    assert not one_query_cpu_serves(q.clone().requires_grad_(), k, v)
    assert not one_query_cpu_serves(q, k, v.clone().requires_grad_())
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert not one_query_cpu_serves(q, k, v)


def test_ops_attention_takes_it_for_a_decode_token(monkeypatch):
    q, k, v = _inputs(4, 2, 32, 40, seed=4)
    with torch.inference_mode():
        assert torch.equal(ops.attention(q, k, v, 39, 0.125), one_query_cpu(q, k, v, 0.125))
        monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
        assert torch.equal(ops.attention(q, k, v, 39, 0.125), ops.attention_one_query(q, k, v, 0.125))
