"""The host store: every routed expert's gate/up/down bytes, straight from the memory-mapped GGUF.

Nothing is copied: each layer's `ffn_{gate,up,down}_exps` (or fused `ffn_gate_up_exps`) is a zero-copy
view of the file map, uint8 [X, rows, row_bytes], which the CPU pool reads in place. With CUDA and
`pin_gib` (STRATA_ARENA_PIN_GIB) set, whole layers up to that cap move into page-locked anonymous memory
(host_arena.HostBlock), which the device copies from directly; blob copies of the rest go through the slot
cache's pinned staging buffers. A fused `ffn_gate_up_exps` layer left in the file map is split at load into
anonymous memory of its own (not page-locked) while the host has room: its gate and up halves are strided
views, and the CPU kernels read C-contiguous blocks, so each CPU expert call copied the layer's gate and up.

A blob is one pair's bytes in a fixed order, gate | up | down: the unit a cache slot holds.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from strata_ray.experts.host_arena import HostArenaError, HostBlock
from strata_ray.experts.prefault import prefault, spare_memory_gib
from strata_ray.kernels.contract import QUANT_TYPES, ExpertLayer, type_name
from strata_ray.kernels.cpu_pool import cpu_count
from strata_ray.model.hparams import ModelFormatError

PIN_THREADS = 8  # threads copying the experts into page-locked memory at load (STRATA_ARENA_PIN_GIB)

log = logging.getLogger("strata_ray.experts")


@dataclass(frozen=True)
class BlobLayout:
    """Byte layout of one layer's blob: gate [n_ff, gate_rb] | up [n_ff, up_rb] | down [E, down_rb]."""

    n_embd: int
    n_ff: int
    gate_rb: int
    up_rb: int
    down_rb: int
    gate_type: int
    up_type: int
    down_type: int

    @property
    def gate_bytes(self) -> int:
        return self.n_ff * self.gate_rb

    @property
    def up_bytes(self) -> int:
        return self.n_ff * self.up_rb

    @property
    def down_bytes(self) -> int:
        return self.n_embd * self.down_rb

    @property
    def parts(self) -> tuple[tuple[int, int, int], ...]:
        """(rows, row bytes, offset in the blob) of gate, up and down."""
        return ((self.n_ff, self.gate_rb, 0), (self.n_ff, self.up_rb, self.gate_bytes),
                (self.n_embd, self.down_rb, self.gate_bytes + self.up_bytes))

    @property
    def nbytes(self) -> int:
        return self.gate_bytes + self.up_bytes + self.down_bytes


def expert_layers_of(file) -> list[int]:
    """Block indices (trunk and MTP) that hold routed experts, in order."""
    hp = file.hparams
    return [
        b
        for b in range(hp.block_count)
        if file.has(f"blk.{b}.ffn_gate_exps.weight") or file.has(f"blk.{b}.ffn_gate_up_exps.weight")
    ]


def experts_block_quantized(file) -> bool:
    """True when every routed-expert tensor is Q8_0/Q4_0/Q4_K/Q6_K: the contract kernels' exact path."""
    types = [t.ggml_type for name, t in file.tensors.items() if name.endswith("_exps.weight")]
    return bool(types) and all(t in QUANT_TYPES for t in types)


