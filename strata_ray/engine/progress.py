"""Model-load progress: the loader reports where it is, whoever owns the terminal draws the bars.

The loader (Engine -> load_tiered_model -> SlotCache.fill) updates a `LoadProgress`. In the primary actor
the driver polls `snapshot()` through the actor's second concurrency slot and draws `TerminalBars` on its
own stderr; the plain Engine (no Ray) draws them itself through `on_change`. Bars appear only when the
stream is a terminal, so logs and pipes never get carriage-return garbage.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TextIO

FILL_STAGE = "filling the expert cache"


class LoadProgress:
    """The current load stage and the expert-cache fill count; thread-safe (the actor's load() writes it
    while its load_progress() reads it)."""

    def __init__(self, on_change: Callable[[dict], None] | None = None):
        self._lock = threading.Lock()
        self._state = {"stage": "starting", "fill_done": 0, "fill_total": 0, "done": False}
        self._on_change = on_change

    def stage(self, name: str) -> None:
        self._set(stage=name)

    def fill(self, done: int, total: int) -> None:
        self._set(stage=FILL_STAGE, fill_done=int(done), fill_total=int(total))

    def finish(self) -> None:
        self._set(done=True)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._state)

    def _set(self, **values) -> None:
        with self._lock:
            self._state.update(values)
            snap = dict(self._state)
        if self._on_change is not None:
            self._on_change(snap)


class TerminalBars:
    """tqdm bars for LoadProgress snapshots: 'loading the model' (elapsed time, current stage) and, once a
    fill has started, 'filling the expert cache' (slots). Transient: they vanish when closed."""

    def __init__(self, stream: TextIO):
        from tqdm import tqdm

        self._tqdm, self.stream = tqdm, stream
        self._load = tqdm(desc="strata_ray: loading the model", bar_format="{desc} {elapsed}{postfix}",
                          file=stream, leave=False)
        self._fill = None

    def update(self, snap: dict) -> None:
        self._load.set_postfix_str(snap["stage"], refresh=True)
        total = snap["fill_total"]
        if total > 0:
            if self._fill is None:
                self._fill = self._tqdm(total=total, desc=f"strata_ray: {FILL_STAGE}", unit="slot",
                                        file=self.stream, leave=False,  # no rate: it is polled, not seen
                                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                        "slots [{elapsed}]")
            self._fill.update(snap["fill_done"] - self._fill.n)
            self._fill.refresh()  # update() redraws at most every 0.1 s: a finished fill must show 100%

    def refresh(self) -> None:
        """Redraw (the elapsed time moves on while no new snapshot has arrived)."""
        self._load.refresh()

    def close(self) -> None:
        if self._fill is not None:
            self._fill.close()
        self._load.close()


def terminal_bars(stream: TextIO | None = None) -> TerminalBars | None:
    """Bars on `stream` (default stderr) when it is a terminal, else None."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return TerminalBars(stream) if isatty is not None and isatty() else None


def local_progress(progress) -> tuple[LoadProgress | None, TerminalBars | None]:
    """The Engine's `progress` argument as (reporter, bars to close): a LoadProgress is used as given
    (the primary actor: the driver draws); None draws bars here when stderr is a terminal; False: none."""
    if isinstance(progress, LoadProgress):
        return progress, None
    if progress is False:
        return None, None
    bars = terminal_bars()
    return (LoadProgress(on_change=bars.update), bars) if bars is not None else (None, None)
