"""Many host-to-device byte copies in one launch: the prompt path's expert stream without a copy call each.

A prompt chunk streams every non-resident expert of a layer into the ring slots: on the 80b-a3b ~250
experts a layer, three parts each (gate, up, down: 590 KB), so ~750 `copy_` calls a layer. Each is a
torch op, a cudaMemcpyAsync and a DMA of its own (session 7: 15.7 us each on the H200, ~28 GB/s, plus the
host's Python around them, for 48 layers a chunk). Here the host writes one descriptor row per part
(source address in page-locked host memory, destination address on the device, byte count), and one
kernel copies them all: its programs read the host memory directly over PCIe (page-locked memory is
addressable from the device under unified addressing) and write the device bytes.

The copies are byte-exact (32-bit words; every part's size and both addresses are multiples of 4). The
reference twin is the plain `dst.copy_(src)` of each part, which the GPU test compares byte for byte.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .lazy_triton import jit_bodies

CHUNK_BYTES = 64 << 10  # bytes a program copies (a 590 KB part: 10 programs)
BLOCK_WORDS = 2048  # 32-bit words a program step moves (8 KB)

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


def _gather_body(DESC, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    # DESC int64 [n, 3]: (source address, destination address, bytes). Program (part, chunk of the part).
    p = tl.program_id(0).to(tl.int64)
    src = tl.load(DESC + p * 3).to(tl.pointer_type(tl.int32))
    dst = tl.load(DESC + p * 3 + 1).to(tl.pointer_type(tl.int32))
    n = tl.load(DESC + p * 3 + 2) // 4  # words of this part
    w0 = tl.program_id(1).to(tl.int64) * CHUNK_WORDS
    for off in range(w0, tl.minimum(w0 + CHUNK_WORDS, n), BLOCK):
        idx = off + tl.arange(0, BLOCK)
        live = idx < n
        tl.store(dst + idx, tl.load(src + idx, mask=live), mask=live)


@functools.cache
def _kernel():
    return jit_bodies(_gather_body)[0]


def check_descriptors(desc: np.ndarray) -> None:
    """Descriptors int64 [n, 3] (src, dst, bytes): word-aligned addresses and sizes, positive sizes."""
    if desc.ndim != 2 or desc.shape[1] != 3 or desc.dtype != np.int64:
        raise ValueError(f"gather_copy descriptors must be int64 [n, 3], got {desc.dtype} {list(desc.shape)}")
    if desc.size and ((desc % 4).any() or (desc[:, 2] <= 0).any()):
        raise ValueError("gather_copy: addresses and sizes must be positive multiples of 4 bytes")


def gather_copy(desc: np.ndarray, device: torch.device) -> None:
    """Copy every part desc[i] = (host address, device address, bytes) on the current stream of `device`.

    The source memory must be page-locked (cudaHostRegister / pinned) and stay so until the copies are
    done; the descriptors travel in a page-locked buffer that torch's host allocator keeps until its own
    copy to the device has run."""
    check_descriptors(desc)
    if not desc.shape[0]:
        return
    dev = torch.from_numpy(np.ascontiguousarray(desc)).pin_memory().to(device, non_blocking=True)  # [n, 3]
    chunks = -(-int(desc[:, 2].max()) // CHUNK_BYTES)
    _kernel()[(desc.shape[0], chunks)](dev, CHUNK_WORDS=CHUNK_BYTES // 4, BLOCK=BLOCK_WORDS, num_warps=4)
