"""Adaptive rounds: move experts that became hot into a cache tier, in place of its coldest ones.

The rules are the reference engine's (peer-tier-reference section 6): usage += 1 per routed (token, k)
entry; per layer, candidates (not resident, not held elsewhere, usage >= 2.0) replace the coldest
residents while cand >= victim + 1.5; the best gains across layers win, at most `max_swaps` per round;
then usage *= decay. Swaps stay inside a layer, so a slot keeps its layer's blob size.

All arithmetic is float32 like the reference's `float usage[]`, and every sort has an explicit tie
break, so a round is a pure function of its inputs (both actors can agree on it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_USAGE = 2.0
MARGIN = 1.5


@dataclass(frozen=True)
class Swap:
    layer: int
    candidate: int  # expert that moves in
    victim: int  # expert that leaves (its slot receives the candidate)
    gain: float  # usage[candidate] - usage[victim]


def plan_round(
    usage: np.ndarray,
    resident: np.ndarray,
    excluded: np.ndarray | None,
    max_swaps: int,
    min_usage: float = MIN_USAGE,
    margin: float = MARGIN,
) -> list[Swap]:
    """One tier's swaps. usage [L, X] f32, resident [L, X] bool (this tier, pending counted),
    excluded [L, X] bool (pairs another tier holds; never candidates). Best gain first."""
    if max_swaps <= 0:
        return []
    usage = np.asarray(usage, dtype=np.float32)
    resident = np.asarray(resident, dtype=bool)
    if excluded is None:
        excluded = np.zeros_like(resident)
    excluded = np.asarray(excluded, dtype=bool)
    min_usage32, margin32 = np.float32(min_usage), np.float32(margin)
    swaps: list[Swap] = []
    for layer in range(usage.shape[0]):
        u = usage[layer]  # [X]
        cand = np.flatnonzero(~resident[layer] & ~excluded[layer] & (u >= min_usage32))
        if cand.size == 0:
            continue
        vict = np.flatnonzero(resident[layer])
        if vict.size == 0:
            continue
        cand = cand[np.argsort(-u[cand], kind="stable")]  # hottest first, ties by expert
        vict = vict[np.argsort(u[vict], kind="stable")]  # coldest first, ties by expert
        for c, v in zip(cand, vict, strict=False):  # min(#cand, #vict) pairs
            if not u[c] >= u[v] + margin32:  # both sorted: once it fails, every later pair fails
                break
            swaps.append(Swap(layer, int(c), int(v), float(u[c] - u[v])))
    swaps.sort(key=lambda s: (-s.gain, s.layer, s.candidate))
    return swaps[:max_swaps]


def apply_swaps(resident: np.ndarray, swaps: list[Swap]) -> np.ndarray:
    """The resident mask after `swaps` (victims out, candidates in), as a new array."""
    after = np.array(resident, dtype=bool, copy=True)
    for s in swaps:
        after[s.layer, s.victim] = False
        after[s.layer, s.candidate] = True
    return after


@dataclass(frozen=True)
class Round:
    primary: list[Swap]
    peer: list[Swap]


class AdaptiveTier:
    """Usage counters and the round schedule for the primary cache and, optionally, the peer's.

    Call `record(counts)` with each window's routed-entry counts, then `window_done()`; when it says a
    round is due, `run_round(...)` plans it and decays the usage. `heat` keeps the undecayed sum since
    start (the learned profile's order).
    """

    def __init__(
        self,
        n_layers: int,
        n_expert: int,
        adapt_every: int = 4,
        max_swaps: int = 96,
        decay: float = 0.7,
        peer_max_swaps: int = -1,  # -1: same as max_swaps
        min_usage: float = MIN_USAGE,
        margin: float = MARGIN,
    ):
        self.adapt_every, self.max_swaps, self.decay = adapt_every, max_swaps, np.float32(decay)
        self.peer_max_swaps = max_swaps if peer_max_swaps < 0 else peer_max_swaps
        self.min_usage, self.margin = min_usage, margin
        self.usage = np.zeros((n_layers, n_expert), dtype=np.float32)  # [L, X] decayed counts
        self.heat = np.zeros((n_layers, n_expert), dtype=np.float64)  # [L, X] counts since start
        self.windows = 0
        self.rounds = 0
        self.swaps_total = 0

    @property
    def enabled(self) -> bool:
        return self.adapt_every > 0 and self.max_swaps > 0

    def record(self, counts: np.ndarray) -> None:
        """Add routed (token, k) entry counts [L, X] (hits and misses alike)."""
        self.usage += np.asarray(counts, dtype=np.float32)
        self.heat += counts

    def window_done(self) -> bool:
        """Count a finished window; True when a round is due (every `adapt_every` windows)."""
        self.windows += 1
        return self.enabled and self.windows % self.adapt_every == 0

    def run_round(
        self,
        primary_resident: np.ndarray,
        peer_resident: np.ndarray | None = None,
        *,
        primary_busy: bool = False,
        peer_busy: bool = False,
    ) -> Round | None:
        """Plan the primary's swaps, then the peer's, then decay usage.

        Resident masks are [L, X] bool with swaps in flight counted. A tier whose previous swaps are
        still in flight (`*_busy`) plans nothing; a busy primary skips the whole round (None), as the
        reference does. The peer only takes pairs resident on neither card, judged after the
        primary's new swaps, so the two never pick the same pair.
        """
        if primary_busy:
            return None
        peer_held = None if peer_resident is None else np.asarray(peer_resident, dtype=bool)
        primary = plan_round(
            self.usage, primary_resident, peer_held, self.max_swaps, self.min_usage, self.margin
        )
        peer: list[Swap] = []
        if peer_held is not None and not peer_busy:
            primary_after = apply_swaps(primary_resident, primary)
            peer = plan_round(
                self.usage, peer_held, primary_after, self.peer_max_swaps, self.min_usage, self.margin
            )
        self.usage *= self.decay
        self.rounds += 1
        self.swaps_total += len(primary) + len(peer)
        return Round(primary, peer)
