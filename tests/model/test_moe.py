"""moe: the weighted sum of each token's expert rows in slot order (combine_rows), the shared expert."""

import pytest
import torch

from strata_ray.kernels.fused_small import needs_grad
from strata_ray.model import ops
from strata_ray.model.moe import combine_rows, shared_expert


def _torch_form(rows, weights):
    """The contract's fixed order in torch ops: ((r0 w0 + r1 w1) + r2 w2) + ..."""
    out = rows[:, 0] * weights[:, :1]
    for j in range(1, rows.shape[1]):
        out = out + rows[:, j] * weights[:, j : j + 1]
    return out


def test_combine_rows_adds_in_slot_order():
    gen = torch.Generator().manual_seed(0)
    rows, weights = torch.randn(3, 10, 64, generator=gen), torch.rand(3, 10, generator=gen)
    assert torch.equal(combine_rows(rows, weights), _torch_form(rows, weights))
    assert torch.equal(combine_rows(rows[:, :1], weights[:, :1]), rows[:, 0] * weights[:, :1])


def test_combine_rows_through_numpy_gives_the_torch_ops_bits():
    """float32 CPU tensors take numpy (no torch dispatch): the same roundings, bit for bit, at awkward sizes
    and on strided views; inference tensors too (the engine's decode)."""
    gen = torch.Generator().manual_seed(1)
    for n, k, e in ((1, 1, 1), (1, 2, 33), (33, 10, 222), (2, 8, 2048)):
        rows = torch.randn(n, k, e, generator=gen) * 1e3
        weights = torch.rand(n, k, generator=gen)
        assert torch.equal(combine_rows(rows, weights), _torch_form(rows, weights)), (n, k, e)
        strided = torch.randn(n, e, k, generator=gen).transpose(1, 2)  # [N, K, E], not contiguous
        assert torch.equal(combine_rows(strided, weights), _torch_form(strided, weights)), (n, k, e)
        with torch.inference_mode():
            assert torch.equal(combine_rows(rows, weights), _torch_form(rows, weights))


def test_combine_rows_keeps_autograd_and_other_dtypes_in_torch():
    rows = torch.randn(2, 3, 8, requires_grad=True)
    weights = torch.rand(2, 3)
    out = combine_rows(rows, weights)
    out.sum().backward()
    assert torch.equal(rows.grad, weights[:, :, None].expand(2, 3, 8))
    r64, w64 = rows.detach().double(), weights.double()
    assert combine_rows(r64, w64).dtype == torch.float64
    assert torch.equal(combine_rows(r64, w64), _torch_form(r64, w64))


def _shared_weights(device, e=64, f=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {f"blk.0.ffn_{p}_shexp.weight": (torch.randn(*s, generator=g) / 8).to(device)
         for p, s in (("gate", (f, e)), ("up", (f, e)), ("down", (e, f)))}
    w["blk.0.ffn_gate_inp_shexp.weight"] = torch.randn(e, generator=g).to(device) / 8
    return w


@pytest.mark.parametrize("fused", [False, True])
def test_shared_expert_is_the_gated_swiglu(fused, monkeypatch):
    """The torch form bit for bit; a decode window's form on the CPU (kernels/fused_small_cpu: h gated before
    the down projection) to rounding."""
    if not fused:
        monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    w = _shared_weights("cpu")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    want = ops.swiglu(x, *(w[f"blk.0.ffn_{p}_shexp.weight"] for p in ("gate", "up", "down")))
    want = want * torch.sigmoid(x @ w["blk.0.ffn_gate_inp_shexp.weight"][:, None])
    got = shared_expert(w, 0, x)
    if fused:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, want)
    out = torch.full_like(got, float("nan"))
    assert shared_expert(w, 0, x, out=out) is out and torch.equal(out, got)


def _q8_shared_weights(device):
    """The shared expert as a quantized model holds it: Q8_0 matrices, gate | up fused into one (row-strided
    views of one GEMV's output)."""
    from strata_ray.kernels.dense_q8 import Q8Weight
    from strata_ray.model.weights import fuse_dense_rows

    w = _shared_weights("cpu", f=64)  # Q8_0 rows: widths in 32-blocks
    g = torch.Generator().manual_seed(5)
    for name in [n for n in w if n.endswith(("gate_shexp.weight", "up_shexp.weight", "down_shexp.weight"))]:
        n, k = w[name].shape
        w[name] = Q8Weight(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(device),
                           (torch.rand(n, k // 32, generator=g) / 256).half().to(device))
    w["blk.0.ffn_gate_inp_shexp.weight"] = w["blk.0.ffn_gate_inp_shexp.weight"].to(device)
    fuse_dense_rows(w)
    return w


def test_q8_shared_expert_is_its_dequantized_form():
    """The quantized fixture of the GPU test below, on the CPU: the float form of its dequantized weights."""
    w = _q8_shared_weights("cpu")
    assert w["blk.0.ffn_gate_shexp.weight"].fused is not None  # gate | up as views of one matrix
    dense = {n: t.dequantize() if hasattr(t, "dequantize") else t for n, t in w.items()}
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(shared_expert(w, 0, x), shared_expert(dense, 0, x), rtol=1e-5, atol=1e-6)


def test_needs_grad_keeps_the_torch_form():
    w = _shared_weights("cpu")
    x = torch.randn(1, 64)
    assert not needs_grad(x, *w.values())
    w["blk.0.ffn_up_shexp.weight"].requires_grad_(True)
    assert needs_grad(x, *w.values())
    with torch.no_grad():
        assert not needs_grad(*w.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("T", [1, 16])
def test_gpu_shared_expert_fused_matches_the_unfused_form(T, quantized, monkeypatch):
    """The decode form (three launches, the gate scaling h before the down projection) against the seven-op
    form, to rounding; into a buffer, every element written. Quantized: Q8_0 matrices with gate | up fused
    (strided views into the activation kernel, the down GEMV writing the buffer itself)."""
    w = _q8_shared_weights("cuda") if quantized else _shared_weights("cuda")
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T)).cuda()
    got = shared_expert(w, 0, x)
    out = torch.full_like(got, float("nan"))
    assert shared_expert(w, 0, x, out=out) is out and torch.equal(out, got)
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    torch.testing.assert_close(got, shared_expert(w, 0, x), rtol=1e-5, atol=1e-6)
