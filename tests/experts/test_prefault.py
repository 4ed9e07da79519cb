"""prefault: after it, reading a mapped file's pages takes no page faults."""

from __future__ import annotations

import mmap
import os
import resource

import numpy as np

from strata_ray.experts.prefault import _ranges, _touch, prefault

N_PAGES = 4096


def _mapped(tmp_path, name="experts.bin") -> np.ndarray:
    path = tmp_path / name
    path.write_bytes(np.random.default_rng(0).integers(0, 255, N_PAGES * mmap.PAGESIZE, np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)  # drop the file from the page cache: a cold model file on disk
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    return np.memmap(path, dtype=np.uint8, mode="c")  # private copy-on-write, like GGUFFile's map


def _faults() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt + r.ru_majflt


def _faults_reading(a: np.ndarray) -> int:
    before = _faults()
    int(a[:: mmap.PAGESIZE].sum())
    return _faults() - before


def test_reading_a_fresh_map_faults_and_a_prefaulted_one_does_not(tmp_path):
    fresh = _mapped(tmp_path, "a.bin")
    assert _faults_reading(fresh) > 64  # the premise: a cold map faults as it is read
    warm = _mapped(tmp_path, "b.bin")
    prefault([warm[: N_PAGES // 2 * mmap.PAGESIZE], warm[N_PAGES // 2 * mmap.PAGESIZE :]], threads=2)
    assert _faults_reading(warm) < 8


def test_the_fallback_touch_faults_the_pages_in(tmp_path):
    a = _mapped(tmp_path)
    for addr, length in _ranges([a]):
        _touch(addr, length)
    assert _faults_reading(a) < 8


def test_ranges_are_page_aligned_and_cover_the_arrays(tmp_path):
    a = _mapped(tmp_path)
    part = a[100 : 100 + 3 * mmap.PAGESIZE]  # starts mid-page
    (addr, length), = _ranges([part])
    start = part.__array_interface__["data"][0]
    assert addr % mmap.PAGESIZE == 0 and addr <= start and addr + length == start + part.nbytes
