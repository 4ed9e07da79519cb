"""The primary expert cache: N slots of expert blobs on the primary device, filled hottest first.

Storage is one uint8 [S + R, max_blob] tensor: S cache slots whose occupants the Residency table
tracks, then R ring slots the prompt path streams non-resident experts through (GPU only). Any
layer's blob fits any slot; per layer, `layer_view` reinterprets the slots as that layer's
gate/up/down tensors [S + R, rows, row_bytes] (strided views), which is the slot table the contract
kernels take. On a CPU primary the "slots" are a second CPU tier (a plain uint8 tensor) and the same
numba kernels read them, so CI exercises every placement path.

Adaptive swap copies run on their own CUDA stream (after the compute stream's pending reads of the
victim's slot) and are marked by one event; the newcomer becomes resident at the next window
boundary, after the event (`land_swaps`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from strata_ray.experts.host_store import HostStore
from strata_ray.experts.pairs import pair_of
from strata_ray.experts.profile import Profile, rank_from_counts
from strata_ray.experts.residency import Residency, SlotCopy
from strata_ray.kernels.contract import ExpertLayer

log = logging.getLogger("strata_ray.experts")

MIB = 2**20
STAGING = 16  # pinned staging buffers for blob copies: two groups, one filling while the other copies
FILL_THREADS = 8  # threads that fill a group's staging buffers from the host store at once


def blob_views(storage: torch.Tensor, layout) -> ExpertLayer:
    """A layer's gate/up/down over slots of blobs: storage uint8 [S, blob bytes] (torch) -> uint8 [S, rows,
    row_bytes] strided views, in the blob layout (host_store.BlobLayout.parts) that copies fill."""
    n, blob = storage.shape
    parts = [storage.as_strided((n, r, rb), (blob, rb, 1), storage.storage_offset() + off)
             for r, rb, off in layout.parts]
    return ExpertLayer(*parts, layout.gate_type, layout.up_type, layout.down_type)


class SlotCacheError(RuntimeError):
    """The cache could not be set up (slot 0 read back differently, no memory); one line."""


def cache_slots(config, store: HostStore, device: torch.device, ring_slots: int = 0) -> int:
    """Slots for `--expert-cache N|auto`, capped at the number of trunk pairs.

    auto: (free VRAM - vram_reserve_mib - a prompt chunk's temporaries - the prompt ring's `ring_slots`
    slots) / max_blob, where
    --vram-budget-mib pretends the card has that much memory (budget minus what is in use now). A CPU
    primary has no VRAM: auto is 0 slots unless a budget is given (then the budget minus the reserve, as
    host memory)."""
    n_pairs = store.hp.n_layer * store.n_expert
    if config.expert_cache is not None:
        return min(config.expert_cache, n_pairs)
    reserve = config.vram_reserve_mib * MIB
    if device.type == "cuda":
        from strata_ray.engine.prefill import chunk_bytes, prefill_chunk

        reserve += chunk_bytes(store.hp, prefill_chunk(config, "cuda")) + ring_slots * store.max_blob
        free, total = torch.cuda.mem_get_info(device)
        if config.vram_budget_mib is not None:
            free = config.vram_budget_mib * MIB - (total - free)
    elif config.vram_budget_mib is not None:
        free = config.vram_budget_mib * MIB
    else:
        return 0
    return int(min(max(0, free - reserve) // store.max_blob, n_pairs))


def _fill_reporter(progress, total: int):
    """(callback or None, tqdm bar to close or None) for SlotCache.fill's `progress` argument."""
    if callable(progress):
        return (progress, None) if total else (None, None)
    if not progress or not total or not sys.stderr.isatty():
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="expert cache", unit="slot", leave=False)
    return (lambda done, _total: bar.update(done - bar.n)), bar


def default_order(n_layers: int, n_expert: int) -> Profile:
    """Without a profile: every pair in expert-then-layer order (the reference's fill)."""
    return rank_from_counts(np.zeros((n_layers, n_expert), dtype=np.int64))


