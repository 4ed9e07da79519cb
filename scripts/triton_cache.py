"""Triton's compiled kernels carried from one GPU-machine call to the next: a fresh machine spends 200-260 s
compiling the engine's Triton kernels in the first tests or runs that launch them (sessions 42-44), of a
session's 30 minutes of device time. Triton keeps each compiled kernel as a group of files in its cache
(TRITON_CACHE_DIR): the IR of every stage, the PTX, the cubin and a metadata JSON, named by a hash of the
source, the specialization, the options and the compiler's own version. A machine of the same image and
architecture (the H100 and the H200 are both sm_90) with the same kernel sources finds them again.

    # at the end of a call on the GPU machine (scripts/device_caches.sh's pack_triton_cache does it):
    python scripts/triton_cache.py pack --out $OUT/triton.tar.xz
    # here: keep it where the next call carries it, then the next call unpacks it first (device_caches.sh)
    mkdir -p .tcache && cp /work/.device/N/triton.tar.xz .tcache/
    python scripts/triton_cache.py unpack .tcache/triton.tar.xz

A group keeps its metadata, PTX and cubin (what a launch and `CompiledKernel.asm["ptx"]` read); the other
stages' IR is left out of the archive and out of the group's list, which Triton checks file by file, so the
archive stays a few MiB. Group files name their members by absolute path: the archive holds them relative
to the cache folder, and unpacking writes them for the folder they land in. Files already there are kept.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
from pathlib import Path

KEEP = ("json", "ptx", "cubin")  # a group's members by suffix: metadata, PTX, binary
GROUP_PREFIX = "__grp__"


def cache_dir(given: str | None) -> Path:
    """The cache folder: given, else TRITON_CACHE_DIR, else Triton's default ~/.triton/cache."""
    return Path(given or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def _groups(root: Path):
    """(group file, its child_paths) of every readable group under root."""
    for grp in sorted(root.glob(f"*/{GROUP_PREFIX}*.json")):
        try:
            children = json.loads(grp.read_text())["child_paths"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        yield grp, children


def pack(root: Path, out: Path, keep=KEEP) -> tuple[int, int]:
    """Every complete group under root into the tar.xz `out`, trimmed to the kept members -> (groups, bytes
    of the archive). A group with a member missing, or none of its members kept, is skipped."""
    n = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    with tarfile.open(part, "w:xz") as tar:
        for grp, children in _groups(root):
            kept = {name: Path(path) for name, path in children.items() if name.rsplit(".", 1)[-1] in keep}
            if not kept or not all(p.is_file() for p in kept.values()):
                continue
            members = {}
            for name, path in kept.items():
                rel = Path(grp.parent.name) / path.name  # a kernel's files share its key's folder
                tar.add(path, arcname=str(rel))
                members[name] = str(rel)
            body = json.dumps({"child_paths": members}).encode()
            info = tarfile.TarInfo(str(grp.relative_to(root)))
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
            n += 1
    part.replace(out)
    return n, out.stat().st_size


def unpack(archive: Path, root: Path) -> tuple[int, int]:
    """The archive's groups into root -> (groups written, groups already there). Members go where the
    archive names them (relative to root, files already there kept); each group file is written last, its
    members' paths made absolute for root."""
    written = present = 0
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        groups = []
        for member in tar.getmembers():
            rel = Path(member.name)
            if rel.is_absolute() or ".." in rel.parts or not member.isfile():
                raise SystemExit(f"error: {archive}: an unexpected member {member.name!r}")
            if rel.name.startswith(GROUP_PREFIX):
                groups.append(member)
                continue
            dest = root / rel
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(tar.extractfile(member).read())
        for member in groups:
            dest = root / member.name
            if dest.exists():
                present += 1
                continue
            children = json.loads(tar.extractfile(member).read())["child_paths"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            body = json.dumps({"child_paths": {k: str(root / v) for k, v in children.items()}})
            dest.write_text(body)
            written += 1
    return written, present


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="the cache's groups (metadata, PTX, cubin) into a tar.xz")
    p.add_argument("--out", required=True, help="the archive to write (.tar.xz)")
    p.add_argument("--cache-dir", default=None, help="default: TRITON_CACHE_DIR, else ~/.triton/cache")
    u = sub.add_parser("unpack", help="an archive's groups into the cache (files already there kept)")
    u.add_argument("archive", help="a tar.xz made by pack")
    u.add_argument("--cache-dir", default=None, help="default: TRITON_CACHE_DIR, else ~/.triton/cache")
    args = ap.parse_args(argv)
    root = cache_dir(args.cache_dir)
    if args.verb == "pack":
        if not root.is_dir():
            print(f"error: no Triton cache at {root}", file=sys.stderr)
            return 1
        n, size = pack(root, Path(args.out))
        print(f"packed {n} kernels from {root} into {args.out} ({size / 2**20:.1f} MiB)")
        return 0
    archive = Path(args.archive)
    if not archive.is_file():
        print(f"error: no such archive: {archive}", file=sys.stderr)
        return 1
    try:
        written, present = unpack(archive, root)
    except (tarfile.TarError, OSError, ValueError, KeyError, EOFError) as e:  # a truncated or foreign file
        print(f"error: {archive}: not a Triton cache archive ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    print(f"unpacked {written} kernels into {root} ({present} already there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
