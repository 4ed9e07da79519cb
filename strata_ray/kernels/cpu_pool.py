"""The CPU expert pool: a thread pool that runs nogil numba kernels in parallel."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numba

# numba's OpenMP threads spin 300,000 rounds at each barrier by default. When a core is busy (the engine's
# own Python thread, a shared 2-core host) the caller spins while the worker it waits for is descheduled:
# on the 2-core VM with one core taken, a small expert call cost 8.1 ms at the default, 1.1 ms at 10,000
# rounds, 0.20 ms at 1,000 and 0.10 ms at 100 (one thread alone: 0.05 ms); a one-token top-10 call over
# 80b-a3b experts ran at the same GB/s with 100 as with 1,000. libgomp reads this when numba first loads
# it (the first parallel call); a user's setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "100")


def cpu_count() -> int:
    """Cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CpuPool:
    """n threads; `run(fn, jobs)` calls fn(*job) for every job and returns (or raises) when all are done.

    The kernels release the GIL (numba nogil=True), so the threads run truly in parallel.
    numba_parallel: the quantized expert kernels run as one numba parallel call on numba's own n
    threads (one dispatch per call); False runs them as one job per thread of this pool (a Python
    handoff per job; robust when the cores are oversubscribed).
    """

    def __init__(self, n_threads: int | None = None, numba_parallel: bool = True):
        self.n_threads = max(1, n_threads or cpu_count())
        self.numba_parallel = numba_parallel
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


# numba's workqueue threading layer (the fallback when neither OpenMP nor TBB loads) aborts the process
# when two threads enter parallel regions at once; omp and tbb take concurrent callers.
_workqueue_lock = threading.Lock()


@contextlib.contextmanager
def numba_threads(n: int) -> Iterator[None]:
    """Run the numba parallel calls inside on n of numba's threads (numba's setting is per calling
    thread, so concurrent callers do not disturb each other)."""
    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    before = numba.get_num_threads()
    layer_safe = numba.config.THREADING_LAYER in ("omp", "tbb") or _layer_is_safe()
    with contextlib.nullcontext() if layer_safe else _workqueue_lock:
        numba.set_num_threads(n)
        try:
            yield
        finally:
            numba.set_num_threads(before)


def _layer_is_safe() -> bool:
    """Whether the threading layer numba loaded (after a first parallel call) takes concurrent callers."""
    try:
        return numba.threading_layer() in ("omp", "tbb")
    except ValueError:  # no parallel call yet: the layer is not chosen; be careful for this one call
        return False
