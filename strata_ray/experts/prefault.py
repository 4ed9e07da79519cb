"""Map the host store's expert pages in at load, so decode never takes a page fault.

The experts are numpy views of the memory-mapped GGUF. Without this, the first time the CPU pool
reads an expert every 4 KiB page faults in (a minor fault when the file is in the page cache, a disk
read when not): measured on the 2-core VM, a one-token top-10 call over 80b-a3b experts took 75-190 ms
on first touch against 6-16 ms after, and decode touches new experts for thousands of tokens.

`madvise(MADV_POPULATE_READ)` (Linux 5.14+) fills the page tables of a range in one system call; we
split the ranges into chunks and issue them from a few threads (ctypes drops the GIL). Where the
kernel lacks it, one byte per page is read instead, which faults the same pages in.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger("strata_ray.experts")

MADV_POPULATE_READ = 22  # linux/mman.h (5.14+)
CHUNK = 256 << 20  # bytes per system call: small enough to spread over the threads
RAM_SHARE = 0.8  # prefault only what fits in this share of physical memory (no thrashing)

_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def physical_memory() -> int:
    """Bytes of physical memory (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# what the host keeps for everything else when expert layers move into anonymous memory (pinned or split)
SPARE_LEAVE_GIB, SPARE_LEAVE_SHARE = 8.0, 0.2


def spare_memory_gib() -> float:
    """GiB the host can give expert layers moved out of the file map: its available memory (which counts the
    page cache, so the GGUF's own pages) less max(SPARE_LEAVE_GIB, SPARE_LEAVE_SHARE of physical memory)."""
    leave = max(SPARE_LEAVE_GIB * 2**30, SPARE_LEAVE_SHARE * physical_memory())
    return max(0.0, (available_memory() - leave) / 2**30)


def available_memory() -> int:
    """Bytes the kernel could hand out now, page cache included (MemAvailable; 0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _ranges(arrays: list[np.ndarray]) -> list[tuple[int, int]]:
    """Page-aligned (address, length) chunks covering every array's bytes."""
    page = mmap.PAGESIZE
    out = []
    for a in arrays:
        start = a.__array_interface__["data"][0]
        end = start + a.nbytes
        start -= start % page
        for c in range(start, end, CHUNK):
            out.append((c, min(CHUNK, end - c)))
    return out


def _populate(addr: int, length: int) -> bool:
    """True when the kernel populated the range; False when it lacks MADV_POPULATE_READ."""
    if _libc is None:
        return False
    rc = _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_POPULATE_READ)
    return rc == 0


def _touch(addr: int, length: int) -> None:
    """Read one byte per page (the fallback): faults the pages in."""
    page = mmap.PAGESIZE
    view = np.ctypeslib.as_array(ctypes.cast(ctypes.c_void_p(addr), ctypes.POINTER(ctypes.c_uint8)),
                                 shape=(length,))
    int(view[::page].sum())


def prefault(arrays: list[np.ndarray], threads: int = 8) -> float:
    """Fault in every page of `arrays` (views of a mapped file); returns the seconds it took. Skipped
    (0.0, logged) when the bytes exceed RAM_SHARE of physical memory: then they cannot all stay
    mapped and reading them all now would only evict what was read first."""
    total = sum(a.nbytes for a in arrays)
    ram = physical_memory()
    if ram and total > RAM_SHARE * ram:
        log.info("host store: %.1f GiB of experts exceed %.0f%% of RAM; pages fault in on first use",
                 total / 2**30, 100 * RAM_SHARE)
        return 0.0
    t = time.perf_counter()
    ranges = _ranges(arrays)

    def one(r: tuple[int, int]) -> None:
        if not _populate(*r):
            _touch(*r)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as ex:
        list(ex.map(one, ranges))
    return time.perf_counter() - t
