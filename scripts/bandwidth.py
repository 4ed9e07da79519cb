"""The copy rates the benchmarks hold their numbers against, measured on the machine they run on: host
memory (a threaded memcpy) and device memory (a GPU's own copy), both as (read + write) bytes a second,
best of a few runs. They are the physical limits of the scripts' rooflines (bytes moved / bandwidth)."""

from __future__ import annotations

from strata_ray.experts.pcie_share import host_copy_gbs  # the engine's own (its default PCIe share)

__all__ = ["device_copy_gbs", "host_copy_gbs"]


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
