"""The CPU pool runs every job, in parallel threads, and re-raises a job's error."""

from __future__ import annotations

import os
import threading
import time

import pytest

from strata_ray.kernels.cpu_pool import (
    SPIN_NO_SPARE_CORE,
    SPIN_SPARE_CORE,
    CpuPool,
    default_pool,
    spin_default,
)


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


def test_a_failed_job_waits_for_the_others():
    """The error reaches the caller only once every job has finished (they write the caller's arrays)."""
    done = threading.Event()

    def job(i):
        if i == 0:
            raise ValueError("bad job 0")
        time.sleep(0.2)
        done.set()

    with CpuPool(2) as pool:
        with pytest.raises(ValueError, match="bad job 0"):
            pool.run(job, [(0,), (1,)])
        assert done.is_set()


def test_default_pool_is_shared():
    assert default_pool() is default_pool() and default_pool().n_threads >= 1


def test_spin_default_follows_the_spare_core_and_keeps_the_users_setting(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    spin_default(spare_core=True)  # a CUDA engine's pool leaves its caller a core: spin between calls
    assert os.environ["GOMP_SPINCOUNT"] == SPIN_SPARE_CORE
    spin_default(spare_core=False)  # the first setting stands (libgomp reads it once)
    assert os.environ["GOMP_SPINCOUNT"] == SPIN_SPARE_CORE
    monkeypatch.setenv("GOMP_SPINCOUNT", "777")
    spin_default(spare_core=True)
    assert os.environ["GOMP_SPINCOUNT"] == "777"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    spin_default(spare_core=False)
    assert os.environ["GOMP_SPINCOUNT"] == SPIN_NO_SPARE_CORE
