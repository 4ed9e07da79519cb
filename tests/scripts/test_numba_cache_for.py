"""scripts/numba_cache_for.py: the host probe writes an index naming this machine's CPU (what a new GPU host
adds to scripts/numba_targets/), and bad target lists are one-line errors. The cross-compile itself takes
minutes a target; it is run by hand before each device session (docs/DEVICE-NOTES.md)."""

import subprocess
import sys
from pathlib import Path

import llvmlite.binding as llvm
import numba

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "numba_cache_for.py")
sys.path.insert(0, str(ROOT / "scripts"))

from numba_cache_for import target_of  # noqa: E402


def test_the_probe_names_this_machines_cpu(tmp_path):
    r = subprocess.run([sys.executable, SCRIPT, "--probe-to", str(tmp_path)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    (index,) = tmp_path.glob("*.nbi")
    cpu, features = target_of(str(index))
    assert cpu == llvm.get_host_cpu_name() and features
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert index.name.startswith(f"{cpu}-") and index.name.endswith(f"-{py}-numba{numba.__version__}.nbi")


def test_a_missing_target_index_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, SCRIPT, "--target-index", str(tmp_path / "none.nbi"),
                        "--signatures-from", str(ROOT / "scripts" / "numba_targets")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip() == f"error: no such index file: {tmp_path / 'none.nbi'}"
