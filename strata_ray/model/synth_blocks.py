"""Random quantized blocks written directly (no float weights, no encoder), fast enough to stream 44 GB.

Block bytes come from a pool of random words XORed with a per-chunk random key (a memcpy-speed operation,
~10x faster than drawing fresh random numbers); then each block's header (fp16 scales, sub-block scales) is
overwritten from a small table of valid headers, picked per block by a random index. The header tables set
the weight scale: dequantized values have mean ~0 and standard deviation ~`std` (layouts: model-format §1.6).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .gguf_writer import IN_FLIGHT
from .quants import BLOCK

SUPPORTED = (T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K)
N_HEADERS = 4096  # distinct block headers per tensor
_POOL_WORDS = 1 << 22  # 32 MiB of random uint64
_PIECE_WORDS = _POOL_WORDS // 2  # longest copy from the pool in one go

# standard deviation of the integer part of one block's values, per unit of scale
Q8_0_SD = float(np.sqrt((255**2 - 1) / 12))  # qs uniform in [-127, 127]
_Q4_0_SD = float(np.sqrt((16**2 - 1) / 12 + 0.25))  # q - 8, q uniform in [0, 15]
_Q4_K_SUB = np.arange(1, 5)  # 6-bit sub-block scales drawn from 1..4, mins = 15 * scale -> zero mean
_Q4_K_SD = float(np.sqrt((16**2 - 1) / 12) * np.sqrt(np.mean(_Q4_K_SUB**2.0)))
_Q6_K_SUB = np.arange(8, 16)  # |int8 sub-block scale|, random sign
_Q6_K_SD = float(np.sqrt((64**2 - 1) / 12 + 0.25) * np.sqrt(np.mean(_Q6_K_SUB**2.0)))


class RandomBlocks:
    """Source of random block bytes, deterministic for a seed and for the generators passed to blocks()."""

    def __init__(self, seed: int):
        self._pool = np.random.default_rng([seed, 0xB10C]).bit_generator.random_raw(_POOL_WORDS)
        # reused buffers (first-touch page faults cost as much as the XOR), in a ring: a streaming writer
        # may still hold the previous IN_FLIGHT chunks while the next one is made
        self._ring = [np.empty(0, dtype=np.uint64) for _ in range(IN_FLIGHT + 1)]
        self._turn = 0

    def random_bytes(self, rng: np.random.Generator, n_bytes: int) -> np.ndarray:
        """uint8 [n_bytes] of random-looking bytes, a view valid for the next IN_FLIGHT calls."""
        n_words = -(-n_bytes // 8)
        self._turn = (self._turn + 1) % len(self._ring)
        if self._ring[self._turn].size < n_words:
            self._ring[self._turn] = np.empty(n_words, dtype=np.uint64)
        words = self._ring[self._turn][:n_words]
        for start in range(0, words.size, _PIECE_WORDS):
            piece = words[start : start + _PIECE_WORDS]
            offset = int(rng.integers(0, _POOL_WORDS - piece.size + 1))
            key = np.uint64(rng.bit_generator.random_raw())
            np.bitwise_xor(self._pool[offset : offset + piece.size], key, out=piece)
        return words.view(np.uint8)[:n_bytes]

    def blocks(
        self, rng: np.random.Generator, n_rows: int, row_len: int, ggml_type: int, std: float
    ) -> np.ndarray:
        """uint8 [n_rows, row_bytes]: rows of row_len random values of ggml_type with mean 0, std ~std.
        A view into a scratch buffer, valid for the next IN_FLIGHT calls (the writer's queue depth)."""
        t = T(ggml_type)
        elems, size = BLOCK[t]
        n_blocks = n_rows * (row_len // elems)
        raw = self.random_bytes(rng, n_blocks * size)
        if t == T.Q8_0:  # -128 never comes out of ggml's encoder: keep qs in [-127, 127]
            np.maximum(raw.view(np.int8), -127, out=raw.view(np.int8))
        start, table = _header_table(rng, t, std)
        # the headers as strided words (not bytes): a per-block copy of 2 uint64 instead of 16 uint8
        word = next(w for w in (8, 4, 2, 1) if start % w == 0 and size % w == 0 and table.shape[1] % w == 0)
        wtype = np.dtype(f"<u{word}")
        headers = np.ndarray((n_blocks, table.shape[1] // word), wtype, raw.data, start, (size, word))
        # which header a block gets: 12 random bits of the block, taken before they are overwritten
        first = np.ndarray((n_blocks,), np.dtype("<u2"), raw.data, start, (size,))
        idx = first & (N_HEADERS - 1)
        headers[...] = table.view(wtype)[idx]
        return raw.reshape(n_rows, -1)


def _header_table(rng: np.random.Generator, t: T, std: float) -> tuple[int, np.ndarray]:
    """(byte offset of the header in the block, uint8 [N_HEADERS, header_bytes])."""
    jitter = rng.uniform(0.75, 1.25, N_HEADERS)  # per-block scale variety (exercises scale handling)
    if t == T.Q8_0:
        return 0, _f16_bytes(std / Q8_0_SD * jitter)
    if t == T.Q4_0:  # ggml's d = signed extreme / -8 carries either sign; random signs cancel the -0.5 offset
        sign = np.where(rng.random(N_HEADERS) < 0.5, -1.0, 1.0)
        return 0, _f16_bytes(std / _Q4_0_SD * jitter * sign)
    if t == T.Q4_K:
        d = (std / _Q4_K_SD * jitter).astype(np.float16)
        dmin = (d.astype(np.float32) / 2).astype(np.float16)  # exact halving: min = d * sc * 7.5
        sc = rng.choice(_Q4_K_SUB, size=(N_HEADERS, 8)).astype(np.uint8)
        scales = _pack_q4_k_scales(sc, 15 * sc)
        return 0, np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales], axis=1)
    if t == T.Q6_K:
        mag = rng.choice(_Q6_K_SUB, size=(N_HEADERS, 16))
        sign = np.where(rng.random((N_HEADERS, 16)) < 0.5, -1, 1)
        scales = (mag * sign).astype(np.int8).view(np.uint8)
        return 192, np.concatenate(
            [scales, _f16_bytes(std / _Q6_K_SD * jitter)], axis=1
        )  # ql, qh | scales, d
    raise ValueError(f"no random block generator for {t.name}")


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float16).reshape(-1, 1)).view(np.uint8)


def _pack_q4_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit (scale, min) x 8 sub-blocks -> the 12-byte K-quant packing (inverse of get_scale_min_k4)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out
