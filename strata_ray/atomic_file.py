"""Files written whole or not at all: a reader (or a crash) never sees half of a profile, a benchmark's JSON
or a gate reference."""

from __future__ import annotations

import os


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `<path>.tmp`, fsync it, then rename it over path. On any failure the temporary file is removed
    and the OSError goes to the caller (path keeps what it held)."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        if os.path.isfile(tmp):
            os.unlink(tmp)
        raise
