"""The host tile plan: a stable sort by slot, cut into tiles of <= bt entries of one slot, covering all."""

from __future__ import annotations

import numpy as np
import pytest

from strata_ray.kernels.tile_plan import plan_tiles_host


@pytest.mark.parametrize("m,n_slots,bt", [(1, 1, 1), (33, 5, 8), (222, 37, 64), (40, 1, 8), (7, 300, 2)])
def test_tiles_hold_one_slot_and_at_most_bt_entries(m, n_slots, bt):
    slot = np.random.default_rng(m).integers(0, n_slots, m).astype(np.int32)
    order, sorted_slot, tile_start = plan_tiles_host(slot, bt)
    assert np.array_equal(order, np.argsort(slot, kind="stable")) and np.array_equal(sorted_slot, slot[order])
    ends = np.append(tile_start[1:], m)
    assert tile_start[0] == 0 and np.all(ends > tile_start) and np.all(ends - tile_start <= bt)
    for a, b in zip(tile_start, ends, strict=True):
        assert np.all(sorted_slot[a:b] == sorted_slot[a])
    # fewest tiles: each slot's run is cut into ceil(run / bt) tiles
    runs = np.bincount(slot, minlength=n_slots)
    assert len(tile_start) == int(np.sum((runs + bt - 1) // bt))
