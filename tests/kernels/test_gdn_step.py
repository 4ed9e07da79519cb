"""The fused GDN step (strata_ray/kernels/gdn_step.py) against its torch reference twin.

CPU tests run in CI (the reference is the model's GDN core). The fused kernels run on the GPU
(python -m pytest -m gpu tests/kernels/test_gdn_step.py) and under the Triton interpreter on CPU machines
with triton (tests/kernels/triton_interpret.py; STRATA_TRITON_INTERPRET=1 forces it).
"""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.gdn_step import GDNDims, gdn_columns, gdn_step, gdn_step_reference
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()
SMALL = GDNDims(nk=2, nv=4, dk=32, dv=32)  # r = 2: two v-heads read each k-head
REAL = GDNDims(nk=16, nv=32, dk=128, dv=128)  # the 80b-a3b's
SPLIT = GDNDims(nk=2, nv=4, dk=64, dv=64)  # columns of 16: four delta programs a head
KW = 4


def _inputs(dims: GDNDims, T: int, device: str = "cpu", seed: int = 0):
    """Random projections, states and weights of one layer, shaped as gdn_block passes them."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * dims.key_dim + dims.nv * dims.dv
    r = dims.nv // dims.nk

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    mixed, z, ba = rnd(T, C), rnd(T, dims.nv * dims.dv), rnd(T, dims.nk * 2 * r, scale=2.0)
    S, conv = rnd(dims.nv, dims.dk, dims.dv, scale=0.1), rnd(KW - 1, C)
    conv_w, norm_w = rnd(C, KW, scale=0.5), 1.0 + rnd(dims.dv, scale=0.1)
    ssm_a = -torch.exp(rnd(dims.nv, scale=0.5))
    dt_bias = rnd(dims.nv)
    return mixed, z, ba, S, conv, conv_w, ssm_a, dt_bias, norm_w


def _check_close(got, want):
    for name, a, b in zip(("o", "S", "conv"), got, want, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=2e-4, atol=2e-5, msg=name)


def test_reference_is_the_model_core_and_chains():
    """Two reference calls (the state carried) equal one call over both parts: the form gdn_block uses."""
    args = _inputs(SMALL, 7)
    mixed, z, ba, S, conv, *w = args
    o, S1, c1 = gdn_step_reference(mixed, z, ba, S, conv, *w, SMALL, 1e-6)
    o_a, S_a, c_a = gdn_step_reference(mixed[:3], z[:3], ba[:3], S, conv, *w, SMALL, 1e-6)
    o_b, S_b, c_b = gdn_step_reference(mixed[3:], z[3:], ba[3:], S_a, c_a, *w, SMALL, 1e-6, pos0=3)
    torch.testing.assert_close(torch.cat((o_a, o_b)), o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S_b, S1, rtol=1e-5, atol=1e-6)
    assert torch.equal(c_b, c1)  # the conv state is the last inputs, copied
    assert torch.equal(c1, mixed[-(KW - 1):])


def _fused_cases(device: str, dims: GDNDims, sizes):
    for T in sizes:
        args = _inputs(dims, T, device, seed=T)
        got = gdn_step(*args, dims, 1e-6)
        want = gdn_step_reference(*args, dims, 1e-6)
        _check_close(got, want)
        assert all(torch.isfinite(t).all() for t in got)
        # the new states written over the old ones (the decode graphs' buffers): the same bits
        mixed, z, ba, S, conv, *w = args
        S_in, conv_in = S.clone(), conv.clone()
        o_in, S_out, conv_out = gdn_step(mixed, z, ba, S_in, conv_in, *w, dims, 1e-6,
                                         state_out=(S_in, conv_in))
        assert S_out is S_in and conv_out is conv_in
        assert torch.equal(o_in, got[0]) and torch.equal(S_in, got[1]) and torch.equal(conv_in, got[2]), T
        # token by token, the state carried: the same bits as the whole call
        mixed, z, ba, S, conv, *w = args
        outs = []
        for t in range(T):
            o, S, conv = gdn_step(mixed[t : t + 1], z[t : t + 1], ba[t : t + 1], S, conv, *w, dims, 1e-6)
            outs.append(o)
        assert torch.equal(torch.cat(outs), got[0]), T
        assert torch.equal(S, got[1]) and torch.equal(conv, got[2]), T




@interpret
def test_interpreted_fused_step_matches_reference():
    pytest.importorskip("triton")
    _fused_cases("cpu", SMALL, (1, 2, 5))


@interpret
def test_interpreted_unsupported_dims():
    pytest.importorskip("triton")
    dims = GDNDims(nk=2, nv=4, dk=32, dv=16)
    with pytest.raises(ValueError, match="unsupported dims"):
        gdn_step(*_inputs(dims, 1), dims, 1e-6)


@interpret
@pytest.mark.parametrize("columns", ["16", "64"], ids=["4-programs-a-head", "whole-head"])
def test_interpreted_column_blocks_match_reference(monkeypatch, columns):
    """A head's value columns split over programs (the norm a launch of its own) or whole (the norm inside):
    both the reference's results, with the in-place and token-by-token checks of _fused_cases."""
    pytest.importorskip("triton")
    monkeypatch.setenv("STRATA_GDN_COLUMNS", columns)
    _fused_cases("cpu", SPLIT, (1, 3))


def test_columns_setting(monkeypatch):
    """The default, the whole head where the setting reaches dv, and one line for a bad value."""
    monkeypatch.delenv("STRATA_GDN_COLUMNS", raising=False)
    assert gdn_columns(128) == 32 and gdn_columns(32) == 32 and gdn_columns(16) == 16
    monkeypatch.setenv("STRATA_GDN_COLUMNS", "256")
    assert gdn_columns(128) == 128
    for bad in ("24", "\u00b2"):  # not a power of two; a digit int() refuses
        monkeypatch.setenv("STRATA_GDN_COLUMNS", bad)
        want = f"STRATA_GDN_COLUMNS: invalid value {bad!r} \\(allowed: a power of two"
        with pytest.raises(ValueError, match=want):
            gdn_columns(128)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("columns", ["16", "32", "128"])
@pytest.mark.parametrize("dims", [SMALL, REAL], ids=["small", "80b"])
def test_gpu_fused_step_matches_reference(monkeypatch, dims, columns):
    monkeypatch.setenv("STRATA_GDN_COLUMNS", columns)
    _fused_cases("cuda", dims, (1, 3, 16, 33))