class SlotCache:
    def __init__(
        self, store: HostStore, residency: Residency, device: torch.device | str, ring_slots: int = 0,
        staging: bool | None = None,
    ):
        """staging: copy blobs through the staging buffers (default: on CUDA). On a CPU primary it runs the
        same buffer rotation with plain memory and synchronous copies (the tests' view of the CUDA path)."""
        self.store, self.residency = store, residency
        self.device = torch.device(device)
        self.n_slots = residency.n_slots
        self.ring_slots = ring_slots
        self.blob = store.max_blob
        try:
            self.storage = torch.zeros(
                (self.n_slots + ring_slots, self.blob), dtype=torch.uint8, device=self.device
            )  # [S + R, max_blob]
        except torch.OutOfMemoryError:
            raise SlotCacheError(
                f"expert cache: {self.n_slots} slots of {self.blob / MIB:.1f} MiB do not fit "
                f"on {self.device} (lower --expert-cache or raise --vram-reserve-mib)"
            ) from None
        self._views: dict[int, ExpertLayer] = {}
        self.is_cuda = self.device.type == "cuda"
        self.swap_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._swap_event = None
        # prompt ring in two halves (copy_ring): copies into one half on their own stream while the kernels
        # read the other; _ring_read[h] marks the end of the compute stream's last reads of half h
        self.ring_stream = torch.cuda.Stream(self.device) if self.is_cuda and ring_slots else None
        self._ring_read: list = [None, None]
        self._ring_copied: list = [None, None]  # the ring stream's last copies into half h (copy_ring)
        self.fill_seconds = 0.0
        self.fill_line = ""
        self.staged = self.is_cuda if staging is None else staging
        self._staging: list[torch.Tensor] | None = None  # pinned blob buffers (CUDA)
        self._staging_events: list = []
        self._next_staging = 0
        self._fillers: ThreadPoolExecutor | None = None

    # -- slot table views ----------------------------------------------------------------------------
    def layer_view(self, b: int) -> ExpertLayer:
        """Layer b's gate/up/down over every slot: uint8 [S + R, rows, row_bytes] strided views (numpy
        on a CPU primary, torch on the device)."""
        view = self._views.get(b)
        if view is None:
            lay = self.store.layouts[b]
            if self.is_cuda:
                view = blob_views(self.storage, lay)
            else:
                n, base = self.storage.shape[0], self.storage.numpy()
                parts = [
                    np.lib.stride_tricks.as_strided(
                        base[:, off:], (n, r, rb), (self.blob, rb, 1), writeable=False
                    )
                    for r, rb, off in lay.parts
                ]
                view = ExpertLayer(*parts, lay.gate_type, lay.up_type, lay.down_type)
            self._views[b] = view
        return view

    def ring_slot(self, i: int) -> int:
        return self.n_slots + i

    def copy_ring(self, items: Sequence[tuple[int, int, int]], half: int, wait: bool = True) -> None:
        """copy_blobs into ring half `half` on the ring stream, after the compute stream's last reads of
        that half (ring_read); the compute stream then waits for these copies only, so the next half's
        copies run while this half's kernels do. wait=False leaves that wait to a later `ring_wait(half)`
        (a prefetch: the copies run beside whatever the compute stream does first). On a CPU primary:
        copy_blobs."""
        if self.ring_stream is None:
            self.copy_blobs(items)
            return
        with torch.cuda.stream(self.ring_stream):
            if self._ring_read[half] is not None:
                self.ring_stream.wait_event(self._ring_read[half])
            self.copy_blobs(items)
            copied = torch.cuda.Event()
            copied.record(self.ring_stream)
        self._ring_copied[half] = copied
        if wait:
            self.ring_wait(half)

    def ring_wait(self, half: int) -> None:
        """The compute stream waits for the last copies into ring half `half` (no-op on a CPU primary)."""
        if self.ring_stream is not None and self._ring_copied[half] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ring_copied[half])

    def ring_read(self, half: int) -> None:
        """The compute stream's kernels reading ring half `half` are queued: later copies into it wait."""
        if self.ring_stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._ring_read[half] = event

    def lend_ring(self) -> None:
        """Before a loan's first copies into the ring slots: the swap stream (which runs them) waits for the
        ring stream's copies still in flight (a prefetch the last prompt chunk made but never read); the
        kernels that read the ring are ordered before them by issue_swaps' mark."""
        if self.ring_stream is not None:
            self.swap_stream.wait_stream(self.ring_stream)

    def reclaim_ring(self) -> None:
        """After the loan closed, before the ring's next copies: the ring stream waits for every read of the
        lent slots enqueued so far (the decode's tokens) and for the loan's copies still in flight."""
        if self.ring_stream is not None:
            self.ring_stream.wait_stream(torch.cuda.current_stream(self.device))
            self.ring_stream.wait_stream(self.swap_stream)

    # -- copies --------------------------------------------------------------------------------------
    def copy_blob(self, layer: int, expert: int, slot: int, non_blocking: bool = False) -> None:
        """Byte-exact copy of the pair's gate | up | down into `slot`. On CUDA through a ring of pinned
        staging buffers (numpy fills one, the H2D copy runs on the current stream, an event guards
        the buffer's reuse), so copies run at pinned speed whether or not the map is page-locked."""
        if self.is_cuda and self._copy_pinned(layer, expert, slot):
            return
        if not self.staged:
            self._write_blob(self.storage.numpy()[slot], layer, expert)
            return
        i = self._take_staging()
        self._issue(i, self._fill(i, layer, expert), slot)

    def copy_blobs(self, items: Sequence[tuple[int, int, int]]) -> None:
        """copy_blob for many (layer, expert, slot). Pairs of pinned layers are copied straight from the
        store (three asynchronous copies each, no host memcpy); the others in groups of STAGING / 2: a
        group's buffers are filled by FILL_THREADS threads at once (numpy copies release the GIL) while
        the previous group's host-to-device copies run, so the host side is not one memcpy at a time."""
        if self.is_cuda:
            items = self._copy_pinned_many(items)
        if not self.staged:
            for layer, expert, slot in items:
                self.copy_blob(layer, expert, slot)
            return
        group = STAGING // 2
        for g0 in range(0, len(items), group):
            part = items[g0 : g0 + group]
            bufs = [self._take_staging() for _ in part]
            if len(part) == 1:
                sizes = [self._fill(bufs[0], part[0][0], part[0][1])]
            else:
                if self._fillers is None:
                    self._fillers = ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="strata-stage")
                sizes = list(self._fillers.map(self._fill, bufs, [p[0] for p in part], [p[1] for p in part]))
            for i, n, (_, _, slot) in zip(bufs, sizes, part, strict=True):
                self._issue(i, n, slot)

    def _copy_pinned_many(self, items: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Copy the pairs of pinned layers on the current stream; return the others. All in one gather
        launch (kernels/gather_copy: the device reads the page-locked store itself) unless
        STRATA_GATHER_COPY=0, then three copies a pair."""
        if os.environ.get("STRATA_GATHER_COPY", "1") == "0":
            return [it for it in items if not self._copy_pinned(*it)]
        from strata_ray.kernels.gather_copy import gather_copy

        desc, rest = [], []
        base = self.storage.data_ptr()
        for layer, expert, slot in items:
            parts = self.store.pinned_addresses(layer)
            if parts is None or self.blob % 4 or any(v % 4 for part in parts for v in part):
                if not self._copy_pinned(layer, expert, slot):  # the kernel moves aligned 32-bit words
                    rest.append((layer, expert, slot))
                continue
            dst = base + slot * self.blob  # gate | up | down, as copy_blob writes them
            for addr, stride, n in parts:
                desc.append((addr + expert * stride, dst, n))
                dst += n
        gather_copy(np.array(desc, dtype=np.int64).reshape(-1, 3), self.device)
        return rest

    def _copy_pinned(self, layer: int, expert: int, slot: int) -> bool:
        """Copy the pair from its page-locked layer on the current stream; False when it is not pinned."""
        parts = self.store.pinned_parts(layer, expert)
        if parts is None:
            return False
        off = 0
        for p in parts:
            self.storage[slot, off : off + p.numel()].copy_(p, non_blocking=True)
            off += p.numel()
        return True

    def _take_staging(self) -> int:
        """The next staging buffer, once the copy that last read it is done."""
        if self._staging is None:
            pin = self.is_cuda  # page-locked only where a device copies from it
            self._staging = [torch.empty(self.blob, dtype=torch.uint8, pin_memory=pin)
                             for _ in range(STAGING)]
            self._staging_events = [None] * STAGING
        i = self._next_staging
        self._next_staging = (i + 1) % STAGING
        if self._staging_events[i] is not None:
            self._staging_events[i].synchronize()
            self._staging_events[i] = None
        return i

    def _fill(self, i: int, layer: int, expert: int) -> int:
        """Copy the pair's blob into staging buffer i; returns its size in bytes."""
        return self._write_blob(self._staging[i].numpy(), layer, expert)

    def _write_blob(self, dst: np.ndarray, layer: int, expert: int) -> int:
        """The pair's gate | up | down bytes into the front of dst (uint8); returns how many."""
        off = 0
        for p in self.store.blob_parts(layer, expert):
            dst[off : off + p.size] = p
            off += p.size
        return off

    def _issue(self, i: int, n: int, slot: int) -> None:
        """Copy staging buffer i's n bytes into `slot` on the current stream; an event marks its end."""
        self.storage[slot, :n].copy_(self._staging[i][:n], non_blocking=self.is_cuda)
        if self.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._staging_events[i] = event

    def close(self) -> None:
        if self._fillers is not None:
            self._fillers.shutdown(wait=True)
            self._fillers = None

    def _pair(self, pid: int) -> tuple[int, int]:
        return pair_of(pid, self.store.n_expert)

    def fill(self, profile: Profile | None, progress: bool | Callable[[int, int], None] = True) -> str:
        """Admit pairs in profile order (never evicting), copy their blobs, verify slot 0. Returns the
        log line (also logged). progress: a (done, total) callback, or True for a tqdm bar when stderr
        is a terminal (never in a log file), False for none."""
        res = self.residency
        order = profile.completed() if profile is not None else default_order(res.n_layers, res.n_expert)
        t0 = time.perf_counter()
        copies = res.admit_in_rank_order(order)
        report, bar = _fill_reporter(progress, len(copies))
        if report is not None:
            report(0, len(copies))  # the bar appears before the first (possibly slow) copies
        for c0 in range(0, len(copies), 64):
            batch = copies[c0 : c0 + 64]
            self.copy_blobs([(*self._pair(c.pair), c.slot) for c in batch])
            if report is not None:
                report(c0 + len(batch), len(copies))
        if bar is not None:
            bar.close()
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        self.fill_seconds = time.perf_counter() - t0
        verified = self.verify_slot(0) if copies else False
        mb = len(copies) * self.blob / 1e6
        rate = mb / self.fill_seconds if self.fill_seconds > 0 else 0.0
        source = "the profile" if profile is not None else "the default order"
        if profile is not None and len(copies) > profile.n_ranked:  # a short profile, completed
            source += f" ({profile.n_ranked} ranked pairs, then the default order)"
        line = (
            f"pre-filled {len(copies)} of {self.n_slots} slots from {source} in {self.fill_seconds:.2f} s "
            f"({rate:.0f} MB/s)" + ("; slot 0 verified" if verified else "")
        )
        log.info(line)
        self.fill_line = line
        return line

    def verify_slot(self, slot: int) -> bool:
        """Read the slot back and compare it byte for byte with the host store; raise on a mismatch."""
        pid = int(self.residency.slot_pair[slot])
        layer, expert = self._pair(pid)
        want = self.store.blob_bytes(layer, expert)
        got = self.storage[slot, : len(want)].cpu().numpy().tobytes()
        if got != want:
            raise SlotCacheError(
                f"expert cache: slot {slot} (layer {layer}, expert {expert}) read back "
                "differently from the host store"
            )
        return True

    # -- adaptive swaps ------------------------------------------------------------------------------
    def mark(self) -> torch.cuda.Event | None:
        """An event at the end of the work enqueued so far (None on the CPU): issue_swaps(..., after=mark)
        orders copies after it, not after what is enqueued in between."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def issue_swaps(self, copies: list[SlotCopy], after: torch.cuda.Event | None = None) -> None:
        """Start the copies of a round's newcomers into their (already vacated) slots, after every read of
        those slots enqueued so far, or (after, from mark()) after those enqueued before the mark: the work
        enqueued since reads other slots (the victims had left the residency tables it plans with)."""
        if not copies:
            return
        items = [(*self._pair(c.pair), c.slot) for c in copies]
        if not self.is_cuda:
            self.copy_blobs(items)
            return
        if after is not None:
            self.swap_stream.wait_event(after)
        else:
            self.swap_stream.wait_stream(torch.cuda.current_stream(self.device))  # earlier reads of the slots
        with torch.cuda.stream(self.swap_stream):
            self.copy_blobs(items)
            self._swap_event = torch.cuda.Event()
            self._swap_event.record(self.swap_stream)

    def swaps_in_flight(self) -> bool:
        return bool(self.residency.pending)

    def land_swaps(self) -> list[SlotCopy]:
        """At a window boundary: wait for the round's copies, then make the newcomers resident."""
        if not self.residency.pending:
            return []
        if self._swap_event is not None:
            self._swap_event.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(self.swap_stream)
            self._swap_event = None
        return self.residency.apply_pending()
