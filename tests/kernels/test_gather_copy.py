"""Host-to-device copies of many parts in one launch (strata_ray/kernels/gather_copy.py).

CPU tests run in CI; the kernel runs on the GPU (python -m pytest -m gpu tests/kernels/test_gather_copy.py)
and under the Triton interpreter on CPU machines with triton (tests/kernels/triton_interpret.py;
STRATA_TRITON_INTERPRET=1 forces it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata_ray.kernels.gather_copy import (
    BLOCK_WORDS,
    CHUNK_BYTES,
    STAGE_CHUNK_BYTES,
    _kernel,
    check_descriptors,
    gather_copy,
    stage_experts,
    stage_table,
)
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()
# (source offset, destination offset, bytes): a part of 1 word, a ragged last step, several chunks
PARTS = [(0, 64, 4), (4 * 1001, 8 * 1000, 3 * CHUNK_BYTES + 12), (CHUNK_BYTES, 0, 60)]


def _src(n: int = 4 * CHUNK_BYTES) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, size=n, dtype=np.uint8)


def _want(src: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, np.uint8)
    for s, d, n in PARTS:
        out[d : d + n] = src[s : s + n]
    return out


def test_descriptor_checks():
    with pytest.raises(ValueError, match=r"int64 \[n, 3\]"):
        check_descriptors(np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="multiples of 4"):
        check_descriptors(np.array([[4, 8, 6]], np.int64))
    with pytest.raises(ValueError, match="multiples of 4"):
        check_descriptors(np.array([[4, 8, 0]], np.int64))
    check_descriptors(np.zeros((0, 3), np.int64))


@interpret
def test_interpreted_copies_every_part():
    pytest.importorskip("triton")
    src = _src()
    dst = np.zeros(4 * CHUNK_BYTES, np.uint8)
    desc = np.array([(src.ctypes.data + s, dst.ctypes.data + d, n) for s, d, n in PARTS], np.int64)
    chunks = -(-int(desc[:, 2].max()) // CHUNK_BYTES)
    kernel = _kernel()  # the launch gather_copy makes, on host memory (the interpreter's "device")
    n_items = len(PARTS) * chunks
    for programs in (1, 3, n_items):  # one program takes every item; a few take several each; one each
        dst[:] = 0
        kernel[(programs,)](torch.from_numpy(desc), n_items, chunks, CHUNK_WORDS=CHUNK_BYTES // 4,
                            BLOCK=BLOCK_WORDS)
        assert np.array_equal(dst, _want(src, dst.size)), programs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_copies_from_a_registered_block():
    from strata_ray.experts.host_arena import HostBlock

    src = _src()
    block = HostBlock(src.size, register=True)
    host = block.view(0, (src.size,))
    host[:] = src
    dst = torch.zeros(4 * CHUNK_BYTES, dtype=torch.uint8, device="cuda")
    desc = np.array([(host.ctypes.data + s, dst.data_ptr() + d, n) for s, d, n in PARTS], np.int64)
    gather_copy(desc, dst.device)
    torch.cuda.synchronize()
    assert np.array_equal(dst.cpu().numpy(), _want(src, dst.numel()))
    del host
    block.close()


# ---- stage_experts: the decode plan's experts, whole, into staging slots ----------------------------------
N_EXP, K_STAGE = 5, 4
PART_BYTES = (3 * STAGE_CHUNK_BYTES + 20, 36, STAGE_CHUNK_BYTES)  # several chunks and a ragged step; 9 words


def _host_layer() -> np.ndarray:
    """[N_EXP, row] uint8: each expert's gate | up | down bytes in a host row, 8 spare bytes after."""
    return np.random.default_rng(11).integers(0, 256, size=(N_EXP, sum(PART_BYTES) + 8), dtype=np.uint8)


