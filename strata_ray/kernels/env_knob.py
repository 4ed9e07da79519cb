"""An env-only knob's value, read where it acts (a kernel's launch, a graph's capture): config.py refuses a
bad value with its one line when the engine starts; a process that skipped that check (a script, a test)
gets the same line here."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def env_knob(name: str, parse: Callable[[str], T], default: T) -> T:
    """parse(the variable's value) where it is set and not empty, else default; a bad value raises one line
    naming the variable (parse's ValueError says what is allowed)."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError as e:
        raise ValueError(f"{name}: invalid value {raw!r} (allowed: {e})") from None
