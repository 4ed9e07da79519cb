"""A model's routing identity: a short digest of its routers, which an expert profile carries so that a
profile made on one model is not taken for another of the same shape without a word.

Two models of one shape (layers x experts) accept each other's STRP profiles: the pairs are in range, so the
cache fills, and the output is the same bits whatever the placement (DESIGN section 7). Only speed suffers,
silently: the cache holds the other model's hot experts. The routers decide which experts are hot, so the
digest covers them, and nothing else that a re-quantization changes: a profile learned on a model's Q4_K_M
file stays valid for its Q8_0 file (llama.cpp keeps `ffn_gate_inp` in F32 in both, so the bytes are equal).

The digest hashes the architecture, the shape, and the first and last routed layers' router tensors (type,
shape, bytes): 2 x 4 MiB of F32 for an 80B-A3B model, read from the memory map once a start.
"""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_BYTES = 16  # blake2b-128: an identity, not a signature


def router_name(layer: int) -> str:
    return f"blk.{layer}.ffn_gate_inp.weight"


def routing_digest(file) -> bytes:
    """The DIGEST_BYTES routing identity of a GGUFFile (its arch, hparams and tensors); ModelFormatError
    where it has no router at all (hparams already refused such a file for the engine)."""
    hp = file.hparams
    routed = [layer for layer in range(hp.n_layer) if file.has(router_name(layer))]
    if not routed:
        from strata_ray.model.hparams import ModelFormatError

        raise ModelFormatError(f"{file.path.name}: no router tensor ({router_name(0)}) in any layer")
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(f"{file.arch}|{hp.n_layer}|{hp.n_expert}".encode())
    for layer in sorted({routed[0], routed[-1]}):
        t = file.tensor(router_name(layer))
        h.update(f"|{layer}|{t.ggml_type}|{tuple(t.shape)}|".encode())
        h.update(memoryview(np.ascontiguousarray(t.data)).cast("B"))
    return h.digest()
