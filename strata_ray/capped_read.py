"""A user's text input read with a cap: a device or a pipe that never ends (`--prompt-file /dev/zero`,
`yes | python -m strata_ray.run`) is refused with one line instead of being read until the host's memory runs
out (the OOM killer then takes whatever is biggest, the user's other work included)."""

from __future__ import annotations

from typing import IO, AnyStr

MIB = 1 << 20


class TooLong(ValueError):
    """The input holds more than its cap; the message is the end of a one-line error."""


def read_capped(f: IO[AnyStr], limit: int) -> AnyStr:
    """f's content to its end (characters from a text file, bytes from a binary one), reading at most
    limit + 1: TooLong where there are more than limit (its message counts them as MiB either way)."""
    data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLong(f"longer than {limit / MIB:g} MiB")
    return data
