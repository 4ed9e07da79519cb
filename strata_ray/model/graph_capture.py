"""A CUDA graph capture with Python's cycle collector held off for its length.

torch.cuda.graph no longer collects garbage before a capture (recent torch does only under
torch.compiler.config.force_cudagraph_gc: a collection before each of many captures is slow), so a reference
cycle that became garbage before a capture (an earlier engine's buffers, a test's model) may be collected
inside it, whenever an allocation there crosses the collector's threshold, and its finalizers and deleters
then run under the capture: the host arena's cudaHostUnregister, a cupy module's unload, a pinned tensor's
event bookkeeping, calls a capture in global mode may forbid (and a failure inside a C++ deleter ends the
process). Session 55: `pytest -m gpu tests/experts/test_tiered_gpu.py` aborted once on an H100, no message,
with the main thread "Garbage-collecting" under the decode graphs' capture; two later runs of the file passed,
and a probe that frees a dead cycle's pinned tensor inside a plain capture did not abort, so which object's
free ended that run is not known. With the collector held off no collection runs inside a capture: such
garbage waits for the next one, outside any capture.
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
