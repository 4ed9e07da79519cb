"""(layer, expert) pairs and their flat index.

A pair id is `layer * n_expert + expert`: the index into every per-pair table (residency, usage, rank),
so a [n_layers, n_expert] numpy table and its `.reshape(-1)` view agree.
"""

from __future__ import annotations

import numpy as np


def pair_id(layer: int, expert: int, n_expert: int) -> int:
    return layer * n_expert + expert


def pair_of(pid: int, n_expert: int) -> tuple[int, int]:
    """(layer, expert) of a pair id."""
    return divmod(int(pid), n_expert)


def pair_ids(pairs: np.ndarray, n_expert: int) -> np.ndarray:
    """[n, 2] (layer, expert) -> [n] int64 pair ids."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    return pairs[:, 0] * n_expert + pairs[:, 1]


def pairs_of(pids: np.ndarray, n_expert: int) -> np.ndarray:
    """[n] pair ids -> [n, 2] int64 (layer, expert)."""
    pids = np.asarray(pids, dtype=np.int64).reshape(-1)
    return np.stack([pids // n_expert, pids % n_expert], axis=1)


def n_pairs(n_layers: int, n_expert: int) -> int:
    return n_layers * n_expert
