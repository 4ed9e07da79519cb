"""Ctrl-C held across a step that must not be cut in half: Ray's start and shutdown.

A KeyboardInterrupt raised inside `ray.init` leaves its processes half started, and one inside `ray.shutdown`
(while it waits for them to exit) printed a traceback instead of the run's one line; a user saw a segfault at
exit after a Ctrl-C during the start. Inside `held_interrupts()` a first Ctrl-C is noted and the step runs to
its end; a second one raises at once (a user who insists gets the old behaviour).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Held:
    """What a held_interrupts block saw: `interrupted` once a Ctrl-C came in it."""

    def __init__(self) -> None:
        self.interrupted = False


@contextmanager
def held_interrupts() -> Iterator[Held]:
    """SIGINT noted, not raised, until the block ends (then the caller reads `interrupted`); a second SIGINT
    raises KeyboardInterrupt in the block. Off the main thread, or where SIGINT is ignored or not Python's,
    nothing changes (signal handlers belong to the main thread)."""
    held = Held()
    ours = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if not ours:
        yield held
        return

    def note(signum, frame):
        if held.interrupted:
            raise KeyboardInterrupt
        held.interrupted = True

    signal.signal(signal.SIGINT, note)
    try:
        yield held
    finally:
        if signal.getsignal(signal.SIGINT) is note:  # not where the block installed its own handler since
            signal.signal(signal.SIGINT, signal.default_int_handler)
