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

`stage_experts` is the decode's form (experts/decode_pipeline.py, STRATA_PCIE_SHARE): the experts to copy
come from a plan on the device (entry k's expert where its start is >= 0), so the host knows neither which
nor how many, and the launch can sit in a CUDA graph. Each is copied whole (gate, up, down) into staging
slot k. The expert kernels then read it from device memory: read in place over PCIe, their small scattered
loads ran at 21 GB/s on the H200 (session 10), against ~45-50 GB/s for these contiguous copies.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .env_knob import env_knob
from .lazy_triton import jit_bodies

CHUNK_BYTES = 64 << 10  # bytes a work item copies (a 590 KB part: 10 items)
BLOCK_WORDS = 2048  # 32-bit words a program step moves (8 KB)
# Programs of a gather launch, each looping over work items. A grid of one program an item (~8,500 for a
# layer's stream) filled every SM for the whole copy (~10 ms at PCIe speed), so the compute stream's next
# kernels (the layer's combine, the next layer's attention / GDN) waited for it (session 18: 9 ms a layer
# at the end of the expert call). PCIe needs few loads in flight: ~10 programs of 8 KB steps reach ~50 GB/s.
# STRATA_GATHER_PROGRAMS (env only) sets it.
GATHER_PROGRAMS = 32

tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


def _gather_body(DESC, n_items, chunks, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    # DESC int64 [n, 3]: (source address, destination address, bytes). Work item w = (part w // chunks,
    # chunk w % chunks of the part); program i takes items i, i + programs, ... (a bounded grid: see
    # GATHER_PROGRAMS)
    for w in range(tl.program_id(0), n_items, tl.num_programs(0)):
        p = (w // chunks).to(tl.int64)
        src = tl.load(DESC + p * 3).to(tl.pointer_type(tl.int32))
        dst = tl.load(DESC + p * 3 + 1).to(tl.pointer_type(tl.int32))
        n = tl.load(DESC + p * 3 + 2) // 4  # words of this part
        w0 = (w % chunks).to(tl.int64) * CHUNK_WORDS
        for off in range(w0, tl.minimum(w0 + CHUNK_WORDS, n), BLOCK):
            idx = off + tl.arange(0, BLOCK)
            live = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=live), mask=live)


def _stage_body(START, EXPERT, SRC, DST, slot_bytes, n_items, chunks, CHUNK_WORDS: tl.constexpr,
                BLOCK: tl.constexpr):
    # START, EXPERT int32 [K]: entry k is copied where START[k] >= 0, expert EXPERT[k]; SRC int64 [3, 4]: per
    # part (host address of expert 0, bytes from one expert to the next, bytes of the part, the part's offset
    # in a staging slot); DST uint8: the staging slots, slot_bytes apart. Work item w = (entry, part, chunk),
    # chunk fastest; program i takes items i, i + programs, ... (one item each, or a bounded grid).
    for w in range(tl.program_id(0), n_items, tl.num_programs(0)):
        k = w // (3 * chunks)
        part = ((w // chunks) % 3).to(tl.int64)
        live = tl.load(START + k) >= 0
        expert = tl.load(EXPERT + k).to(tl.int64)
        src = (tl.load(SRC + part * 4) + expert * tl.load(SRC + part * 4 + 1)).to(tl.pointer_type(tl.int32))
        n = tl.where(live, tl.load(SRC + part * 4 + 2) // 4, 0)  # words of this part; none for other entries
        dst = (DST + k.to(tl.int64) * slot_bytes + tl.load(SRC + part * 4 + 3)).to(tl.pointer_type(tl.int32))
        w0 = (w % chunks).to(tl.int64) * CHUNK_WORDS
        for off in range(w0, tl.minimum(w0 + CHUNK_WORDS, n), BLOCK):
            idx = off + tl.arange(0, BLOCK)
            m = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)


def stage_chunk_kib(raw: str) -> int:
    """A value of STRATA_STAGE_CHUNK_KIB: KiB a staging program copies (ValueError naming what is allowed;
    config.py refuses a bad one with its one line when the engine starts)."""
    v = int(raw) if raw.isascii() and raw.isdigit() else 0
    if not 8 <= v <= 1 << 20 or v % 8:
        raise ValueError("a multiple of 8 from 8 to 1048576")
    return v


# bytes a staging program copies by default (a 590 KB part in 18 programs); STRATA_STAGE_CHUNK_KIB (env only)
# sets it, read at the first staging launch: fewer, longer programs would leave more of the SMs to the
# resident tiles beside them (session 11: the staging copy slowed them ~5x); session 12 measured 32 and 128
# KiB the same. The bytes copied are the same either way.
STAGE_CHUNK_BYTES = 32 << 10


@functools.cache
def _stage_chunk_bytes() -> int:
    return env_knob("STRATA_STAGE_CHUNK_KIB", stage_chunk_kib, STAGE_CHUNK_BYTES >> 10) << 10


@functools.cache
def _kernel():
    return jit_bodies(_gather_body)[0]


@functools.cache
def _stage_kernel():
    return jit_bodies(_stage_body)[0]


def stage_table(parts, offsets, slot_bytes: int) -> np.ndarray:
    """The int64 [3, 4] table stage_experts reads: per part (gate, up, down) of a page-locked host layer,
    parts[i] = (address of expert 0, bytes from one expert to the next, bytes of the part) (as
    HostStore.pinned_addresses gives them) and offsets[i], the part's offset in a staging slot of
    slot_bytes. Everything must be a multiple of 4 bytes and fit in the slot (ValueError, one line)."""
    table = np.array([(*p, o) for p, o in zip(parts, offsets, strict=True)], np.int64)
    if table.shape != (3, 4):
        raise ValueError(f"stage_table: three parts of (address, stride, bytes, offset), got {table.shape}")
    if (table % 4).any() or slot_bytes % 4 or (table[:, 2] <= 0).any():
        raise ValueError("stage_table: addresses, strides, sizes and offsets must be multiples of 4 bytes")
    if int((table[:, 2] + table[:, 3]).max()) > slot_bytes:
        raise ValueError("stage_table: a part ends past its staging slot")
    return table


def stage_experts(start: torch.Tensor, expert: torch.Tensor, table: torch.Tensor, staging: torch.Tensor,
                  part_bytes: int, programs: int | None = None) -> None:
    """Copy the experts a decode plan picked into staging slots, on the current stream (no host sync:
    graph-capturable). start, expert: int32 [K] on the device (entry k is copied where start[k] >= 0,
    expert expert[k] into slot k); table: stage_table's int64 [3, 4] on the device; staging: uint8
    [>= K, slot bytes] on the device, 4-byte aligned; part_bytes: the table's largest part. programs: a
    bounded grid that leaves the other SMs to kernels beside it (None: one program a chunk)."""
    if table.shape != (3, 4) or table.dtype != torch.int64:
        raise ValueError(f"stage_experts: table must be int64 [3, 4], got {table.dtype} {list(table.shape)}")
    if staging.ndim != 2 or staging.dtype != torch.uint8 or staging.shape[0] < start.numel():
        raise ValueError(f"stage_experts: staging must be uint8 [>= {start.numel()}, slot bytes]")
    if staging.data_ptr() % 4 or staging.stride(0) != staging.shape[1]:
        raise ValueError("stage_experts: staging must be contiguous and 4-byte aligned")
    chunk = _stage_chunk_bytes()
    chunks = -(-part_bytes // chunk)
    n_items = start.numel() * 3 * chunks
    grid = n_items if programs is None else max(1, min(programs, n_items))
    _stage_kernel()[(grid,)](start, expert, table, staging, staging.shape[1], n_items, chunks,
                             CHUNK_WORDS=chunk // 4, BLOCK=BLOCK_WORDS, num_warps=4)


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
    n_items = desc.shape[0] * chunks
    _kernel()[(min(n_items, gather_programs()),)](dev, n_items, chunks, CHUNK_WORDS=CHUNK_BYTES // 4,
                                                   BLOCK=BLOCK_WORDS, num_warps=4)


def gather_programs_value(raw: str) -> int:
    """A value of STRATA_GATHER_PROGRAMS (ValueError naming what is allowed; config.py refuses a bad one
    with its one line when the engine starts)."""
    v = int(raw) if raw.isascii() and raw.isdigit() else 0
    if not 1 <= v <= 65535:
        raise ValueError("an integer from 1 to 65535")
    return v


@functools.cache
def gather_programs() -> int:
    return env_knob("STRATA_GATHER_PROGRAMS", gather_programs_value, GATHER_PROGRAMS)


# programs of a decode layer's copies ahead of its routing (experts/decode_pipeline): they run beside the
# layer's mixer, whose kernels want the SMs, and PCIe needs few loads in flight; STRATA_AHEAD_PROGRAMS (env
# only, the gather's values) sets it
AHEAD_PROGRAMS = 16


@functools.cache
def ahead_programs() -> int:
    return env_knob("STRATA_AHEAD_PROGRAMS", gather_programs_value, AHEAD_PROGRAMS)


@functools.cache
def share_programs() -> int | None:
    """Programs of a decode layer's PCIe share copy (STRATA_SHARE_PROGRAMS, env only, the gather's values;
    unset: one program a chunk). In session 20's trace that copy's ~114 programs ran beside the resident
    tiles and slowed them ~5x (13 -> 58 us a layer), while 16 programs of the copies ahead moved the same
    42-44 GB/s: a bounded grid is the A/B for the next GPU call."""
    v = env_knob("STRATA_SHARE_PROGRAMS", gather_programs_value, 0)
    return v or None
