"""The expert kernels' tile plan, made on the host: entries sorted by slot, cut into tiles of at most
BT entries of one slot. `expert_gpu.plan_tiles` makes the same plan on the device without a host sync
(for graph capture); callers that already hold the slots on the host (the tiered decode) make it here
and upload it with their other indices in one copy, saving about 15 small launches per layer."""

from __future__ import annotations

import numpy as np


def next_pow2(v: int) -> int:
    """The smallest power of two >= v (1 for v <= 1): Triton's tile sizes must be powers of two."""
    return 1 << max(0, v - 1).bit_length()


def plan_tiles_host(slot: np.ndarray, bt: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """slot int [M] -> (order int32 [M], sorted_slot int32 [M], tile_start int32 [n_tiles]).

    order is a stable argsort of slot; tile t covers sorted entries tile_start[t] .. the next start (or M)
    and holds at most bt entries, all of one slot. Exactly the real tiles: no unused (-1) tiles."""
    slot = np.asarray(slot, dtype=np.int32)
    order = np.argsort(slot, kind="stable").astype(np.int32)
    sorted_slot = slot[order]
    idx = np.arange(slot.size)
    is_start = np.ones(slot.size, dtype=bool)
    is_start[1:] = sorted_slot[1:] != sorted_slot[:-1]
    run_start = np.maximum.accumulate(np.where(is_start, idx, 0))  # [M] where each entry's slot run began
    first = (idx - run_start) % bt == 0
    return order, sorted_slot, idx[first].astype(np.int32)
