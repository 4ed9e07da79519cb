"""Build the CPU kernels' numba cache for another machine, here: compile without running.

The GPU machine is lent by the minute, and compiling the CPU pool's parallel kernel there costs minutes of
it after every change to the kernels' files. numba keys a cached overload by the source file's hash, the
signature, and the target (CPU name and feature string), so a cache compiled here with the target's name
and features (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES) loads there, provided the Python minor version, numba
version and absolute source path match. The target is read from a cache index (.nbi) made on that
machine; the signatures from this checkout's own cache indexes (those the tests and benchmarks compiled).

    # in a venv with the target's Python minor version and numba version, from the repo root, after the
    # CPU tests compiled this checkout's signatures (the defaults: every host's index in numba_targets/, one
    # compile each into one cache, this checkout's __pycache__, /tmp/nbc: the GPU machine's NUMBA_CACHE_DIR,
    # whose name the tarball keeps):
    python scripts/numba_cache_for.py [--target-index A.nbi,B.nbi] \
        [--signatures-from strata_ray/kernels/__pycache__] [--cache-dir /tmp/nbc] --tar .nbc/nbc.tar.xz

    # on a new machine (device_check.sh does it): its target as an index file, to add to numba_targets/
    python scripts/numba_cache_for.py --probe-to DIR

Nothing is executed: the compiled code may use instructions this CPU lacks.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# the kernels package's files with cached njit functions
MODULES = ("act_quant", "blocks", "cpu_atomics", "expert_cpu_kernels", "expert_cpu_token")
# indexes made on the GPU machines' hosts (a probe: one cached njit function compiled there), one a CPU:
# the H200 host's (session 12); a host without one here compiles the kernels itself (~110 s, session 38)
TARGETS = Path(__file__).parent / "numba_targets"


def read_index(path: str) -> tuple[str, dict]:
    """A numba .nbi file -> (numba version, {(signature, target, code hashes): data name})."""
    with open(path, "rb") as f:
        version = pickle.load(f)
        _stamp, overloads = pickle.loads(f.read())
    return version, overloads


def target_of(index_path: str) -> tuple[str, str]:
    """(cpu name, feature string) of the first overload in an index made on the target machine."""
    _, overloads = read_index(index_path)
    for _sig, (_triple, cpu, features), *_hashes in overloads:
        return cpu, features
    raise SystemExit(f"error: {index_path} holds no overloads")


def signatures(folder: str) -> dict[tuple[str, str], set]:
    """{(module, function): signatures} from this checkout's cache indexes of MODULES."""
    found: dict[tuple[str, str], set] = {}
    for path in glob.glob(os.path.join(folder, "*.nbi")):
        module, rest = os.path.basename(path).split(".", 1)
        if module not in MODULES:
            continue
        function = rest.rsplit("-", 1)[0]
        _, overloads = read_index(path)
        found.setdefault((module, function), set()).update(key[0] for key in overloads)
    return found


def compile_all(found: dict[tuple[str, str], set]) -> None:
    """Compile every signature for the target set in the environment (runs in the child process)."""
    for (module, function), sigs in sorted(found.items()):
        mod = importlib.import_module(f"strata_ray.kernels.{module}")
        disp = getattr(mod, function)
        for sig in sigs:
            t = time.perf_counter()
            disp.compile(sig)
            print(f"compiled {module}.{function}{tuple(str(a) for a in sig)[:2]}... in "
                  f"{time.perf_counter() - t:.1f} s", flush=True)


_PROBE = "from numba import njit\n\n\n@njit(cache=True)\ndef one():\n    return 1\n"


def probe(folder: str) -> Path:
    """This machine's numba target as an index file in `folder` (named by its CPU, Python and numba): one
    cached function compiled in a scratch cache by a fresh interpreter, whose environment picks the host."""
    import numba

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "strata_numba_probe.py").write_text(_PROBE)
        env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(tmp, "cache"), PYTHONPATH=tmp)
        for name in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
            env.pop(name, None)
        subprocess.run([sys.executable, "-c", "import strata_numba_probe as p; p.one()"], env=env, check=True,
                       cwd=tmp, timeout=300)
        index = next(Path(tmp, "cache").rglob("*.nbi"), None)
        if index is None:
            raise SystemExit("error: the probe wrote no numba cache index (is caching disabled?)")
        cpu, features = target_of(str(index))
        py = f"py{sys.version_info.major}{sys.version_info.minor}"
        # the features' hash too: two hosts of one CPU name may differ in them (and so in their code)
        tag = hashlib.sha1(features.encode()).hexdigest()[:8]
        dest = Path(folder) / f"{cpu}-{tag}-{py}-numba{numba.__version__}.nbi"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(index, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-index", default=",".join(sorted(str(p) for p in TARGETS.glob("*.nbi"))),
                    help="comma-separated .nbi files, each made on a target machine: the cache holds each "
                    "one's compile (default: every host's kept in scripts/numba_targets/)")
    ap.add_argument("--probe-to", default=None, metavar="DIR",
                    help="only write this machine's target index into DIR (for numba_targets/) and stop")
    ap.add_argument("--signatures-from", default="strata_ray/kernels/__pycache__",
                    help="folder of this checkout's .nbi files whose signatures to compile")
    ap.add_argument("--cache-dir", default="/tmp/nbc", help="NUMBA_CACHE_DIR to fill (the target's path)")
    ap.add_argument("--tar", default=None, help="pack the cache folder into this .tar.xz (xz: half of gzip's "
                    "size, and a device call carries 64 MiB in all)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe_to:
        print(f"this machine's target: {probe(args.probe_to)}")
        return 0
    targets = [p for p in args.target_index.split(",") if p]
    if not targets:
        print("error: no target index (--target-index, or scripts/numba_targets/*.nbi)", file=sys.stderr)
        return 2
    for path in targets:
        if not os.path.isfile(path):
            print(f"error: no such index file: {path}", file=sys.stderr)
            return 2
    found = signatures(args.signatures_from)
    if not found:
        print(f"error: no cache indexes of {', '.join(MODULES)} in {args.signatures_from}", file=sys.stderr)
        return 2
    if args.child:
        compile_all(found)
        return 0
    rc = 0
    n_sigs = sum(map(len, found.values()))
    for path in targets:  # one child a target, each adding its overloads to the same indexes
        cpu, features = target_of(path)
        print(f"target {cpu}, {len(features.split(','))} features; {n_sigs} signatures")
        env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features,
                   NUMBA_CACHE_DIR=args.cache_dir)
        env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
        rc = subprocess.call([sys.executable, __file__, "--child", "--target-index", path,
                              "--signatures-from", args.signatures_from], env=env)
        if rc:
            print(f"error: compiling for {cpu} ({path}) failed", file=sys.stderr)
            break
    if rc == 0 and args.tar:
        cache = Path(args.cache_dir)
        Path(args.tar).parent.mkdir(parents=True, exist_ok=True)  # a fresh checkout has no .nbc/
        with tarfile.open(args.tar, "w:xz") as tar:
            tar.add(cache, arcname=cache.name)
        print(f"packed {cache} into {args.tar}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
