"""atomic_file: a whole file or none; writes through symbolic links; never renames a file over a device or a
FIFO; the folder probe."""

import errno
import os

import pytest

from strata_ray.atomic_file import probe_folder, regular_target, write_atomic


def test_writes_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "out.json"
    write_atomic(path, "first")
    write_atomic(path, b"second")
    assert path.read_bytes() == b"second" and os.listdir(tmp_path) == ["out.json"]


def test_a_symbolic_link_is_written_through_and_kept(tmp_path):
    """The file the link leads to gets the bytes; the link stays a link (it was replaced by a regular file,
    the target never updated). A dangling link creates its target."""
    (tmp_path / "real").mkdir()
    target, link = tmp_path / "real" / "p.strp", tmp_path / "link.strp"
    target.write_bytes(b"old")
    link.symlink_to(target)
    write_atomic(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path / "real")) == ["p.strp"]  # the temporary file was made beside it
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "real" / "later.strp")
    write_atomic(dangling, b"made")
    assert dangling.is_symlink() and (tmp_path / "real" / "later.strp").read_bytes() == b"made"


def test_a_loop_of_links_is_refused_and_kept(tmp_path):
    """Links that lead round to each other have no file to write through: ELOOP, where the write replaced
    one link of the loop with a file."""
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    with pytest.raises(OSError) as e:
        regular_target(tmp_path / "a")
    assert e.value.errno == errno.ELOOP
    with pytest.raises(OSError):
        write_atomic(tmp_path / "a", b"x")
    assert (tmp_path / "a").is_symlink() and sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_a_fifo_or_a_device_is_refused_and_kept(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null"):
        if not os.path.exists(path):
            continue
        with pytest.raises(OSError, match="not a regular file"):
            regular_target(path)
    with pytest.raises(OSError, match="not a regular file"):
        write_atomic(fifo, b"x")  # /dev/null is never written to, even in a test: its check is the same
    assert not os.path.isfile(fifo) and os.listdir(tmp_path) == ["pipe"]
    link = tmp_path / "to_pipe"
    link.symlink_to(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        write_atomic(link, b"x")
    assert link.is_symlink()


def test_the_probe_leaves_nothing(tmp_path):
    probe_folder(tmp_path)
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        probe_folder(tmp_path / "missing")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc")
def test_the_probe_fails_where_permission_bits_say_yes():
    """/proc's folders look writable to root, and no file can be made there."""
    with pytest.raises(OSError):
        probe_folder("/proc")
