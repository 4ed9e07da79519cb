"""Files written whole or not at all: a reader (or a crash) never sees half of a profile, a benchmark's JSON
or a gate reference."""

from __future__ import annotations

import errno
import os
import secrets


def regular_target(path: str | os.PathLike) -> str:
    """The file a write to path replaces: path, or the file its symbolic links lead to (the write keeps the
    links and updates what they point at). OSError where that exists and is not a regular file (a device such
    as /dev/null, a FIFO, a socket: a file renamed over it would replace the node itself; a folder), or where
    the links go round (ELOOP: no file to write through them)."""
    try:
        os.stat(path)  # follows the links: ELOOP where they go round (realpath returns a link of the loop)
    except FileNotFoundError:
        pass  # a new file, or a link to one
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
    if os.path.exists(real) and not os.path.isfile(real):
        raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
    return real


def probe_folder(folder: str | os.PathLike) -> None:
    """OSError unless a file can be made in folder (a read-only mount, or a special one such as /proc, where
    a folder's permission bits say yes and creating a file fails)."""
    probe = os.path.join(folder, f".strata-probe.{secrets.token_hex(4)}")
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(probe)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write a temporary file of a name of its own beside path (`.<name>.<random>.tmp`: two writers never
    share one, a user's `<path>.tmp` is never touched; created as open() creates a file, the umask applied),
    fsync it, then rename it over path. Where path is a symbolic link, over the file it leads to (the link
    stays); where that is not a regular file, OSError and nothing written (regular_target). On any failure
    the temporary file is removed and the OSError goes to the caller (path keeps what it held)."""
    path = regular_target(path)
    folder, name = os.path.split(path)
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
