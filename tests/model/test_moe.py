"""moe.combine_rows: weighted sum of each token's expert rows in slot order."""

import torch

from strata_ray.model.moe import combine_rows


def test_combine_rows_adds_in_slot_order():
    gen = torch.Generator().manual_seed(0)
    rows, weights = torch.randn(3, 10, 64, generator=gen), torch.rand(3, 10, generator=gen)
    expected = rows[:, 0] * weights[:, :1]
    for j in range(1, 10):  # the contract's fixed order: ((r0 w0 + r1 w1) + r2 w2) + ...
        expected = expected + rows[:, j] * weights[:, j : j + 1]
    assert torch.equal(combine_rows(rows, weights), expected)
    assert torch.equal(combine_rows(rows[:, :1], weights[:, :1]), rows[:, 0] * weights[:, :1])
