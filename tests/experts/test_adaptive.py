import numpy as np
import pytest

from strata_ray.experts.adaptive import AdaptiveTier, Swap, apply_swaps, plan_round


def table(rows):
    return np.array(rows, dtype=np.float32)


def mask(rows):
    return np.array(rows, dtype=bool)


def test_thresholds_at_the_boundary():
    # expert 0 resident with usage 0.5; candidates: 2.0 (exactly min usage, exactly victim + 1.5),
    # 1.99 (below min usage)
    usage = table([[0.5, 2.0, 1.99]])
    resident = mask([[True, False, False]])
    assert plan_round(usage, resident, None, 10) == [Swap(0, 1, 0, 1.5)]
    # the same candidate against a victim just too warm: 2.0 < 0.51 + 1.5
    usage = table([[0.51, 2.0, 0.0]])
    assert plan_round(usage, resident, None, 10) == []


def test_pairs_best_candidate_with_coldest_victim_and_stops_at_first_failure():
    usage = table([[1.0, 0.0, 4.0, 9.0, 3.0, 2.0]])
    resident = mask([[True, True, True, False, False, False]])
    swaps = plan_round(usage, resident, None, 10)
    # candidates 9, 3, 2 (desc); victims 0 (e1), 1 (e0), 4 (e2) (asc)
    # 9 >= 0 + 1.5 yes; 3 >= 1 + 1.5 yes; 2 >= 4 + 1.5 no
    assert swaps == [Swap(0, 3, 1, 9.0), Swap(0, 4, 0, 2.0)]


def test_gains_sorted_across_layers_then_capped():
    usage = table(
        [
            [0.0, 5.0, 0.0, 3.0],
            [1.0, 8.0, 1.0, 4.0],
            [0.0, 5.0, 0.0, 0.0],
        ]
    )
    resident = mask([[True, False, True, False], [True, False, True, False], [True, False, False, False]])
    all_swaps = plan_round(usage, resident, None, 96)
    assert all_swaps == [
        Swap(1, 1, 0, 7.0),
        Swap(0, 1, 0, 5.0),  # gain tie 5.0: layer 0 before layer 2
        Swap(2, 1, 0, 5.0),
        Swap(0, 3, 2, 3.0),
        Swap(1, 3, 2, 3.0),
    ]
    assert plan_round(usage, resident, None, 2) == all_swaps[:2]
    assert plan_round(usage, resident, None, 0) == []


def test_ties_in_usage_break_by_expert_index():
    usage = table([[0.0, 0.0, 3.0, 3.0]])
    resident = mask([[True, True, False, False]])
    assert plan_round(usage, resident, None, 1) == [Swap(0, 2, 0, 3.0)]


def test_excluded_pairs_are_never_candidates():
    usage = table([[0.0, 9.0, 4.0]])
    resident = mask([[True, False, False]])
    excluded = mask([[False, True, False]])
    assert plan_round(usage, resident, excluded, 10) == [Swap(0, 2, 0, 4.0)]


def test_no_swap_when_all_cold_or_nothing_resident():
    usage = table([[1.9, 1.0, 0.0]])
    assert plan_round(usage, mask([[False, False, True]]), None, 10) == []
    assert plan_round(table([[5.0, 5.0]]), mask([[False, False]]), None, 10) == []
    # a layer holding nothing (no victims) among layers that do: skipped, the others still swap
    usage = table([[0.0, 6.0], [9.0, 9.0], [0.0, 3.0]])
    resident = mask([[True, False], [False, False], [True, False]])
    assert plan_round(usage, resident, None, 10) == [Swap(0, 1, 0, 6.0), Swap(2, 1, 0, 3.0)]


def test_apply_swaps_moves_membership():
    resident = mask([[True, False]])
    after = apply_swaps(resident, [Swap(0, 1, 0, 3.0)])
    assert after.tolist() == [[False, True]] and resident.tolist() == [[True, False]]


def test_tier_schedule_and_decay():
    tier = AdaptiveTier(1, 3, adapt_every=2, max_swaps=4, decay=0.5)
    resident = mask([[True, False, False]])
    tier.record(np.array([[0, 2, 1]]))
    assert tier.window_done() is False
    tier.record(np.array([[0, 2, 1]]))
    assert tier.window_done() is True
    rnd = tier.run_round(resident)
    assert rnd.primary == [Swap(0, 1, 0, 4.0)] and rnd.peer == []
    np.testing.assert_array_equal(tier.usage, table([[0.0, 2.0, 1.0]]))  # halved
    np.testing.assert_array_equal(tier.heat, [[0, 4, 2]])  # undecayed
    assert tier.rounds == 1 and tier.swaps_total == 1
    assert tier.run_round(resident, primary_busy=True) is None
    np.testing.assert_array_equal(tier.usage, table([[0.0, 2.0, 1.0]]))  # a skipped round: no decay


def test_disabled_tier_never_runs():
    tier = AdaptiveTier(1, 2, adapt_every=0)
    assert not any(tier.window_done() for _ in range(8))
    assert not AdaptiveTier(1, 2, adapt_every=1, max_swaps=0).window_done()


def test_peer_round_takes_only_pairs_on_neither_tier():
    usage = table([[9.0, 8.0, 7.0, 0.0, 0.0, 6.0]])
    primary = mask([[False, False, False, True, False, False]])
    peer = mask([[False, False, False, False, True, True]])
    tier = AdaptiveTier(1, 6, adapt_every=1, max_swaps=1, peer_max_swaps=-1)
    tier.record(usage)
    rnd = tier.run_round(primary, peer)
    # the primary takes the hottest (e0) in place of e3; the peer may not take e0 (now primary's) nor
    # e5 (its own): it takes e1 in place of its coldest, e4
    assert rnd.primary == [Swap(0, 0, 3, 9.0)]
    assert rnd.peer == [Swap(0, 1, 4, 8.0)]
    # the primary never takes what the peer holds
    tier2 = AdaptiveTier(1, 6, adapt_every=1, max_swaps=5, peer_max_swaps=0)
    tier2.record(table([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0]]))
    rnd = tier2.run_round(primary, peer)
    assert rnd.primary == [] and rnd.peer == []
    assert tier2.run_round(primary, peer, peer_busy=True).peer == []


@pytest.mark.parametrize("seed", [0, 1])
def test_deterministic_and_consistent_on_random_tables(seed):
    rng = np.random.default_rng(seed)
    usage = rng.integers(0, 8, size=(6, 16)).astype(np.float32)
    resident = rng.random((6, 16)) < 0.4
    excluded = ~resident & (rng.random((6, 16)) < 0.2)
    swaps = plan_round(usage, resident, excluded, 12)
    assert swaps == plan_round(usage.copy(), resident.copy(), excluded.copy(), 12)
    assert len(swaps) <= 12
    assert [s.gain for s in swaps] == sorted((s.gain for s in swaps), reverse=True)
    for s in swaps:
        assert resident[s.layer, s.victim] and not resident[s.layer, s.candidate]
        assert not excluded[s.layer, s.candidate] and usage[s.layer, s.candidate] >= 2.0
        assert s.gain >= 1.5
    moved = [(s.layer, s.candidate) for s in swaps] + [(s.layer, s.victim) for s in swaps]
    assert len(set(moved)) == len(moved)
    assert apply_swaps(resident, swaps).sum() == resident.sum()
