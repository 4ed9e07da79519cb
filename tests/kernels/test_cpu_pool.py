"""The CPU pool runs every job, in parallel threads, and re-raises a job's error."""

from __future__ import annotations

import threading

import pytest

from strata_ray.kernels.cpu_pool import CpuPool, default_pool


def test_runs_all_jobs_on_several_threads():
    seen, names = [], set()
    lock = threading.Lock()

    def job(i):
        with lock:
            seen.append(i)
            names.add(threading.current_thread().name)

    with CpuPool(2) as pool:
        pool.run(job, [(i,) for i in range(50)])
    assert sorted(seen) == list(range(50))
    assert all(n.startswith("strata-cpu") for n in names)


def test_job_error_propagates():
    def job(i):
        if i == 3:
            raise ValueError("bad job 3")

    with CpuPool(2) as pool, pytest.raises(ValueError, match="bad job 3"):
        pool.run(job, [(i,) for i in range(6)])


def test_default_pool_is_shared():
    assert default_pool() is default_pool() and default_pool().n_threads >= 1
