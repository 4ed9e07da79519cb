"""The numba RMSNorm rows (strata_ray/kernels/norm_cpu.py) against their torch reference twin at awkward
sizes, batch invariance, the add's exact sum, the out buffers; which calls take them."""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.norm_cpu import add_rms_norm_cpu, cpu_norm_serves, rms_norm_cpu
from strata_ray.model import ops

EPS = 1e-6


def _inputs(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    return x, w


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", [(1, 256), (33, 7), (222, 2049), (1, 4, 32), (33, 3, 24), (5, 2, 3, 9)])
def test_rows_equal_the_reference_to_rounding(shape):
    x, w = _inputs(shape, seed=sum(shape))
    got = rms_norm_cpu(x, w, EPS)
    assert got.shape == x.shape and got.dtype == torch.float32
    _close(got, ops.rms_norm_reference(x, w, EPS))


def test_a_row_does_not_depend_on_the_others():
    x, w = _inputs((33, 300), seed=1)
    whole = rms_norm_cpu(x, w, EPS)
    for t in (0, 1, 32):
        assert torch.equal(rms_norm_cpu(x[t : t + 1], w, EPS), whole[t : t + 1])
    s, normed = add_rms_norm_cpu(x, x.flip(0), w, EPS)
    for t in (0, 17):
        s1, n1 = add_rms_norm_cpu(x[t : t + 1], x.flip(0)[t : t + 1], w, EPS)
        assert torch.equal(s1, s[t : t + 1]) and torch.equal(n1, normed[t : t + 1])


@pytest.mark.parametrize("T", [1, 33, 222])
def test_the_add_is_torchs_sum_and_the_norm_its_twins(T):
    h, w = _inputs((T, 130), seed=T)
    d = torch.randn(T, 130, generator=torch.Generator().manual_seed(T + 1))
    s, normed = add_rms_norm_cpu(h, d, w, EPS)
    assert torch.equal(s, h + d)
    assert torch.equal(normed, rms_norm_cpu(h + d, w, EPS))
    _close(normed, ops.rms_norm_reference(h + d, w, EPS))


def test_out_buffers_get_the_same_bits():
    x, w = _inputs((3, 64), seed=5)
    want = rms_norm_cpu(x, w, EPS)
    out = torch.full_like(x, float("nan"))
    assert rms_norm_cpu(x, w, EPS, out=out) is out and torch.equal(out, want)
    inplace = x.clone()
    assert torch.equal(rms_norm_cpu(inplace, w, EPS, out=inplace), want)  # out may be x itself
    d = torch.randn(3, 64)
    bufs = (torch.full_like(x, float("nan")), torch.full_like(x, float("nan")))
    got = add_rms_norm_cpu(x, d, w, EPS, out=bufs)
    assert got[0] is bufs[0] and got[1] is bufs[1]
    want_s, want_n = add_rms_norm_cpu(x, d, w, EPS)
    assert torch.equal(bufs[0], want_s) and torch.equal(bufs[1], want_n)


def test_strided_inputs_are_read_as_their_values():
    """The attention's q heads are a strided view of the projection ([T, H, 2D] -> [..., :D])."""
    qg, w = _inputs((2, 4, 48), seed=9)
    q = qg[..., :24]
    assert not q.is_contiguous()
    assert torch.equal(rms_norm_cpu(q, w[:24], EPS), rms_norm_cpu(q.contiguous(), w[:24], EPS))
    assert torch.equal(qg[..., :24], q)  # the input untouched


def test_which_calls_take_it(monkeypatch):
    x, w = torch.zeros(1, 8), torch.ones(8)
    assert cpu_norm_serves(x, w, 1) and cpu_norm_serves(torch.zeros(16, 8), w, 16)
    assert not cpu_norm_serves(torch.zeros(17, 8), w, 17)  # a prompt chunk: the reference
    assert not cpu_norm_serves(x.double(), w.double(), 1)
    assert not cpu_norm_serves(x, torch.ones(4), 1)  # weights of another length
    assert not cpu_norm_serves(x, torch.ones(1, 8), 1)
    assert not cpu_norm_serves(torch.zeros(1, 0), torch.ones(0), 1)
    assert not cpu_norm_serves(torch.zeros(1, 8, requires_grad=True), w, 1)  # training: autograd's ops
    assert not cpu_norm_serves(x, torch.ones(8, requires_grad=True), 1)
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert not cpu_norm_serves(x, w, 1)


def test_ops_take_it_for_decode_windows_only(monkeypatch):
    x, w = _inputs((16, 96), seed=3)
    d = torch.randn(16, 96)
    with torch.inference_mode():
        assert torch.equal(ops.rms_norm(x, w, EPS), rms_norm_cpu(x, w, EPS))
        assert torch.equal(ops.add_rms_norm(x, d, w, EPS)[1], add_rms_norm_cpu(x, d, w, EPS)[1])
        x17 = torch.cat((x, x[:1]))
        assert torch.equal(ops.rms_norm(x17, w, EPS), ops.rms_norm_reference(x17, w, EPS))
        monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
        assert torch.equal(ops.rms_norm(x, w, EPS), ops.rms_norm_reference(x, w, EPS))
    # with autograd the reference's ops, whose gradient flows
    xg = x.clone().requires_grad_()
    monkeypatch.delenv("STRATA_FUSED_DECODE")
    ops.rms_norm(xg, w, EPS).sum().backward()
    assert xg.grad is not None
