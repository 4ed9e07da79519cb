"""SIGTERM as Ctrl-C for the commands that run until they end or are stopped (`run`, `serve`): systemd,
`docker stop`, Kubernetes and `timeout` send SIGTERM, and Ray's own handlers (ray.init's, its core worker's,
absl's) turned it into a C++ stack dump and exit 15, with none of the command's cleanup (its actors, its
line). The command's `except KeyboardInterrupt` then ends it as a Ctrl-C would.
"""

from __future__ import annotations

import signal


def interrupt_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread. Call it again after ray.init, whose core worker
    installs its own handler as it connects."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(_signum, _frame):
    # one stop: a repeated SIGTERM (a second sender's) raised again inside the cleanup, and the interrupt that
    # left main hung in Ray's excepthook. (Ray's own shutdown may set the default action back: a repeat that
    # lands then ends the process, as a second Ctrl-C would.)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt
