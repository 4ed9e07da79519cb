"""HostBlock: anonymous host memory of exactly the size asked for; page-locked for CUDA when registered."""

import numpy as np
import pytest
import torch

from strata_ray.experts.host_arena import HostBlock


def test_block_is_exactly_its_size_and_views_tile_it():
    block = HostBlock(3 * 1000 + 7, register=False)
    assert block.array.nbytes == 3007 and not block.registered
    a, b = block.view(0, (3, 1000)), block.view(3000, (7,))
    a[...] = 1
    b[...] = 2
    assert block.array[:3000].sum() == 3000 and block.array[3000:].tolist() == [2] * 7
    block.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_registered_block_is_pinned_and_copies_asynchronously():
    n = 300 << 20  # not a power of two: torch's pinned allocator would take 512 MiB
    block = HostBlock(n, register=True)
    host = torch.from_numpy(block.view(0, (n,)))
    assert block.registered and host.is_pinned()
    host.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host)
    del host
    block.close()
    assert not block.registered
    assert np.asarray(block.array).size == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dropped_blocks_unregister_so_their_addresses_register_again():
    """Blocks dropped without close() (a store nobody closed) must not leave their range registered: the
    next mapping at the same address would fail with cudaErrorHostMemoryAlreadyRegistered."""
    import gc

    n = 884736  # the tiny test model's layer: mmap hands the same address back at once
    for _ in range(4):
        block = HostBlock(n, register=True)
        assert block.registered
        del block
        gc.collect()
    torch.zeros(1, device="cuda")  # no stale CUDA error left for torch to find
