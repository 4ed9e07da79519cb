"""Drop the CPU kernels' numba cache when a file it was compiled from changed, not only the file it caches.

numba keys a cached function by its own source file's stamp, not by the files whose code was compiled into
it: the LLVM intrinsics of block_dots.py, the constants of contract.py and the act_quant / blocks functions
inlined into expert_cpu_kernels and expert_cpu_token. After a change to one of those, the callers' caches
load the old machine code (session 11: a Q6_K change benchmarked and tested as the code before it until
the caches were deleted by hand). Here a stamp beside the cache holds a hash of all SOURCES; when it
differs from the checkout's, the package's cache files are deleted before any is loaded, and numba
compiles them again.

With no stamp (a cache from before this guard, or cross-compiled: scripts/numba_cache_for.py) the cache is
kept and stamped: only a change seen after that clears it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# the files whose code ends up in the package's cached numba functions
SOURCES = ("act_quant.py", "blocks.py", "block_dots.py", "contract.py", "expert_cpu_kernels.py",
           "expert_cpu_token.py")
MODULES = ("act_quant", "blocks", "expert_cpu_kernels", "expert_cpu_token")  # modules with cache=True
STAMP = "strata-sources.sha1"


def sources_hash(folder: Path) -> str:
    h = hashlib.sha1()
    for name in SOURCES:
        h.update(name.encode())
        h.update((folder / name).read_bytes())
    return h.hexdigest()


def cache_folder(source: Path) -> Path | None:
    """Where numba keeps the cache of functions defined in `source` (NUMBA_CACHE_DIR or __pycache__)."""
    from numba.core.caching import CacheImpl

    def probe():  # a function of that file, for the locators
        pass

    for cls in CacheImpl._locator_classes:
        loc = cls.from_function(probe, str(source))
        if loc is not None:
            return Path(loc.get_cache_path())
    return None


def guard(folder: Path | None = None) -> bool:
    """Clear the package's numba cache files if SOURCES changed since it was stamped; returns whether it
    cleared any. Never raises: a cache it cannot read or write is left to numba."""
    folder = folder or Path(__file__).resolve().parent
    try:
        cache = cache_folder(folder / "blocks.py")
        if cache is None:
            return False
        now = sources_hash(folder)
        stamp = cache / STAMP
        old = stamp.read_text().strip() if stamp.is_file() else None
        if old == now:
            return False
        cleared = False
        if old is not None:
            for path in cache.iterdir():
                if path.suffix in (".nbi", ".nbc") and path.name.split(".", 1)[0] in MODULES:
                    path.unlink()
                    cleared = True
        cache.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_suffix(f".{os.getpid()}")
        tmp.write_text(now + "\n")
        tmp.replace(stamp)  # atomic: concurrent imports agree on one stamp
        return cleared
    except OSError:
        return False
