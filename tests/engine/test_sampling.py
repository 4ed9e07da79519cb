"""Sampling: greedy = argmax, seeded determinism, and the top-k / top-p / min-p masks."""

import math

import pytest
import torch

from strata_ray.engine.sampling import (
    Sampler,
    SamplingError,
    SamplingParams,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)

# probabilities 0.5, 0.3, 0.15, 0.05 placed at shuffled ids so the masks must follow ids, not ranks
PROBS = {3: 0.5, 0: 0.3, 4: 0.15, 1: 0.05}


def _logits() -> torch.Tensor:
    x = torch.full((6,), float("-inf"))
    for i, p in PROBS.items():
        x[i] = math.log(p)
    return x


def _kept(x: torch.Tensor) -> set[int]:
    return set(torch.isfinite(x).nonzero().flatten().tolist())


def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(SamplingParams())
    for _ in range(20):
        logits = torch.randn(1000, generator=gen)
        assert sampler.sample(logits) == int(logits.argmax())


def test_same_seed_same_draws_different_seed_different_draws():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=42)
    first, second = Sampler(params), Sampler(params)
    a = [first.sample(logits) for _ in range(40)]
    b = [second.sample(logits) for _ in range(40)]
    other = Sampler(SamplingParams(temperature=1.0, seed=7))
    c = [other.sample(logits) for _ in range(40)]
    assert a == b
    assert a != c
    assert len(set(a)) > 5  # it really samples


@pytest.mark.parametrize("k, kept", [(1, {3}), (2, {3, 0}), (3, {3, 0, 4}), (0, {3, 0, 4, 1}),
                                     (99, {3, 0, 4, 1})])
def test_top_k_mask(k, kept):
    assert _kept(top_k_filter(_logits(), k)) == kept


@pytest.mark.parametrize("p, kept", [(0.45, {3}), (0.6, {3, 0}), (0.9, {3, 0, 4}), (0.99, {3, 0, 4, 1}),
                                     (1.0, {3, 0, 4, 1})])
def test_top_p_mask(p, kept):
    assert _kept(top_p_filter(_logits(), p)) == kept


@pytest.mark.parametrize("p, kept", [(0.0, {3, 0, 4, 1}), (0.2, {3, 0, 4}), (0.5, {3, 0}), (0.7, {3})])
def test_min_p_mask(p, kept):
    assert _kept(min_p_filter(_logits(), p)) == kept


def test_draws_stay_inside_the_filters_and_follow_the_distribution():
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=3))
    draws = [sampler.sample(_logits()) for _ in range(3000)]
    assert set(draws) == {3, 0, 4}
    total = 0.95  # mass left after top-k
    for i in (3, 0, 4):
        assert abs(draws.count(i) / len(draws) - PROBS[i] / total) < 0.03


def test_low_temperature_concentrates_on_the_argmax():
    sampler = Sampler(SamplingParams(temperature=0.05, seed=0))
    assert all(sampler.sample(_logits()) == 3 for _ in range(200))


@pytest.mark.parametrize("t", [1e-40, 1e-300, 5e-324, 9.99e-6])
def test_a_temperature_below_1e_5_is_greedy(t):
    # a float32 1e-40 is subnormal, not 0: logits / T made every positive logit +inf, and the arg-max took the
    # first of them (token 0 here), not the largest logit
    logits = torch.tensor([0.5, 1.0, 3.0, 2.0])
    sampler = Sampler(SamplingParams(temperature=t, seed=1))
    assert sampler.params.temperature == 0.0
    assert [sampler.sample(logits) for _ in range(3)] == [2, 2, 2] and sampler.draws == 0


def test_a_temperature_of_1e_5_still_samples():
    assert Sampler(SamplingParams(temperature=1e-5, seed=1)).params.temperature == 1e-5


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-2), dict(top_p=-0.1), dict(top_p=1.5),
                                    dict(min_p=2.0), dict(seed=-1), dict(seed=2**64)])
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)


def test_top_p_zero_keeps_only_the_most_likely_token():
    """top_p = 0 (OpenAI's range is 0 to 1) leaves the first of the largest logits: a seeded draw at any
    temperature is then the greedy token."""
    logits = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.9])
    kept = top_p_filter(logits, 0.0)
    assert torch.isfinite(kept).tolist() == [False, True, False, False, False]
    for seed in range(8):
        draw = Sampler(SamplingParams(temperature=2.0, top_p=0.0, seed=seed)).choose(logits)
        assert int(draw) == 1


def test_a_draw_is_the_argmax_of_filtered_logits_over_temperature_plus_its_numbered_noise():
    """Draw i of a seeded sampler: argmax(filtered / T + Gumbel noise of (seed, i)) - a pure function of the
    logits, the seed and the draw's number (so the chained decode can draw on the device)."""
    from strata_ray.kernels.gumbel import draw_keys, gumbel_noise_reference

    gen = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=77)
    sampler = Sampler(params)
    for i in range(30):
        logits = torch.randn(500, generator=gen) * 3
        filtered = min_p_filter(top_p_filter(top_k_filter(logits, 50), 0.95), 0.0)
        noise = torch.from_numpy(gumbel_noise_reference(500, *draw_keys(77, i)))
        assert sampler.sample(logits) == int(torch.argmax(filtered / torch.tensor(0.9) + noise))
    assert sampler.draws == 30


def test_choose_into_writes_the_draw_sample_returns():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2))
    a, b = Sampler(SamplingParams(temperature=1.0, seed=8)), Sampler(SamplingParams(temperature=1.0, seed=8))
    out = torch.full((1,), -1, dtype=torch.int64)
    for _ in range(10):
        a.choose_into(logits, out)
        assert int(out[0]) == b.sample(logits)
    greedy = Sampler()
    greedy.choose_into(logits, out)
    assert int(out[0]) == int(logits.argmax()) and greedy.draws == 0


def test_unseeded_samplers_draw_differently():
    logits = torch.zeros(1000)
    unseeded = SamplingParams(temperature=1.0)
    draws = {tuple(Sampler(unseeded).sample(logits) for _ in range(5)) for _ in range(4)}
    assert len(draws) > 1
