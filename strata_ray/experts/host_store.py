"""The host store: every routed expert's gate/up/down bytes, straight from the memory-mapped GGUF.

Nothing is copied: each layer's `ffn_{gate,up,down}_exps` (or fused `ffn_gate_up_exps`) is a zero-copy
view of the file map, uint8 [X, rows, row_bytes], which the CPU pool reads in place. When CUDA exists the
map is page-locked (cudaHostRegister, read-only flag) layer by layer up to `pin_gib`, so blob copies into
GPU slots run at full PCIe speed; where the OS refuses, the layer stays pageable (still correct, slower).

A blob is one pair's bytes in a fixed order, gate | up | down: the unit a cache slot holds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from strata_ray.kernels.contract import QUANT_TYPES, ExpertLayer, type_name
from strata_ray.model.hparams import ModelFormatError

log = logging.getLogger("strata_ray.experts")

CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the file map may be read-only


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


def _consume_cuda_error() -> None:
    """A failed cudaHostRegister leaves the runtime's last error set, and torch's next launch check
    would report it as its own failure: consume it here with a throwaway launch."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


class HostStore:
    def __init__(self, file, pin_gib: float | None = None):
        """file: an open GGUFFile with block-quantized experts. pin_gib caps page-locked bytes (None =
        the whole store; 0 = none). Pinning is attempted only when CUDA is available."""
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
        self._registered: list[int] = []
        if torch.cuda.is_available():
            self._pin(pin_gib)

    def _views(self, b: int):
        p = f"blk.{b}"
        if self.file.has(f"{p}.ffn_gate_up_exps.weight"):  # fused [X, 2I, RB], gate rows first
            fused = self.file.tensor(f"{p}.ffn_gate_up_exps.weight")
            n_ff = fused.data.shape[1] // 2
            gate, up = fused.data[:, :n_ff], fused.data[:, n_ff:]
            gt = ut = fused.ggml_type
        else:
            g, u = self.file.tensor(f"{p}.ffn_gate_exps.weight"), self.file.tensor(f"{p}.ffn_up_exps.weight")
            gate, up, gt, ut = g.data, u.data, g.ggml_type, u.ggml_type
        d = self.file.tensor(f"{p}.ffn_down_exps.weight")
        for name, t in (("gate/up", gt), ("up", ut), ("down", d.ggml_type)):
            if t not in QUANT_TYPES:
                raise ModelFormatError(
                    f"{p} ffn_{name}_exps is {type_name(t)}; the expert tiers need "
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

    def blob_bytes(self, b: int, e: int) -> bytes:
        """The pair's blob (gate | up | down), for byte-for-byte checks."""
        return b"".join(p.tobytes() for p in self.blob_parts(b, e))

    # -- pinning -------------------------------------------------------------------------------------
    def _pin(self, pin_gib: float | None) -> None:
        """cudaHostRegister the expert tensors' pages (merged page ranges, layer order) within the cap."""
        cap = None if pin_gib is None else int(pin_gib * 2**30)
        page = 4096
        spans = []
        for lay in self.layers.values():
            for a in (lay.gate, lay.up, lay.down):  # the last byte a view reaches: sum((shape - 1) * stride)
                start = a.__array_interface__["data"][0]
                end = start + sum((n - 1) * st for n, st in zip(a.shape, a.strides, strict=True)) + 1
                spans.append((start // page * page, (end + page - 1) // page * page))
        merged: list[list[int]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        for lo, hi in merged:
            if cap is not None and self.pinned_bytes + (hi - lo) > cap:
                hi = lo + (cap - self.pinned_bytes) // page * page
                if hi <= lo:
                    return
            err = int(cudart.cudaHostRegister(lo, hi - lo, CUDA_HOST_REGISTER_READ_ONLY))
            if err != 0:
                _consume_cuda_error()
                log.info("host store: page-locking refused (cuda error %d); the rest stays pageable", err)
                return
            self._registered.append(lo)
            self.pinned_bytes += hi - lo
        log.info(
            "host store: page-locked %.1f GiB in %.1f s", self.pinned_bytes / 2**30, time.perf_counter() - t0
        )

    def close(self) -> None:
        if self._registered and torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
        self._registered = []
        self.pinned_bytes = 0
