"""The seeded Gumbel scores (strata_ray/kernels/gumbel.py): keys, noise, the twin's formula, and the Triton
kernel against the twin bit for bit (under the Triton interpreter on CPU machines, compiled with -m gpu)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from strata_ray.kernels.gumbel import (
    draw_keys,
    gumbel_noise_reference,
    gumbel_scores,
    gumbel_scores_reference,
    gumbel_scores_triton,
)
from tests.kernels.triton_interpret import interpret

SIZES = [1, 33, 222, 1025, 151_936]  # awkward sizes, a block and one, the Qwen vocabulary


def test_keys_are_31_bit_distinct_per_draw_and_seed_and_refuse_bad_input():
    keys = {draw_keys(seed, draw) for seed in (0, 1, 2**64 - 1) for draw in range(50)}
    assert len(keys) == 150
    assert all(0 <= k < 2**31 for pair in keys for k in pair)
    assert draw_keys(7, 3) == draw_keys(7, 3)
    for seed, draw in ((-1, 0), (2**64, 0), (0, -1)):
        with pytest.raises(ValueError, match="seed must be"):
            draw_keys(seed, draw)


def test_noise_is_standard_gumbel_and_its_uniforms_are_odd_multiples_of_2_to_minus_24():
    g = gumbel_noise_reference(1 << 20, *draw_keys(3, 0))
    assert g.dtype == np.float32 and np.isfinite(g).all()
    assert abs(g.mean() - 0.5772157) < 0.005 and abs(g.std() - math.pi / math.sqrt(6)) < 0.005
    u = np.exp(-np.exp(-g.astype(np.float64)))  # back to the uniforms (to float32 rounding)
    hist, _ = np.histogram(u, bins=16, range=(0, 1))
    assert (abs(hist / len(u) - 1 / 16) < 0.002).all()
    # extremes: the smallest and largest uniforms give finite noise
    lo, hi = 2.0**-24, 1 - 2.0**-24
    assert np.isfinite(np.float32(-np.log(-np.log([lo, hi])))).all()


def test_noise_of_two_draws_is_uncorrelated():
    a = gumbel_noise_reference(100_000, *draw_keys(11, 0)).astype(np.float64)
    b = gumbel_noise_reference(100_000, *draw_keys(11, 1)).astype(np.float64)
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.02 and not np.array_equal(a, b)


@pytest.mark.parametrize("n", SIZES)
def test_scores_are_logits_over_temperature_plus_noise(n):
    z = torch.randn(n, generator=torch.Generator().manual_seed(n))
    k1, k2 = draw_keys(5, n)
    want = z / torch.tensor(0.7) + torch.from_numpy(gumbel_noise_reference(n, k1, k2))
    assert torch.equal(gumbel_scores_reference(z, 0.7, k1, k2), want)
    out = torch.full((n,), float("nan"))
    assert gumbel_scores(z, 0.7, k1, k2, out=out) is out and torch.equal(out, want)
    z[0] = float("-inf")  # a filtered logit stays out of reach
    assert gumbel_scores(z, 0.7, k1, k2)[0] == float("-inf")
    with pytest.raises(ValueError, match="one row of logits"):
        gumbel_scores(z[None], 0.7, k1, k2)


def _kernel_matches_twin(device: str) -> None:
    for n in SIZES:
        z = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 4
        z[n // 2] = float("-inf")
        for temperature, seed in ((1.0, 0), (0.37, 2**64 - 1), (2.5, 12345)):
            k1, k2 = draw_keys(seed, n % 7)
            want = gumbel_scores_reference(z, temperature, k1, k2)
            out = torch.full((n,), float("nan"), device=device)  # every element written
            got = gumbel_scores_triton(z.to(device), temperature, k1, k2, out=out).cpu()
            assert torch.equal(got, want), (n, temperature, seed)


@interpret
def test_the_triton_kernel_gives_the_twins_bits_interpreted():
    _kernel_matches_twin("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_triton_kernel_gives_the_twins_bits_on_cuda():
    """Compiled: the integers exact, the float64 logs rounded once to float32, an IEEE division: the bits of
    the twin on the host (a draw is the same token on the device and the host from the same logits)."""
    _kernel_matches_twin("cuda")
    z = torch.randn(151_936, device="cuda")
    assert torch.equal(gumbel_scores(z, 1.0, 1, 2).cpu(), gumbel_scores_reference(z.cpu(), 1.0, 1, 2))
