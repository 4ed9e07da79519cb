"""The numba cache guard (strata_ray/kernels/numba_cache.py) on a copy of the kernels' sources."""

from __future__ import annotations

import shutil
from pathlib import Path

from strata_ray.kernels import numba_cache
from strata_ray.kernels.numba_cache import SOURCES, STAMP, cache_folder, guard

KERNELS = Path(numba_cache.__file__).resolve().parent


def test_a_changed_source_clears_the_packages_cache_files_only(tmp_path):
    for name in SOURCES:
        shutil.copy(KERNELS / name, tmp_path / name)
    cache = cache_folder(tmp_path / "blocks.py")
    assert cache is not None
    cache.mkdir(parents=True, exist_ok=True)
    ours = [cache / "blocks.tile_sums-95.py311.nbi", cache / "expert_cpu_token.token_rows-160.py311.1.nbc"]
    other = cache / "elsewhere.f-3.py311.nbi"
    for path in (*ours, other):
        path.write_bytes(b"x")
    assert guard(tmp_path) is False  # no stamp yet: kept, and stamped
    assert (cache / STAMP).is_file() and all(p.exists() for p in ours)
    assert guard(tmp_path) is False  # unchanged sources
    with open(tmp_path / "block_dots.py", "a") as f:  # an intrinsic changed: its callers' caches are stale
        f.write("\n# changed\n")
    assert guard(tmp_path) is True
    assert not any(p.exists() for p in ours) and other.exists()
    assert guard(tmp_path) is False  # stamped again: nothing more to clear


def test_the_checkout_is_stamped():
    """Importing the package ran the guard: this checkout's cache folder carries the current stamp."""
    cache = cache_folder(KERNELS / "blocks.py")
    stamp = cache / STAMP
    assert stamp.read_text().strip() == numba_cache.sources_hash(KERNELS)
