"""Count routing per (layer, expert) while the model runs: for `profile` and for adaptive usage.

`RoutingRecorder` wraps any ExpertBackend (see docs/INTERFACES.md) and forwards every call unchanged,
so it changes no output bits. Counts stay on the routing tensors' device and are read out only when
asked (`counts()` / `take_counts()`): no sync per layer on a GPU.
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingRecorder:
    def __init__(self, inner, n_layers: int, n_expert: int):
        """inner: the ExpertBackend that computes the rows. Only trunk layers (< n_layers) are
        counted: the profile ranks the trunk's pairs, the MTP layer's experts are not in it."""
        self.inner = inner
        self.n_layers, self.n_expert = n_layers, n_expert
        self._counts: torch.Tensor | None = None  # [L, X] int64 on the routing device
        self.tokens = 0  # rows routed through layer 0 (tokens seen by the trunk)

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if layer < self.n_layers:
            if self._counts is None:
                self._counts = self._zeros(ids.device)
            elif self._counts.device != ids.device:
                self._counts = self._counts.to(ids.device)
            # +1 per routed (token, k) entry, whatever its weight: the reference's usage rule
            self._counts[layer] += torch.bincount(ids.reshape(-1), minlength=self.n_expert)
            if layer == 0:
                self.tokens += int(ids.shape[0])
        return self.inner(layer, x, ids, weights)

    def _zeros(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.n_layers, self.n_expert, dtype=torch.int64, device=device)

    def counts(self) -> np.ndarray:
        """[L, X] int64 entries routed to each pair since the start (or the last take)."""
        if self._counts is None:
            return np.zeros((self.n_layers, self.n_expert), dtype=np.int64)
        return self._counts.cpu().numpy().copy()

    def take_counts(self) -> np.ndarray:
        """Counts since the last take, then reset: what the primary sends the coordinator."""
        out = self.counts()
        if self._counts is not None:
            self._counts.zero_()
        return out
