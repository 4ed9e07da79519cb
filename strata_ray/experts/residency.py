"""Which (layer, expert) pair sits in which cache slot: the host tables and their device mirror.

`res[layer * n_expert + e]` is the pair's slot or -1 (the hit test in decode), `slot_pair[slot]` the
pair a slot holds or -1. Adaptive swaps follow the reference's order: the victim leaves at once (the
CPU computes it from the next window on, while its slot is being overwritten), the newcomer waits in
`pending` until its copy has landed and `apply_pending` runs at a window boundary. Every change bumps
`epoch`, so the device mirror (read by the GPU hit path) is refreshed exactly when the table changed.

A loan: `n_lendable` more slots after the S cache slots (the prompt ring's, idle between prompts) hold more
pairs while decoding. `open_loan` makes them available, `lend` admits pairs into them like swaps (pending
until their copies land), `close_loan` takes them back at once before the next prompt chunk streams
through them (their pairs are computed by the other tiers again, with the same bits).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from strata_ray.experts.profile import Profile


@dataclass(frozen=True)
class SlotCopy:
    """One blob copy to issue: the pair's gate/up/down bytes from the host store into `slot`."""

    pair: int
    slot: int


class ResidencyError(Exception):
    """An inconsistent placement request (a bug in the caller, not a user error)."""


class Residency:
    def __init__(self, n_layers: int, n_expert: int, n_slots: int, n_lendable: int = 0):
        if n_slots < 0 or n_lendable < 0:
            raise ValueError(f"n_slots and n_lendable must be >= 0, got {n_slots} and {n_lendable}")
        self.n_layers, self.n_expert, self.n_slots = n_layers, n_expert, n_slots
        self.n_lendable = n_lendable  # slots n_slots .. n_slots + n_lendable - 1: a loan's (see open_loan)
        self.res = np.full(n_layers * n_expert, -1, dtype=np.int32)  # [L*X] pair -> slot or -1
        self.slot_pair = np.full(n_slots + n_lendable, -1, dtype=np.int64)  # [S + R] slot -> pair or -1
        self.free: deque[int] = deque(range(n_slots))  # lowest slot first: slot 0 is filled first
        self.lent_free: deque[int] = deque()  # the open loan's slots not yet given a pair
        self.loan_open = False
        self.pending: list[SlotCopy] = []  # copies in flight: the slot is taken, the pair not yet resident
        self.epoch = 0
        self._mirror: torch.Tensor | None = None
        self._mirror_epoch = -1
        # a CUDA mirror's page-locked sources, two alternating: a copy from pageable memory would first wait
        # for every kernel already queued (the chained decode queues a whole token before the refresh);
        # a source is rewritten two refreshes later, once its copy ran (its event: long done by then)
        self._staging: list[torch.Tensor] = []
        self._staged_done: list[torch.cuda.Event | None] = [None, None]  # after each source's last copy
        self._refreshes = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def n_resident(self) -> int:
        return int((self.res >= 0).sum())

    def slot_of(self, pair: int) -> int:
        return int(self.res[pair])

    def is_resident(self, pair: int) -> bool:
        return self.res[pair] >= 0

    def resident_mask(self, include_pending: bool = False) -> np.ndarray:
        """[L, X] bool. With include_pending, swaps still in flight count as resident."""
        mask = self.res >= 0
        if include_pending and self.pending:
            mask = mask.copy()
            mask[[c.pair for c in self.pending]] = True
        return mask.reshape(self.n_layers, self.n_expert)

    def layer_slots(self, layer: int) -> np.ndarray:
        """[X] int32 view: slot of each expert of `layer`, -1 where not resident."""
        return self.res[layer * self.n_expert : (layer + 1) * self.n_expert]

    # -- changes ---------------------------------------------------------------------------------
    def make_resident(self, pair: int, slot: int, *, reserved: bool = False) -> None:
        """Place `pair` in `slot`: a free slot, or (reserved=True) one a pending swap holds."""
        if self.res[pair] >= 0:
            raise ResidencyError(f"pair {pair} is already resident in slot {self.res[pair]}")
        if self.slot_pair[slot] >= 0:
            raise ResidencyError(f"slot {slot} already holds pair {self.slot_pair[slot]}")
        if not reserved:
            if slot >= self.n_slots:  # a loan's slot
                if slot not in self.lent_free:
                    raise ResidencyError(f"slot {slot} is not a free slot of an open loan")
                self.lent_free.remove(slot)
            elif self.free and self.free[0] == slot:  # the fill's case: O(1)
                self.free.popleft()
            elif slot in self.free:
                self.free.remove(slot)
            else:
                raise ResidencyError(f"slot {slot} is neither free nor reserved")
        self.res[pair] = slot
        self.slot_pair[slot] = pair
        self.epoch += 1

    def evict(self, pair: int, *, to_free_list: bool = True) -> int:
        """Make `pair` non-resident now; returns its slot (back on the free list unless reserved)."""
        slot = int(self.res[pair])
        if slot < 0:
            raise ResidencyError(f"pair {pair} is not resident")
        self.res[pair] = -1
        self.slot_pair[slot] = -1
        if to_free_list:
            (self.lent_free if slot >= self.n_slots else self.free).append(slot)
        self.epoch += 1
        return slot

    def admit_in_rank_order(self, profile: Profile, n_slots: int | None = None) -> list[SlotCopy]:
        """Fill free slots in profile order; never evicts. Stops when no slot is left (or after
        `n_slots` admissions). Returns the copies the caller must perform, in admission order."""
        if (profile.n_layers, profile.n_expert) != (self.n_layers, self.n_expert):
            raise ResidencyError("profile shape differs from the residency table's")
        budget = len(self.free) if n_slots is None else min(n_slots, len(self.free))
        copies: list[SlotCopy] = []
        for pair in profile.pair_ids():
            if len(copies) == budget:
                break
            if self.res[pair] >= 0 or any(c.pair == pair for c in self.pending):
                continue
            slot = self.free[0]
            self.make_resident(int(pair), slot)
            copies.append(SlotCopy(int(pair), slot))
        return copies

    def schedule_swaps(self, swaps: Iterable) -> list[SlotCopy]:
        """Apply an adaptive round's swaps (objects with .layer, .candidate, .victim): each victim
        leaves now, its slot is reserved for the candidate whose copy the caller issues. A swap that no
        longer fits the placement (planned before a loan came or went: its victim gone, its candidate
        resident or on its way) is dropped."""
        copies = []
        coming = {c.pair for c in self.pending}
        for s in swaps:
            victim = s.layer * self.n_expert + s.victim
            candidate = s.layer * self.n_expert + s.candidate
            if self.res[victim] < 0 or self.res[candidate] >= 0 or candidate in coming:
                continue
            slot = self.evict(victim, to_free_list=False)
            coming.add(candidate)
            copy = SlotCopy(candidate, slot)
            self.pending.append(copy)
            copies.append(copy)
        return copies

    def apply_pending(self) -> list[SlotCopy]:
        """At a window boundary, after the swap copies have landed: newcomers become resident."""
        done, self.pending = self.pending, []
        for c in done:
            self.make_resident(c.pair, c.slot, reserved=True)
        return done

    # -- a loan of more slots ----------------------------------------------------------------------
    def open_loan(self) -> None:
        """Make the n_lendable slots available to `lend` (no-op while a loan is open)."""
        if not self.loan_open:
            self.lent_free = deque(range(self.n_slots, self.n_slots + self.n_lendable))
            self.loan_open = True

    def lend(self, pairs: Iterable[int], limit: int) -> list[SlotCopy]:
        """Admit up to `limit` of `pairs` (in order, skipping resident and pending ones) into the open loan's
        free slots, as pending copies: the caller issues them, `apply_pending` lands them."""
        copies: list[SlotCopy] = []
        if not self.loan_open:
            return copies
        coming = {c.pair for c in self.pending}
        for pair in pairs:
            if len(copies) == limit or not self.lent_free:
                break
            pair = int(pair)
            if self.res[pair] >= 0 or pair in coming:
                continue
            copy = SlotCopy(pair, self.lent_free.popleft())
            self.pending.append(copy)
            coming.add(pair)
            copies.append(copy)
        return copies

    def close_loan(self) -> int:
        """Take the loan's slots back now: their pairs leave, copies pending into them are dropped (the caller
        orders later writes of those slots after the copies in flight). Returns how many pairs left."""
        if not self.loan_open:
            return 0
        lent = np.flatnonzero(self.slot_pair[self.n_slots :] >= 0) + self.n_slots
        for slot in lent:
            self.res[self.slot_pair[slot]] = -1
            self.slot_pair[slot] = -1
        self.pending = [c for c in self.pending if c.slot < self.n_slots]
        self.lent_free = deque()
        self.loan_open = False
        self.epoch += 1
        return int(lent.size)

    # -- device mirror ---------------------------------------------------------------------------
    def device_table(self, device: torch.device | str) -> torch.Tensor:
        """[L*X] int32 copy of `res` on `device`, refreshed in place when the epoch moved (in place:
        a captured graph keeps pointing at the same storage)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device: one mirror
            device = torch.device("cuda", torch.cuda.current_device())
        if self._mirror is None or self._mirror.device != device:
            self._mirror = torch.empty(self.res.shape, dtype=torch.int32, device=device)
            self._mirror_epoch = -1
            self._staging = [torch.empty(self.res.shape, dtype=torch.int32, pin_memory=True)
                             for _ in range(2)] if device.type == "cuda" else []
        if self._mirror_epoch != self.epoch:
            if self._staging:
                i = self._refreshes % 2
                self._refreshes += 1
                if self._staged_done[i] is not None:  # long done, but never rewrite a source in flight
                    self._staged_done[i].synchronize()
                self._staging[i].numpy()[:] = self.res
                self._mirror.copy_(self._staging[i], non_blocking=True)
                self._staged_done[i] = torch.cuda.Event()
                self._staged_done[i].record()
            else:
                self._mirror.copy_(torch.from_numpy(self.res))
            self._mirror_epoch = self.epoch
        return self._mirror
