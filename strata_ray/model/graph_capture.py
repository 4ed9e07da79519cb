"""A CUDA graph capture with Python's cycle collector held off for its length.

torch.cuda.graph no longer collects garbage before a capture (recent torch does only under
torch.compiler.config.force_cudagraph_gc: a collection before each of many captures is slow), so a reference
cycle that became garbage before a capture (an earlier engine's buffers, a test's model) may be collected
inside it, whenever an allocation there crosses the collector's threshold. Freeing such a cycle's tensors
there runs their deleters under the capture: a page-locked tensor of torch's host allocator records or
queries CUDA events as it goes, which a capture in global mode forbids, and an error inside a C++ deleter
ends the process (session 55: `pytest -m gpu tests/experts/test_tiered_gpu.py` aborted on an H100 with the
main thread "Garbage-collecting" under the decode graphs' capture, no message). With the collector held off,
such garbage waits for the next collection, outside any capture; tensors freed by their last reference inside
a capture are the capturing code's own (none of the engine's are page-locked).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """Python's automatic cycle collection off inside the block; on again after it where it was on before
    (an explicit gc.collect() still runs)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    """torch.cuda.graph(graph, pool=pool) with the cycle collector held off for the capture."""
    with collector_held(), torch.cuda.graph(graph, pool=pool):
        yield
