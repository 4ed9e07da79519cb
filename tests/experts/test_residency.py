import time

import numpy as np
import pytest
import torch

from strata_ray.experts.adaptive import Swap
from strata_ray.experts.pairs import pair_id, pair_ids, pair_of, pairs_of
from strata_ray.experts.profile import Profile, rank_from_counts
from strata_ray.experts.residency import Residency, ResidencyError, SlotCopy


def test_pair_ids_round_trip():
    assert pair_id(3, 5, 8) == 29 and pair_of(29, 8) == (3, 5)
    pairs = np.array([[0, 0], [2, 7], [1, 3]])
    np.testing.assert_array_equal(pairs_of(pair_ids(pairs, 8), 8), pairs)


def test_admission_fills_in_rank_order_and_never_evicts():
    profile = Profile(2, 4, np.array([[1, 3], [0, 0], [1, 1], [0, 2], [1, 0]]))
    r = Residency(2, 4, n_slots=3)
    copies = r.admit_in_rank_order(profile)
    assert copies == [SlotCopy(7, 0), SlotCopy(0, 1), SlotCopy(5, 2)]  # slot 0 holds the hottest
    assert r.res.reshape(2, 4).tolist() == [[1, -1, -1, -1], [-1, 2, -1, 0]]
    assert r.slot_pair.tolist() == [7, 0, 5] and not r.free
    # a second fill admits nothing: a full cache does not evict on admission
    assert r.admit_in_rank_order(profile) == []
    assert r.n_resident == 3


def test_admission_cap_and_already_resident_pairs():
    profile = rank_from_counts(np.array([[3, 2, 1]]))
    r = Residency(1, 3, n_slots=3)
    assert r.admit_in_rank_order(profile, n_slots=1) == [SlotCopy(0, 0)]
    assert r.admit_in_rank_order(profile) == [SlotCopy(1, 1), SlotCopy(2, 2)]


def test_evict_and_make_resident():
    r = Residency(1, 4, n_slots=2)
    r.make_resident(2, 1)
    assert r.slot_of(2) == 1 and list(r.free) == [0]
    with pytest.raises(ResidencyError):
        r.make_resident(2, 0)  # already resident
    with pytest.raises(ResidencyError):
        r.make_resident(3, 1)  # slot taken
    assert r.evict(2) == 1 and not r.is_resident(2) and list(r.free) == [0, 1]
    with pytest.raises(ResidencyError):
        r.evict(2)


def test_swaps_victim_leaves_now_newcomer_at_window_boundary():
    r = Residency(2, 3, n_slots=2)
    r.admit_in_rank_order(Profile(2, 3, np.array([[0, 0], [1, 2]])))
    epoch = r.epoch
    copies = r.schedule_swaps([Swap(1, 0, 2, 4.0)])
    assert copies == [SlotCopy(3, 1)]
    assert not r.is_resident(5) and not r.is_resident(3)  # victim gone, newcomer not yet there
    assert r.epoch > epoch and not r.free  # the slot is reserved, not free
    assert r.resident_mask().tolist() == [[True, False, False], [False, False, False]]
    assert r.resident_mask(include_pending=True).tolist() == [[True, False, False], [True, False, False]]
    assert r.admit_in_rank_order(Profile(2, 3, np.array([[1, 0]]))) == []  # pending is not admissible
    assert r.apply_pending() == copies
    assert r.slot_of(3) == 1 and r.slot_pair.tolist() == [0, 3] and r.pending == []
    assert r.apply_pending() == []


def test_device_mirror_refreshes_in_place_when_epoch_moves():
    r = Residency(1, 3, n_slots=1)
    table = r.device_table("cpu")
    assert table.dtype == torch.int32 and table.tolist() == [-1, -1, -1]
    r.make_resident(1, 0)
    again = r.device_table("cpu")
    assert again.data_ptr() == table.data_ptr() and again.tolist() == [-1, 0, -1]
    r.res[2] = 5  # an out-of-band write does not move the epoch, so the mirror is not re-copied
    assert r.device_table("cpu").tolist() == [-1, 0, -1]


def test_layer_slots_view():
    r = Residency(2, 2, n_slots=2)
    r.make_resident(3, 1)
    assert r.layer_slots(1).tolist() == [-1, 1] and r.layer_slots(0).tolist() == [-1, -1]


