"""Page-locked host memory of an exact size, for the experts the device copies straight from.

`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds every
block up to a power of two: a 302 MB expert tensor takes 512 MB of locked RAM, and a 41 GB store
~70 GB. Here the memory is an anonymous mapping of exactly the bytes asked for, registered with CUDA
(`cudaHostRegister`), so `torch.from_numpy` views of it are pinned tensors (non-blocking copies are
truly asynchronous) and nothing is wasted. Registering anonymous memory is quick, unlike the GGUF's
file mapping (which did not return within minutes on the H200 machine).

Without CUDA (or with register=False) the block is plain anonymous memory: the CPU tests run the same
copies and views.
"""

from __future__ import annotations

import mmap
import weakref

import numpy as np
import torch


class HostArenaError(RuntimeError):
    """Page-locking failed (the OS limit on locked memory, or no room); one line."""


def _unregister(addr: int) -> None:
    """cudaHostUnregister, run by close() or by the block's finalizer."""
    torch.cuda.cudart().cudaHostUnregister(addr)


class HostBlock:
    """One anonymous mapping of `nbytes` bytes; page-locked for CUDA when `register`.

    The registration must end before the mapping does: CUDA keeps a freed range registered, and the next
    mapping at that address then fails to register ("already registered", which a test run on the H200
    hit). A block dropped without close() is unregistered by its finalizer, which runs before the mapping
    can go (the block holds it; views that outlive the block keep it mapped, unpinned)."""

    def __init__(self, nbytes: int, register: bool):
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MiB pages where the kernel allows: 512x fewer faults and pins
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes)  # [nbytes]
        self._finalizer = None
        if register:
            self.register()

    def register(self) -> None:
        """Page-lock the block for CUDA. Registering faults in (and zeroes) every page not yet touched, on
        this one thread: fill the block first (on many threads) and register afterwards."""
        if self.registered:
            return
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(self.array.ctypes.data, self.nbytes, 0)
        if int(rc) != 0:
            cudart.cudaGetLastError()  # else the next CUDA call torch checks reports it as its own
            self.close()
            raise HostArenaError(f"could not page-lock {self.nbytes / 2**30:.1f} GiB of host memory "
                                 f"(cudaHostRegister error {int(rc)}; lower STRATA_ARENA_PIN_GIB)")
        self._finalizer = weakref.finalize(self, _unregister, self.array.ctypes.data)

    @property
    def registered(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def view(self, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        """uint8 numpy view of the block from `offset` with `shape` (C order)."""
        n = int(np.prod(shape))
        return self.array[offset : offset + n].reshape(shape)

    def close(self) -> None:
        """Unregister and unmap. Views must not be used afterwards."""
        if self._finalizer is not None:
            self._finalizer()  # unregisters once; a no-op when it already ran
        self.array = np.empty(0, np.uint8)  # drop the exported buffer before unmapping
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view: the mapping goes when it does
            pass
