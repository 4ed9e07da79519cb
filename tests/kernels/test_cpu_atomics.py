"""cpu_atomics: the acquire / release / add intrinsics on array elements, and raise_flag for Python
callers."""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

from strata_ray.kernels.cpu_atomics import (
    fetch_add,
    load_acquire,
    raise_flag,
    raise_flag_value,
    store_release,
)


@njit(nogil=True)
def _publish(data, flag, n, value):
    for i in range(n):
        data[i] = i * 3 + 1
    store_release(flag, 0, value)


@njit(nogil=True)
def _consume(data, flag, value, out):
    while load_acquire(flag, 0) != value:
        pass
    for i in range(data.shape[0]):
        out[i] = data[i]


@njit(nogil=True)
def _count(counter, n):
    for _ in range(n):
        fetch_add(counter, 1, np.int64(1))


def test_a_released_flag_is_seen_after_the_data_it_guards():
    """A producer thread writes 1, 33 and 222 values and then the flag; the consumer, spinning on an acquire
    load of it, reads them all (each element at its own index: a wrong element address would show)."""
    for n in (1, 33, 222):
        data = np.zeros(n, np.int64)
        flag = np.zeros(1, np.uint32)
        out = np.full(n, -1, np.int64)
        consumer = threading.Thread(target=_consume, args=(data, flag, np.uint32(7), out), daemon=True)
        consumer.start()
        _publish(data, flag, n, np.uint32(7))
        consumer.join(timeout=30)
        assert not consumer.is_alive()
        assert np.array_equal(out, np.arange(n) * 3 + 1) and flag[0] == 7


def test_fetch_add_counts_every_add_from_two_threads():
    counter = np.zeros(3, np.int64)
    threads = [threading.Thread(target=_count, args=(counter, 20_000)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.tolist() == [0, 40_000, 0]


def test_raise_flag_stores_the_value_in_the_flags_own_type():
    flag = np.zeros(1, np.uint32)
    raise_flag_value(flag, 0xFFFFFFFF)
    assert flag[0] == 0xFFFFFFFF
    raise_flag_value(flag, 5)
    assert flag[0] == 5
    raise_flag(flag, np.uint32(9))
    assert flag[0] == 9
    assert len(raise_flag.signatures) == 1  # every caller through one signature
