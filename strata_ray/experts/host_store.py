"""The host store: every routed expert's gate/up/down bytes, straight from the memory-mapped GGUF.

Nothing is copied: each layer's `ffn_{gate,up,down}_exps` (or fused `ffn_gate_up_exps`) is a zero-copy
view of the file map, uint8 [X, rows, row_bytes], which the CPU pool reads in place. With CUDA and
`pin_gib` (STRATA_ARENA_PIN_GIB) set, whole layers up to that cap move into page-locked torch memory,
which the device copies from directly; blob copies of the rest go through the slot cache's pinned
staging buffers.

A blob is one pair's bytes in a fixed order, gate | up | down: the unit a cache slot holds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from strata_ray.experts.prefault import prefault
from strata_ray.kernels.contract import QUANT_TYPES, ExpertLayer, type_name
from strata_ray.kernels.cpu_pool import cpu_count
from strata_ray.model.hparams import ModelFormatError

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
        self.pinned_bytes = 0
        self._pinned: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> page-locked gate, up, down (CUDA)
        if torch.cuda.is_available():
            self._pin(pin_gib)
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
        parts = self._pinned.get(b)
        return None if parts is None else tuple(t[e].reshape(-1) for t in parts)

    def blob_bytes(self, b: int, e: int) -> bytes:
        """The pair's blob (gate | up | down), for byte-for-byte checks."""
        return b"".join(p.tobytes() for p in self.blob_parts(b, e))

    # -- pinning -------------------------------------------------------------------------------------
    def _pin(self, pin_gib: float | None) -> None:
        """Move whole layers (layer order) into page-locked torch host memory, up to pin_gib.

        Not cudaHostRegister on the file map: on the H200 machine registering a multi-GiB private file
        mapping did not return within minutes. Unpinned layers still copy at pinned speed through the
        slot cache's pinned staging buffers; pinning here only saves that host-side hop."""
        if not pin_gib:
            return
        cap = int(pin_gib * 2**30)
        t0 = time.perf_counter()
        for b, lay in list(self.layers.items()):
            arrays = (lay.gate, lay.up, lay.down)
            size = sum(a.nbytes for a in arrays)
            if self.pinned_bytes + size > cap:
                break
            pinned = []
            for a in arrays:
                t = torch.empty(a.shape, dtype=torch.uint8, pin_memory=True)
                t.numpy()[...] = a
                pinned.append(t)
            self._pinned[b] = tuple(pinned)
            types = (lay.gate_type, lay.up_type, lay.down_type)
            self.layers[b] = ExpertLayer(*(t.numpy() for t in pinned), *types)
            self.pinned_bytes += size
        log.info(
            "host store: %.1f GiB of experts in pinned memory (%.1f s)",
            self.pinned_bytes / 2**30,
            time.perf_counter() - t0,
        )

    def close(self) -> None:
        self._pinned = {}
        self.pinned_bytes = 0