class HostStore:
    def __init__(self, file, pin_gib: float | None = None, prefault_pages: bool = True):
        """file: an open GGUFFile with block-quantized experts. pin_gib: GiB of whole expert
        layers copied into page-locked memory (None or 0 = none); only when CUDA is available.
        prefault_pages: map every expert page in now (see prefault.py), not on first use in decode."""
        self.file = file
        self.hp = file.hparams
        self.layers: dict[int, ExpertLayer] = {}  # numpy views [X, rows, RB]
        self.layouts: dict[int, BlobLayout] = {}
        for b in expert_layers_of(file):
            gate, up, down, types = self._views(b)
            layer = ExpertLayer(gate, up, down, *types)
            layer.validate()
            self.layers[b] = layer
            self.layouts[b] = BlobLayout(
                layer.n_embd, layer.n_ff, gate.shape[2], up.shape[2], down.shape[2], *types
            )
        if not self.layers:
            raise ModelFormatError("the model has no routed-expert tensors (ffn_*_exps)")
        self.pinned_bytes = 0  # page-locked (CUDA) bytes of the arena
        self.pin_error: str | None = None  # why pinning stopped early (the OS refused), or None
        self.arena_bytes = 0  # bytes of layers moved out of the file map (move_to_arena)
        self._blocks: dict[int, HostBlock] = {}  # layer -> its anonymous (page-locked on CUDA) memory
        if torch.cuda.is_available():
            self._pin(pin_gib)
        self._split_fused()
        if prefault_pages:
            mapped = [a for lay in self.layers.values() for a in (lay.gate, lay.up, lay.down)]
            seconds = prefault(mapped, threads=min(8, cpu_count()))
            if seconds:
                n = sum(a.nbytes for a in mapped)
                log.info("host store: %.1f GiB of expert pages mapped in %.1f s (%.1f GB/s)", n / 2**30,
                         seconds, n / max(seconds, 1e-9) / 1e9)

    def _views(self, b: int):
        p = f"blk.{b}"
        if self.file.has(f"{p}.ffn_gate_up_exps.weight"):  # fused [X, 2I, RB], gate rows first
            fused = self.file.tensor(f"{p}.ffn_gate_up_exps.weight")
            n_ff = fused.data.shape[1] // 2
            gate, up = fused.data[:, :n_ff], fused.data[:, n_ff:]
            gt = ut = fused.ggml_type
            infos = [fused]
        else:
            g, u = self.file.tensor(f"{p}.ffn_gate_exps.weight"), self.file.tensor(f"{p}.ffn_up_exps.weight")
            gate, up, gt, ut = g.data, u.data, g.ggml_type, u.ggml_type
            infos = [g, u]
        d = self.file.tensor(f"{p}.ffn_down_exps.weight")
        for info in (*infos, d):
            if info.ggml_type not in QUANT_TYPES:
                raise ModelFormatError(
                    f"{info.name} is {type_name(info.ggml_type)}; the expert tiers need "
                    "Q8_0, Q4_0, Q4_K or Q6_K experts"
                )
        return gate, up, d.data, (gt, ut, d.ggml_type)

    # -- queries -------------------------------------------------------------------------------------
    @property
    def n_expert(self) -> int:
        return self.hp.n_expert

    @property
    def max_blob(self) -> int:
        return max(lay.nbytes for lay in self.layouts.values())

    @property
    def total_bytes(self) -> int:
        return sum(lay.nbytes * self.n_expert for lay in self.layouts.values())

    def layer(self, b: int) -> ExpertLayer:
        return self.layers[b]

    def blob_parts(self, b: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pair's gate, up, down bytes as flat uint8 arrays (views of the map). numpy, not torch:
        torch's CPU copy from a memmap-backed tensor is orders of magnitude slower than numpy's."""
        lay = self.layers[b]
        return lay.gate[e].reshape(-1), lay.up[e].reshape(-1), lay.down[e].reshape(-1)

    def pinned_parts(self, b: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The pair's gate, up, down as flat page-locked torch tensors when its layer is pinned (the device
        copies them straight, without a staging buffer), else None."""
        block = self._blocks.get(b)
        if block is None or not block.registered:
            return None
        lay = self.layers[b]  # views of the block
        return tuple(torch.from_numpy(a[e].reshape(-1)) for a in (lay.gate, lay.up, lay.down))

    def pinned_addresses(self, b: int) -> tuple[tuple[int, int, int], ...] | None:
        """Layer b's gate, up, down in page-locked memory as (address of expert 0, bytes from one expert to
        the next, bytes of one expert's part), or None when the layer is not pinned: what a device kernel
        needs to read any expert's parts straight (kernels/gather_copy)."""
        block = self._blocks.get(b)
        if block is None or not block.registered:
            return None
        lay = self.layers[b]
        out = []
        for a in (lay.gate, lay.up, lay.down):  # [X, rows, RB]; each expert's rows contiguous
            if a.strides[1:] != (a.shape[2], 1):
                return None
            out.append((a.ctypes.data, a.strides[0], a.shape[1] * a.shape[2]))
        return tuple(out)

    def blob_bytes(self, b: int, e: int) -> bytes:
        """The pair's blob (gate | up | down), for byte-for-byte checks."""
        return b"".join(p.tobytes() for p in self.blob_parts(b, e))

    # -- pinning -------------------------------------------------------------------------------------
    def _pin(self, pin_gib: float | None) -> None:
        """Page-lock whole layers (layer order) up to pin_gib GiB: see move_to_arena.

        Not cudaHostRegister on the file map: on the H200 machine registering a multi-GiB private file
        mapping did not return within minutes. Unpinned layers copy through the slot cache's pinned
        staging buffers (a host memcpy first); pinned ones are copied by the device straight."""
        if not pin_gib:
            return
        t0 = time.perf_counter()
        self.move_to_arena(pin_gib, register=True)
        log.info("host store: %.1f GiB of experts in pinned memory (%.1f s)", self.pinned_bytes / 2**30,
                 time.perf_counter() - t0)

    def _split_fused(self) -> None:
        """Move the layers whose matrices are not C-contiguous (a fused gate_up's halves, still in the file
        map) into anonymous memory, as far as spare_memory_gib allows. The CPU kernels take C-contiguous
        blocks: on a strided view each expert call copied the whole layer's gate and up first (a 64-expert
        test layer: 1.8 -> 23 ms a call), and the decode worker kept such copies for the run."""
        strided = {b for b, lay in self.layers.items() if b not in self._blocks and not lay.c_contiguous}
        if not strided:
            return
        t0, before = time.perf_counter(), self.arena_bytes
        self.move_to_arena(self.arena_bytes / 2**30 + spare_memory_gib(), register=False, only=strided)
        split = sorted(strided & self._blocks.keys())
        if split:
            log.info("host store: %d fused gate_up layers split into their own memory (%.1f GiB, %.1f s)",
                     len(split), (self.arena_bytes - before) / 2**30, time.perf_counter() - t0)
        if len(split) < len(strided):
            log.warning("host store: %d fused gate_up layers stay in the file map (no host memory to split "
                        "them): each CPU expert call on them copies the layer's gate and up halves",
                        len(strided) - len(split))

    def move_to_arena(self, gib: float, register: bool, only: set[int] | None = None) -> None:
        """Copy whole layers (layer order, up to `gib` GiB of arena in all) out of the file map into
        anonymous host memory of exactly their size (host_arena.HostBlock), page-locked for CUDA when
        `register`; the layers' views then point there, each matrix C-contiguous. only: these layers alone.
        The copies run on PIN_THREADS threads."""
        cap = int(gib * 2**30)
        with ThreadPoolExecutor(PIN_THREADS, thread_name_prefix="strata-pin") as copiers:
            for b, lay in list(self.layers.items()):
                if b in self._blocks or (only is not None and b not in only):
                    continue
                arrays = (lay.gate, lay.up, lay.down)
                size = sum(a.nbytes for a in arrays)
                if self.arena_bytes + size > cap:
                    break
                block = HostBlock(size, register=False)  # registered once filled: see HostBlock.register
                views, off = [], 0
                for a in arrays:
                    views.append(block.view(off, a.shape))
                    off += a.nbytes
                # numpy copies release the GIL: 32 experts of a tensor per job, PIN_THREADS jobs at once
                jobs = [copiers.submit(np.copyto, v[e0 : e0 + 32], a[e0 : e0 + 32])
                        for v, a in zip(views, arrays, strict=True) for e0 in range(0, a.shape[0], 32)]
                for job in jobs:
                    job.result()
                if register:
                    try:
                        block.register()
                    except HostArenaError as e:  # "pinned where the OS allows": the rest stays mapped
                        self.pin_error = str(e)
                        log.warning("host store: %s; layers %d-%d stay in the file map, unpinned (their "
                                    "copies go through staging buffers)", e, b, max(self.layers))
                        break
                self._blocks[b] = block
                self.layers[b] = ExpertLayer(*views, lay.gate_type, lay.up_type, lay.down_type)
                self.arena_bytes += size
                self.pinned_bytes += size if register else 0

    def close(self) -> None:
        for block in self._blocks.values():
            block.close()
        self._blocks = {}
        self.pinned_bytes = self.arena_bytes = 0
