"""LayerClock: where a forward's time goes, layer by layer, without a profiler's per-op cost.

TieredExperts marks the start and the end of each layer's expert call. On CUDA a mark is an event on the
current stream (it fires when the device gets there) and the host's clock at the call; on the CPU the
host's clock alone. Between the end of layer l's experts and the start of layer l+1's lies the dense part
(norms, attention or GDN, router); the experts' span holds the host's planning, the streamed copies and
the kernels. A profiler trace of a prefill costs more than the prefill itself (session 7: 77 s under
torch.profiler for a 1.3 s prefill); these marks cost an event record each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class _Mark:
    layer: int
    host: float  # perf_counter at the call
    event: torch.cuda.Event | None  # fires when the device reaches the call (CUDA)
    name: str = ""


class LayerClock:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list[tuple[_Mark, _Mark]] = []  # (start, end) per expert call, in call order
        self.points: list[_Mark] = []  # every mark (starts, ends and named points) in call order
        self._open: _Mark | None = None

    def _mark(self, layer: int, name: str) -> _Mark:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        mark = _Mark(layer, time.perf_counter(), event, name)
        self.points.append(mark)
        return mark

    def start(self, layer: int) -> None:
        self._open = self._mark(layer, "start")

    def point(self, layer: int, name: str) -> None:
        """A named point of `layer` (in its dense part, or inside its expert call): the span from the mark
        before it to here is reported as phase `name`."""
        self._mark(layer, name)

    def end(self, layer: int) -> None:
        if self._open is not None and self._open.layer == layer:
            self.marks.append((self._open, self._mark(layer, "end")))
        self._open = None

    def _span(self, a: _Mark, b: _Mark) -> float:
        if self.cuda:
            return a.event.elapsed_time(b.event)
        return (b.host - a.host) * 1e3

    def summary(self) -> dict:
        """Per-call spans in ms (device clock on CUDA, else host): `experts` (the expert call), `dense` (from
        the previous call's end; None for a forward's first layer), `host` (the host's time inside the
        call), and `phases`: each named point's span from the mark before it (`start` = the dense part's
        tail before the call, `end` = the call's tail after its last point). Totals and means over the
        calls, and the calls themselves."""
        if self.cuda:
            torch.cuda.synchronize()
        calls = []
        prev = None
        for start, end in self.marks:
            dense = self._span(prev, start) if prev is not None and start.layer > prev.layer else None
            calls.append({"layer": start.layer, "experts": self._span(start, end), "dense": dense,
                          "host": (end.host - start.host) * 1e3, "phases": {}})
            prev = end
        by_start = {id(start): c for (start, _), c in zip(self.marks, calls, strict=True)}
        # a call's phases: the named points after the previous call's end, up to its own end
        pending: dict[str, float] = {}
        before = None
        call = None
        for mark in self.points:
            if mark.name == "start":
                call = by_start.get(id(mark))
            if before is not None and mark.layer >= before.layer:
                pending[mark.name] = pending.get(mark.name, 0.0) + self._span(before, mark)
            if mark.name == "end":
                if call is not None:
                    call["phases"] = pending
                pending, call = {}, None
            before = mark
        out = {"calls": calls}
        for key in ("experts", "dense", "host"):
            vals = [c[key] for c in calls if c[key] is not None]
            out[f"{key}_ms_total"] = sum(vals)
            out[f"{key}_ms_mean"] = sum(vals) / len(vals) if vals else 0.0
        return out
