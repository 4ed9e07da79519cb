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
