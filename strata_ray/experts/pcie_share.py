"""The decode's PCIe share by default (STRATA_PCIE_SHARE unset): from the host's memory rate at load.

In the pipelined decode the GPU computes a share of each layer's misses itself, reading their weights from
the page-locked host store over PCIe, while the CPU pool computes the rest from host memory (DESIGN section
6; experts/decode_pipeline). The two halves end together when the share s (of 1) gives each tier time in
proportion to its rate: s / P = (1 - s) / H, so s = P / (P + H), with H the host's copy rate over the pool's
threads and P the PCIe rate left for the share beside the copies ahead (SHARE_PCIE_GBS, fitted below).
A fixed 400 permille served the H200 host (61 GB/s) and lost on a host with a faster memory:

| host (card) | host copy | share measured best | this rule |
|---|---:|---|---:|
| H200 machine (session 29, 8K, 24 GiB) | 61 GB/s | 300 >= 400 (138-144 against 133-140 tok/s) | 300 |
| H100 machine (session 41, 1K + 8K, 24 GiB) | 140 GB/s | 150 of 0 / 100 / 150 / 250 / 400 / 550 / 700 | 150 |
| another H100 machine (session 41) | 71-73 GB/s | not measured | 250 |

(session 41 on the first H100: share 150 176.6 / 181.6 tok/s at 1K / 8K, 0 173.4 / 178.5, 400 160.6 /
170.4; on the second, the rule's 250-300 gave 140.2-144.2 / 151.6-153.9, with no other share run there).
The share is a split of work, never of arithmetic: any value gives the same bits (the contract).
"""

from __future__ import annotations

import time

import numpy as np

from strata_ray.kernels.cpu_pool import CpuPool

# GB/s of PCIe left for the share's copies beside the copies ahead (both stream from the page-locked store)
SHARE_PCIE_GBS = 25.0
# the load's host copy: ~0.1 s. On session 41's second H100 host 256 MiB gave 58 and 75 GB/s in two loads
# (shares 300 and 250) where 1 GiB gave 71-73: half a GiB, best of five, for a steadier rate
MEASURE_BYTES = 512 << 20


class HostCopy:
    """A threaded host memcpy of n_bytes over the pool's threads, its buffers made and touched once (page
    faults are not the memory's rate); each `gbs()` times one pass, (read + write) GB per second."""

    def __init__(self, pool: CpuPool, n_bytes: int):
        self.pool, self.n_bytes = pool, n_bytes
        src = np.ones(n_bytes, np.uint8)
        dst = np.empty_like(src)
        cuts = np.linspace(0, n_bytes, pool.n_threads * 4 + 1).astype(np.int64)
        self.jobs = [(dst[a:b], src[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        pool.run(np.copyto, self.jobs)  # first touch

    def gbs(self) -> float:
        t = time.perf_counter()
        self.pool.run(np.copyto, self.jobs)
        return 2 * self.n_bytes / (time.perf_counter() - t) / 1e9


def host_copy_gbs(pool: CpuPool, n_bytes: int, repeats: int = 5) -> float:
    """Threaded host memcpy over the pool's threads, (read + write) GB per second (best of `repeats`)."""
    copy = HostCopy(pool, n_bytes)
    return max(copy.gbs() for _ in range(repeats))


def share_for(host_gbs: float) -> int:
    """The share (permille, a multiple of 50) that ends the CPU's and the GPU's misses together."""
    if not host_gbs > 0:
        raise ValueError(f"share_for: host rate {host_gbs} GB/s")
    return int(round(1000 * SHARE_PCIE_GBS / (SHARE_PCIE_GBS + host_gbs) / 50)) * 50


def auto_pcie_share(pool: CpuPool) -> tuple[int, float]:
    """(the share for this host, its measured host copy rate in GB/s)."""
    gbs = host_copy_gbs(pool, MEASURE_BYTES)
    return share_for(gbs), gbs