def test_adaptive_rounds_move_the_hot_experts_in_and_keep_the_tables_consistent():
    from strata_ray.experts.adaptive import AdaptiveTier

    L, X, S = 2, 8, 6
    r = Residency(L, X, n_slots=S)
    start = np.zeros((L, X))
    start[:, :3] = 1
    r.admit_in_rank_order(rank_from_counts(start))  # experts 0..2 of both layers
    tier = AdaptiveTier(L, X, adapt_every=2, max_swaps=3, decay=0.7)
    hot = np.zeros((L, X), dtype=np.int64)
    hot[1, 5:8] = 3  # routing moved to layer 1's last experts
    for _ in range(8):
        r.apply_pending()  # window boundary: last round's copies have landed
        tier.record(hot)
        if tier.window_done():
            rnd = tier.run_round(r.resident_mask(include_pending=True))
            r.schedule_swaps(rnd.primary)
        resident = r.slot_pair[r.slot_pair >= 0]
        assert len(set(resident.tolist())) == len(resident)
        assert all(r.res[p] == s for s, p in enumerate(r.slot_pair) if p >= 0)
        assert len(resident) + len(r.pending) + len(r.free) == S
    r.apply_pending()
    # swaps stay inside a layer: layer 1's hot experts replaced layer 1's cold ones, layer 0 kept its own
    assert r.resident_mask().tolist() == [[True] * 3 + [False] * 5, [False] * 5 + [True] * 3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_mirror_is_one_tensor_for_cuda_and_cuda_0():
    """Captured graphs read the mirror's storage: "cuda" and "cuda:0" must not make a new one (session 6:
    they did, and the pipelined decode's graphs read freed memory)."""
    r = Residency(1, 3, n_slots=1)
    table = r.device_table("cuda")
    r.make_resident(1, 0)
    assert r.device_table(torch.device("cuda", torch.cuda.current_device())) is table
    assert r.device_table("cuda") is table and table.tolist() == [-1, 0, -1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_mirror_refreshes_from_page_locked_memory_behind_queued_work():
    """The mirror's refresh is a copy from page-locked memory in stream order: it does not wait for the
    kernels already queued (the chained decode's token in flight) and lands behind them; three refreshes in
    a row (the two sources alternate) each leave the table they were asked for."""
    r = Residency(2, 4, n_slots=4)
    table = r.device_table("cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued work
    r.make_resident(1, 0)
    t = time.perf_counter()
    r.device_table("cuda")
    assert time.perf_counter() - t < 0.05  # the host did not wait for the queued work
    seen = [table.clone()]
    for pair, slot in ((6, 1), (3, 2)):
        r.make_resident(pair, slot)
        r.device_table("cuda")
        seen.append(table.clone())
    torch.cuda.synchronize()
    assert [s.tolist() for s in seen] == [[-1, 0, -1, -1, -1, -1, -1, -1], [-1, 0, -1, -1, -1, -1, 1, -1],
                                          [-1, 0, -1, 2, -1, -1, 1, -1]]


def test_a_loan_admits_pairs_into_its_slots_and_gives_them_back():
    r = Residency(2, 4, n_slots=2, n_lendable=3)
    r.admit_in_rank_order(Profile(2, 4, np.array([[0, 0], [1, 1]])))  # pairs 0 and 5 in slots 0, 1
    assert r.lend([1, 2], 4) == []  # no loan open
    r.open_loan()
    copies = r.lend([0, 6, 6, 1, 7, 2], 4)  # resident 0 and the repeated 6 skipped; 3 slots only
    assert copies == [SlotCopy(6, 2), SlotCopy(1, 3), SlotCopy(7, 4)] and not r.lent_free
    assert not r.is_resident(6) and r.resident_mask(include_pending=True).reshape(-1)[[6, 1, 7]].all()
    r.apply_pending()
    assert [r.slot_of(p) for p in (6, 1, 7)] == [2, 3, 4] and r.n_resident == 5
    epoch = r.epoch
    assert r.close_loan() == 3 and r.epoch > epoch
    assert r.n_resident == 2 and r.slot_pair.tolist() == [0, 5, -1, -1, -1] and not r.loan_open
    assert r.close_loan() == 0  # closed already


def test_closing_a_loan_drops_its_pending_copies_and_keeps_the_rounds():
    r = Residency(1, 6, n_slots=2, n_lendable=2)
    r.admit_in_rank_order(rank_from_counts(np.array([[5, 4, 0, 0, 0, 0]])))  # pairs 0, 1
    r.open_loan()
    r.lend([2, 3], 2)
    r.apply_pending()
    swaps = r.schedule_swaps([Swap(0, 4, 0, 3.0), Swap(0, 5, 2, 3.0)])  # one victim cached, one lent
    loan = r.lend([1, 2], 2)  # the lent victim's slot went to its swap: no free loan slot
    assert swaps == [SlotCopy(4, 0), SlotCopy(5, 2)] and loan == []
    r.close_loan()
    assert r.pending == [SlotCopy(4, 0)]  # the swap into the lent slot is dropped, the other stays
    r.apply_pending()
    assert r.resident_mask().reshape(-1).tolist() == [False, True, False, False, True, False]


def test_swaps_that_no_longer_fit_the_placement_are_dropped():
    """A round planned before a loan came or went: its victim may have left, its candidate arrived."""
    r = Residency(1, 4, n_slots=2)
    r.admit_in_rank_order(rank_from_counts(np.array([[5, 4, 0, 0]])))  # pairs 0, 1
    # Swap(layer, candidate, victim, gain): victim 3 is not resident; candidate 0 is; the third swaps 1 for 2
    copies = r.schedule_swaps([Swap(0, 2, 3, 3.0), Swap(0, 0, 1, 3.0), Swap(0, 2, 1, 3.0)])
    assert copies == [SlotCopy(2, 1)]
    assert r.schedule_swaps([Swap(0, 2, 0, 3.0)]) == []  # candidate 2 is on its way already
