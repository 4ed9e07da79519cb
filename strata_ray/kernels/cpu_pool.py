"""The CPU expert pool: a thread pool that runs nogil numba kernels in parallel."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait


def cpu_count() -> int:
    """Cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CpuPool:
    """n threads; `run(fn, jobs)` calls fn(*job) for every job and returns (or raises) when all are done.

    The kernels release the GIL (numba nogil=True), so the threads run truly in parallel.
    """

    def __init__(self, n_threads: int | None = None):
        self.n_threads = max(1, n_threads or cpu_count())
        self._executor = ThreadPoolExecutor(max_workers=self.n_threads, thread_name_prefix="strata-cpu")

    def run(self, fn: Callable[..., None], jobs: Sequence[tuple]) -> None:
        if len(jobs) == 1 or self.n_threads == 1:
            for job in jobs:
                fn(*job)
            return
        futures = [self._executor.submit(fn, *job) for job in jobs]
        wait(futures)  # all of them, even after a failure: no job may still write the caller's arrays
        for f in futures:
            f.result()  # re-raises the first failed job's exception

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> CpuPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default: CpuPool | None = None
_default_lock = threading.Lock()


def default_pool() -> CpuPool:
    """One process-wide pool with a thread per available core, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = CpuPool()
        return _default
