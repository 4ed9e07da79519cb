"""SlotCache on a CPU primary (the second CPU tier): sizing, fill order, byte-exact slots, swaps."""

import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from strata_ray.config import EngineConfig
from strata_ray.experts.adaptive import Swap
from strata_ray.experts.host_store import HostStore
from strata_ray.experts.profile import Profile
from strata_ray.experts.residency import Residency
from strata_ray.experts.slot_cache import MIB, SlotCache, SlotCacheError, cache_slots, default_order
from strata_ray.kernels.cpu_pool import CpuPool
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.synth import write_synth

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_synth(path, arch="qwen3next", preset="tiny", expert_type="Q4_K", progress=False)
    return HostStore(GGUFFile(path), pin_gib=0)


def new_cache(store, n_slots):
    hp = store.hp
    return SlotCache(store, Residency(hp.n_layer, hp.n_expert, n_slots), CPU)


def test_sizing(store):
    cfg = EngineConfig()
    n_pairs = store.hp.n_layer * store.n_expert
    assert cache_slots(replace(cfg, expert_cache=5), store, CPU) == 5
    assert cache_slots(replace(cfg, expert_cache=10**6), store, CPU) == n_pairs  # capped at the pairs
    assert cache_slots(cfg, store, CPU) == 0  # auto on a CPU primary: no VRAM
    budget = replace(cfg, vram_budget_mib=2, vram_reserve_mib=1)
    assert cache_slots(budget, store, CPU) == min(MIB // store.max_blob, n_pairs)


def test_fill_follows_the_profile_and_slots_hold_the_exact_bytes(store):
    hp = store.hp
    ranked = np.array([(3, 7), (0, 1), (2, 2), (1, 0), (0, 0)])
    cache = new_cache(store, 4)
    line = cache.fill(Profile(hp.n_layer, hp.n_expert, ranked), progress=False)
    assert re.fullmatch(
        r"pre-filled 4 of 4 slots from the profile in \d+\.\d\d s \(\d+ MB/s\); slot 0 verified", line
    )
    for slot, (layer, e) in enumerate(ranked[:4]):
        assert cache.residency.slot_of(layer * hp.n_expert + e) == slot
        assert cache.storage[slot].numpy().tobytes() == store.blob_bytes(layer, e)
    assert not cache.residency.is_resident(0)  # (0, 0) ranked fifth: no slot left


def test_a_short_profile_fills_the_rest_in_the_default_order(store):
    """A profile ranking fewer pairs than the cache holds: its pairs first, then the default order (the
    unranked tail rank_from_counts writes); rounds only swap, so an empty slot would stay empty."""
    hp = store.hp
    ranked = np.array([(3, 7), (0, 0)])
    cache = new_cache(store, 5)
    line = cache.fill(Profile(hp.n_layer, hp.n_expert, ranked), progress=False)
    want_line = "pre-filled 5 of 5 slots from the profile (2 ranked pairs, then the default order) "
    assert line.startswith(want_line)
    want = [(3, 7), (0, 0), (1, 0), (2, 0), (3, 0)]  # (0, 0) is not admitted twice
    for slot, (layer, e) in enumerate(want):
        assert cache.residency.slot_of(layer * hp.n_expert + e) == slot
        assert cache.storage[slot].numpy().tobytes() == store.blob_bytes(layer, e)
    completed = Profile(hp.n_layer, hp.n_expert, ranked).completed()
    n_pairs = hp.n_layer * hp.n_expert
    assert completed.n_ranked == n_pairs and len(set(completed.pair_ids())) == n_pairs


def test_default_order_is_expert_then_layer(store):
    hp = store.hp
    order = default_order(hp.n_layer, hp.n_expert).ranked
    assert [tuple(p) for p in order[: hp.n_layer + 1]] == [(layer, 0) for layer in range(hp.n_layer)] + [
        (0, 1)
    ]


def test_verify_slot_catches_a_corrupt_slot(store):
    cache = new_cache(store, 2)
    cache.fill(None, progress=False)
    cache.storage[0, 3] ^= 0xFF
    with pytest.raises(SlotCacheError, match="slot 0 .* read back differently"):
        cache.verify_slot(0)


def test_slot_rows_equal_host_rows_bit_for_bit(store):
    hp = store.hp
    cache = new_cache(store, 6)
    cache.fill(None, progress=False)
    layer = 1
    slots = cache.residency.layer_slots(layer)
    resident = np.flatnonzero(slots >= 0)
    x = np.random.default_rng(0).standard_normal((3, hp.n_embd)).astype(np.float32)
    tok = np.array([0, 1, 2, 2])
    exp = resident[[0, 0, 0, -1]]
    with CpuPool(2) as pool:
        from_slots = expert_ffn_cpu(x, tok, slots[exp], cache.layer_view(layer), pool=pool)
        from_host = expert_ffn_cpu(x, tok, exp, store.layer(layer), pool=pool)
    assert np.array_equal(from_slots, from_host)


def test_swap_lands_at_the_boundary(store):
    hp = store.hp
    cache = new_cache(store, 3)
    cache.fill(None, progress=False)  # (0,0), (1,0), (2,0)
    res = cache.residency
    copies = res.schedule_swaps([Swap(layer=1, candidate=5, victim=0, gain=3.0)])
    cache.issue_swaps(copies)
    assert cache.swaps_in_flight() and not res.is_resident(1 * hp.n_expert + 0)
    assert not res.is_resident(1 * hp.n_expert + 5)  # not before the boundary
    landed = cache.land_swaps()
    assert [c.pair for c in landed] == [1 * hp.n_expert + 5]
    slot = res.slot_of(1 * hp.n_expert + 5)
    assert cache.storage[slot].numpy().tobytes() == store.blob_bytes(1, 5)
    assert not cache.swaps_in_flight()


@pytest.mark.parametrize("n_items", [1, 7, 33])
def test_staged_copies_rotate_their_buffers_and_keep_every_byte(store, n_items):
    """The staging path the GPU uses (buffers refilled by several threads, groups of STAGING / 2), on
    plain memory: every slot ends up with its pair's exact bytes, over more copies than buffers."""
    hp = store.hp
    n_slots = hp.n_layer * hp.n_expert
    cache = SlotCache(store, Residency(hp.n_layer, hp.n_expert, n_slots), CPU, staging=True)
    rng = np.random.default_rng(n_items)
    slots = rng.permutation(n_slots)[:n_items]
    items = [(int(s) % hp.n_layer, int(s) // hp.n_layer, int(s)) for s in slots]
    cache.copy_blobs(items[:-1])
    cache.copy_blob(*items[-1])
    for layer, e, slot in items:
        blob = store.blob_bytes(layer, e)
        assert cache.storage[slot, : len(blob)].numpy().tobytes() == blob, (layer, e, slot)
    cache.close()


def test_a_staged_fill_verifies_slot_0_and_holds_the_exact_bytes(store):
    hp = store.hp
    n = hp.n_layer * hp.n_expert - 3  # more copies than staging buffers, not every pair
    cache = SlotCache(store, Residency(hp.n_layer, hp.n_expert, n), CPU, staging=True)
    assert cache.fill(None, progress=False).endswith("slot 0 verified")
    for slot in range(n):
        layer, e = divmod(int(cache.residency.slot_pair[slot]), hp.n_expert)
        blob = store.blob_bytes(layer, e)
        assert cache.storage[slot, : len(blob)].numpy().tobytes() == blob
    cache.close()
