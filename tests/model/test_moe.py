"""moe.combine_rows: weighted sum of each token's expert rows in slot order."""

import torch

from strata_ray.model.moe import combine_rows


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
