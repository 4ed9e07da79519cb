"""Files written whole or not at all: a reader (or a crash) never sees half of a profile, a benchmark's JSON
or a gate reference."""

from __future__ import annotations

import os
import secrets


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write a temporary file of a name of its own beside path (`.<name>.<random>.tmp`: two writers never
    share one, a user's `<path>.tmp` is never touched; created as open() creates a file, the umask applied),
    fsync it, then rename it over path. On any failure the temporary file is removed and the OSError goes to
    the caller (path keeps what it held)."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.isfile(tmp):
            os.unlink(tmp)
        raise
