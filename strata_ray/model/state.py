"""Per-sequence decoding state: KV caches of attention layers, GDN recurrent and conv states, position."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


class KVCache:
    """Keys and values of one attention layer, [S, Hkv, D] each, growing as tokens are consumed.

    Without autograd, appends write into a buffer whose capacity doubles (amortised O(1) per token); when the
    new keys need grad, it concatenates instead so the training graph stays intact.
    """

    def __init__(self) -> None:
        self._k: Tensor | None = None
        self._v: Tensor | None = None
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add k, v [T, Hkv, D]; return all keys and values so far [S, Hkv, D]."""
        T = k.shape[0]
        if k.requires_grad or v.requires_grad or (self._k is not None and self._k.requires_grad):
            if self._k is None:
                self._k, self._v = k, v
            else:
                self._k = torch.cat((self._k[: self.length], k))
                self._v = torch.cat((self._v[: self.length], v))
            self.length += T
            return self._k, self._v
        need = self.length + T
        self.reserve(need, k)
        self._k[self.length : need] = k
        self._v[self.length : need] = v
        self.length = need
        return self._k[:need], self._v[:need]

    def reserve(self, need: int, like: Tensor) -> tuple[int, int]:
        """Room for `need` tokens of rows shaped like `like` [T, Hkv, D] (the capacity doubles); returns the
        keys' and values' buffer addresses, which move only when the capacity grows. A decode graph writes
        the next rows there itself (DecodeGraphs), then calls `advance`."""
        if self._k is None or need > self._k.shape[0]:
            cap = max(need, 2 * (self._k.shape[0] if self._k is not None else 0), 64)
            new_k = like.new_empty((cap, *like.shape[1:]))
            new_v = like.new_empty((cap, *like.shape[1:]))
            if self._k is not None:
                new_k[: self.length] = self._k[: self.length]
                new_v[: self.length] = self._v[: self.length]
            self._k, self._v = new_k, new_v
        return self._k.data_ptr(), self._v.data_ptr()

    def buffers(self) -> tuple[Tensor, Tensor]:
        """The whole key and value buffers [capacity, Hkv, D] (reserve first)."""
        if self._k is None:
            raise ValueError("KVCache.buffers() before any reserve or append")
        return self._k, self._v

    def advance(self, n: int) -> None:
        """Count n more tokens, whose rows were written into the reserved buffers directly."""
        if self._k is None or self.length + n > self._k.shape[0]:
            room = 0 if self._k is None else self._k.shape[0]
            raise ValueError(f"KVCache.advance({n}) past the {room} tokens reserved")
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget everything after the first `length` tokens (rejected speculative tokens)."""
        self.length = min(self.length, length)
        if self._k is not None and self._k.requires_grad:
            self._k, self._v = self._k[: self.length], self._v[: self.length]

    def clone(self) -> KVCache:
        c = KVCache()
        if self._k is not None:
            c._k, c._v = self._k[: self.length].clone(), self._v[: self.length].clone()
        c.length = self.length
        return c


@dataclass
class GDNState:
    """Gated DeltaNet layer state: S [nv, dk, dv] and the last K-1 conv inputs [K-1, conv_dim]."""

    S: Tensor
    conv: Tensor

    def clone(self) -> GDNState:
        return GDNState(self.S.clone(), self.conv.clone())


@dataclass
class SequenceState:
    """Everything a sequence carries between forward calls.

    kv: attention layer index -> KVCache; gdn: recurrent layer index -> GDNState; pos: tokens consumed by the
    trunk. mtp_kv / mtp_pos: the MTP layer's own cache and the number of (hidden, next token) pairs it holds.
    """

    kv: dict[int, KVCache] = field(default_factory=dict)
    gdn: dict[int, GDNState] = field(default_factory=dict)
    pos: int = 0
    mtp_kv: KVCache = field(default_factory=KVCache)
    mtp_pos: int = 0

    def clone(self) -> SequenceState:
        """An independent copy (a snapshot to roll back to)."""
        return SequenceState(
            kv={i: c.clone() for i, c in self.kv.items()},
            gdn={i: s.clone() for i, s in self.gdn.items()},
            pos=self.pos,
            mtp_kv=self.mtp_kv.clone(),
            mtp_pos=self.mtp_pos,
        )


def new_sequence_state(hp, device: torch.device | str) -> SequenceState:
    """Empty state for HParams hp: zero GDN/conv states for recurrent layers, empty KV caches otherwise."""
    state = SequenceState()
    conv_dim = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner
    for layer in range(hp.n_layer):
        if hp.is_recurrent(layer):
            S = torch.zeros(hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_head_v_dim, device=device)
            conv = torch.zeros(hp.ssm_conv_kernel - 1, conv_dim, device=device)
            state.gdn[layer] = GDNState(S, conv)
        else:
            state.kv[layer] = KVCache()
    return state