def _stage_case(host: np.ndarray, slot_bytes: int):
    offsets = (0, PART_BYTES[0], PART_BYTES[0] + PART_BYTES[1])
    parts = [(host.ctypes.data + o, host.strides[0], n) for o, n in zip(offsets, PART_BYTES, strict=True)]
    start = torch.tensor([-1, 1, -1, 3], dtype=torch.int32)  # entries 1 and 3 are copied
    expert = torch.tensor([0, 4, 2, 1], dtype=torch.int32)
    return stage_table(parts, offsets, slot_bytes), start, expert


def _stage_want(host: np.ndarray, staging: np.ndarray, start, expert) -> np.ndarray:
    want = staging.copy()
    n = sum(PART_BYTES)
    for k in range(K_STAGE):
        if start[k] >= 0:
            want[k, :n] = host[int(expert[k]), :n]
    return want


def test_stage_table_checks():
    host = _host_layer()
    table, _, _ = _stage_case(host, sum(PART_BYTES))
    assert table.shape == (3, 4) and table[1, 3] == PART_BYTES[0]
    with pytest.raises(ValueError, match="past its staging slot"):
        _stage_case(host, sum(PART_BYTES) - 4)
    with pytest.raises(ValueError, match="multiples of 4"):
        stage_table([(6, 8, 4)] * 3, (0, 4, 8), 16)


@interpret
@pytest.mark.parametrize("programs", [None, 1, 5])
def test_interpreted_staging_copies_the_planned_experts_only(programs):
    """One program a chunk, or a bounded grid looping over them (the copies ahead of the routing)."""
    pytest.importorskip("triton")
    host = _host_layer()
    slot_bytes = sum(PART_BYTES) + 12
    table, start, expert = _stage_case(host, slot_bytes)
    staging = torch.full((K_STAGE, slot_bytes), 7, dtype=torch.uint8)  # poison: untouched slots keep it
    before = staging.numpy().copy()
    stage_experts(start, expert, torch.from_numpy(table), staging, max(PART_BYTES), programs=programs)
    assert np.array_equal(staging.numpy(), _stage_want(host, before, start, expert))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("programs", [None, 3])
def test_gpu_staging_from_a_registered_block(programs):
    from strata_ray.experts.host_arena import HostBlock

    src = _host_layer()
    block = HostBlock(src.nbytes, register=True)
    host = block.view(0, src.shape)
    host[:] = src
    slot_bytes = sum(PART_BYTES) + 12
    table, start, expert = _stage_case(host, slot_bytes)
    staging = torch.full((K_STAGE, slot_bytes), 7, dtype=torch.uint8, device="cuda")
    before = staging.cpu().numpy()
    stage_experts(start.cuda(), expert.cuda(), torch.from_numpy(table).cuda(), staging, max(PART_BYTES),
                  programs=programs)
    torch.cuda.synchronize()
    assert np.array_equal(staging.cpu().numpy(), _stage_want(src, before, start, expert))
    del host
    block.close()


def test_copy_programs_come_from_the_environment(monkeypatch):
    """The decode's copies: 16 programs ahead by default, the share one program a chunk (None) unless
    STRATA_SHARE_PROGRAMS bounds it; each read once (cached) where used."""
    from strata_ray.kernels import gather_copy

    for getter in (gather_copy.ahead_programs, gather_copy.share_programs):
        getter.cache_clear()
    monkeypatch.delenv("STRATA_AHEAD_PROGRAMS", raising=False)
    monkeypatch.delenv("STRATA_SHARE_PROGRAMS", raising=False)
    assert gather_copy.ahead_programs() == gather_copy.AHEAD_PROGRAMS and gather_copy.share_programs() is None
    for getter in (gather_copy.ahead_programs, gather_copy.share_programs):
        getter.cache_clear()
    monkeypatch.setenv("STRATA_AHEAD_PROGRAMS", "64")
    monkeypatch.setenv("STRATA_SHARE_PROGRAMS", "32")
    assert gather_copy.ahead_programs() == 64 and gather_copy.share_programs() == 32
    for getter in (gather_copy.ahead_programs, gather_copy.share_programs):
        getter.cache_clear()
