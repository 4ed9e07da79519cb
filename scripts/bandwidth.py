"""The copy rates the benchmarks hold their numbers against, measured on the machine they run on: host
memory (a threaded memcpy) and device memory (a GPU's own copy), both as (read + write) bytes a second,
best of a few runs. They are the physical limits of the scripts' rooflines (bytes moved / bandwidth)."""

from __future__ import annotations

import time

import numpy as np

from strata_ray.kernels.cpu_pool import CpuPool


def host_copy_gbs(pool: CpuPool, n_bytes: int, repeats: int = 5) -> float:
    """Threaded host memcpy over the pool's threads, (read + write) GB per second (best of `repeats`)."""
    src = np.ones(n_bytes, np.uint8)
    dst = np.empty_like(src)
    cuts = np.linspace(0, n_bytes, pool.n_threads * 4 + 1).astype(np.int64)
    jobs = [(dst[a:b], src[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    pool.run(np.copyto, jobs)  # first touch: page faults are not the memory's rate
    best = 1e9
    for _ in range(repeats):
        t = time.perf_counter()
        pool.run(np.copyto, jobs)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best / 1e9


def device_copy_gbs(device, n_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """A device-to-device copy of n_bytes on `device`, (read + write) GB per second over `repeats` copies
    timed by CUDA events (one untimed copy first)."""
    import torch

    buf = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(buf)
    dst.copy_(buf)
    torch.cuda.synchronize(device)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(repeats):
        dst.copy_(buf)
    t1.record()
    torch.cuda.synchronize(device)
    return 2 * repeats * n_bytes / (t0.elapsed_time(t1) / 1e3) / 1e9
