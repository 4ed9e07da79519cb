"""RMSNorm and the MoE combine in one launch each (strata_ray/kernels/fused_small.py).

CPU tests run in CI; the kernels run on the GPU (python -m pytest -m gpu tests/kernels/test_fused_small.py)
and under the Triton interpreter on CPU machines with triton (tests/kernels/triton_interpret.py;
STRATA_TRITON_INTERPRET=1 forces it).
"""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.fused_small import (
    FUSED_MAX_TOKENS,
    add_rms_norm_fused,
    add_rms_norm_reference,
    combine_fused,
    combine_reference,
    fused_enabled,
    gather_rows,
    rms_norm_fused,
    shared_act_fused,
    shared_act_reference,
)
from strata_ray.model import ops
from strata_ray.model.moe import combine_rows
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()


def _combine_inputs(n, k, e, shared, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    h, rows = torch.randn(n, e, generator=g), torch.randn(n, k, e, generator=g)
    w = torch.softmax(torch.randn(n, k, generator=g), -1)
    sh = torch.randn(n, e, generator=g) if shared else None
    return tuple(t.to(device) if t is not None else None for t in (h, rows, w, sh))


@pytest.mark.parametrize("shared", [False, True])
def test_combine_reference_is_the_decode_formula(shared):
    """combine_reference has the bits of moe.combine_rows + the residual, as the decode graph adds them."""
    h, rows, w, sh = _combine_inputs(3, 10, 64, shared)
    moe = combine_rows(rows, w) if sh is None else combine_rows(rows, w) + sh
    assert torch.equal(combine_reference(h, rows, w, sh), h + moe)


def _gather_inputs(n, k, e, device="cpu", seed=0):
    """Tier parts: GPU rows [n, k, e], CPU rows [m, e], hit / inv int32 [n, k] (misses numbered in order)."""
    g = torch.Generator().manual_seed(seed)
    hit = (torch.rand(n, k, generator=g) < 0.5).to(torch.int32)
    m = int((hit == 0).sum())
    inv = torch.zeros(n, k, dtype=torch.int32)
    inv[hit == 0] = torch.arange(m, dtype=torch.int32)
    cpu = torch.randn(max(m, 1), e, generator=g)
    return cpu.to(device), hit.to(device), inv.to(device)


def test_gather_rows_is_the_tiers_where():
    rows = torch.randn(2, 6, 40)
    cpu, hit, inv = _gather_inputs(2, 6, 40)
    got = gather_rows(rows, cpu, hit, inv)
    for t in range(2):
        for k in range(6):
            want = rows[t, k] if hit[t, k] else cpu[inv[t, k]]
            assert torch.equal(got[t, k], want)


def test_fused_enabled_policy(monkeypatch):
    x = torch.zeros(1)
    assert not fused_enabled(x, 1)  # CPU: the reference ops, always
    if HAS_CUDA:
        xc = x.cuda()
        assert fused_enabled(xc, FUSED_MAX_TOKENS) and not fused_enabled(xc, FUSED_MAX_TOKENS + 1)
        monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
        assert not fused_enabled(xc, 1)


def _norm_cases(device):
    for rows, n in [(1, 2048), (33, 256), (222, 100), (16 * 2, 256)]:
        g = torch.Generator().manual_seed(rows * n)
        x = (torch.randn(rows, n, generator=g) * 3).to(device)
        w = (1 + 0.1 * torch.randn(n, generator=g)).to(device)
        got = rms_norm_fused(x, w, 1e-6)
        torch.testing.assert_close(got, ops.rms_norm_reference(x, w, 1e-6), rtol=2e-6, atol=1e-6)
        for i in (0, rows - 1):  # a row alone gives its row of the batch
            assert torch.equal(rms_norm_fused(x[i : i + 1], w, 1e-6), got[i : i + 1])
        out = torch.full_like(x, float("nan"))  # into a given buffer: the same bits, every element written
        assert rms_norm_fused(x, w, 1e-6, out=out) is out and torch.equal(out, got)
    x3 = torch.randn(2, 16, 256).to(device)  # [T, H, D]: over the last dim
    w3 = torch.ones(256).to(device)
    want = ops.rms_norm_reference(x3, w3, 1e-6)
    torch.testing.assert_close(rms_norm_fused(x3, w3, 1e-6), want, rtol=2e-6, atol=1e-6)


def _combine_cases(device):
    cases = [(1, 10, 2048, True), (1, 1, 100, False), (3, 8, 1500, True), (16, 10, 2048, False)]
    for n, k, e, shared in cases:
        args = _combine_inputs(n, k, e, shared, device, seed=n * k)
        assert torch.equal(combine_fused(*args), combine_reference(*args)), (n, k, e, shared)
        h, rows, w, sh = args  # the tiers' form: rows gathered from two tiers in the kernel
        gather = _gather_inputs(n, k, e, device, seed=n + k)
        want = combine_reference(h, gather_rows(rows, *gather), w, sh)
        assert torch.equal(combine_fused(h, rows, w, sh, gather=gather), want), (n, k, e, shared)
        out = torch.full_like(h, float("nan"))  # into a given buffer: every element written
        assert combine_fused(h, rows, w, sh, gather=gather, out=out) is out and torch.equal(out, want)


def _add_norm_cases(device):
    for rows, n in [(1, 2048), (33, 256), (222, 100)]:
        g = torch.Generator().manual_seed(rows + n)
        h, d = (torch.randn(2, rows, n, generator=g) * 3).to(device)
        w = (1 + 0.1 * torch.randn(n, generator=g)).to(device)
        s, x = add_rms_norm_fused(h, d, w, 1e-6)
        assert torch.equal(s, h + d)  # torch's add, bit for bit
        assert torch.equal(x, rms_norm_fused(h + d, w, 1e-6))  # the fused norm's operations over the sum
        want_s, want_x = add_rms_norm_reference(h, d, w, 1e-6)
        assert torch.equal(s, want_s)
        torch.testing.assert_close(x, want_x, rtol=2e-6, atol=1e-6)
        out = (torch.full_like(h, float("nan")), torch.full_like(h, float("nan")))  # every element written
        assert add_rms_norm_fused(h, d, w, 1e-6, out=out) is out
        assert torch.equal(out[0], s) and torch.equal(out[1], x)
        i = rows - 1  # a row alone gives its row of the batch
        assert torch.equal(add_rms_norm_fused(h[i : i + 1], d[i : i + 1], w, 1e-6)[1], x[i : i + 1])


def _shared_act_cases(device):
    for n, f, e in [(1, 512, 2048), (3, 33, 100), (16, 1500, 256)]:  # 1500: more than one step of h
        g = torch.Generator().manual_seed(n * f + e)
        gu = (torch.randn(n, 2 * f, generator=g) * 4).to(device)  # the gate+up GEMV's [N, 2F] output
        x = torch.randn(n, e, generator=g).to(device)
        w_gate = (torch.randn(e, generator=g) / e**0.5).to(device)
        gate, up = gu.split(f, dim=-1)  # row-strided views, as fused_linear_rows returns them
        got = shared_act_fused(gate, up, x, w_gate)
        assert got.shape == (n, f) and got.is_contiguous() and not got.isnan().any()
        want = shared_act_reference(gate, up, x, w_gate)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        i = n - 1  # a token alone gives its row of the batch
        alone = shared_act_fused(gate[i : i + 1], up[i : i + 1], x[i : i + 1], w_gate)
        assert torch.equal(alone, got[i : i + 1])


def test_shared_act_reference_is_the_shared_experts_scaling():
    """The fused form scales h by the gate before the down projection: the same as scaling the output,
    up to rounding (moe.shared_expert's unfused form)."""
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(2, 2, 40, generator=g)
    x = torch.randn(2, 24, generator=g)
    w_gate, w_down = torch.randn(24, generator=g), torch.randn(24, 40, generator=g)
    scaled_after = (torch.nn.functional.silu(gate) * up) @ w_down.T * torch.sigmoid(x @ w_gate[:, None])
    torch.testing.assert_close(shared_act_reference(gate, up, x, w_gate) @ w_down.T, scaled_after)


def test_add_norm_and_shared_act_refuse_bad_shapes():
    h = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="add_rms_norm_fused"):
        add_rms_norm_fused(h, torch.zeros(2, 9), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm_fused: out"):
        add_rms_norm_fused(h, h, torch.ones(8), 1e-6, out=(torch.zeros(2, 8), torch.zeros(1, 8)))
    with pytest.raises(ValueError, match="shared_act_fused"):
        shared_act_fused(h, h, torch.zeros(2, 4), torch.zeros(5))


@interpret
def test_interpreted_add_rms_norm():
    pytest.importorskip("triton")
    _add_norm_cases("cpu")


@interpret
def test_interpreted_shared_act():
    pytest.importorskip("triton")
    _shared_act_cases("cpu")


@interpret
def test_interpreted_rms_norm():
    pytest.importorskip("triton")
    _norm_cases("cpu")


@interpret
def test_interpreted_combine_same_bits():
    pytest.importorskip("triton")
    _combine_cases("cpu")


gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_gpu_rms_norm():
    _norm_cases("cuda")


@pytest.mark.gpu
@gpu
def test_gpu_combine_same_bits():
    _combine_cases("cuda")


@pytest.mark.gpu
@gpu
def test_gpu_add_rms_norm():
    _add_norm_cases("cuda")


@pytest.mark.gpu
@gpu
def test_gpu_shared_act():
    _shared_act_cases("cuda")
