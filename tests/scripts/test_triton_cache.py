"""scripts/triton_cache.py: a kernel compiled into one Triton cache (ahead of time for sm_90, with Triton's
own ptxas: no GPU needed) is packed, unpacked into an empty cache elsewhere, and found there: compiling it
again writes no file, and the kernel's PTX and cubin come back. Bad archives are one-line errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # the test extra holds it on Linux

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "triton_cache.py")

COMPILE = r"""
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget


@triton.jit
def twice(X, Y, N, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(Y + i, tl.load(X + i, mask=i < N) * 2, mask=i < N)


signature = {"X": "*fp32", "Y": "*fp32", "N": "i32", "B": "constexpr"}
src = triton.compiler.ASTSource(fn=twice, signature=signature, constexprs={"B": 128})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
print("ptx", "twice" in k.asm["ptx"], "cubin", len(k.asm["cubin"]) > 0)
"""


def _compile(cache: Path) -> str:
    script = cache.parent / "compile_twice.py"  # @triton.jit wants its source in a file
    script.write_text(COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache)}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    if r.returncode and "ptxas" in r.stderr:
        pytest.skip("no ptxas for sm_90 here")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_packed_kernel_is_found_in_another_cache(tmp_path):
    first, second, archive = tmp_path / "first", tmp_path / "second", tmp_path / "t.tar.xz"
    assert _compile(first) == "ptx True cubin True"
    r = _run("pack", "--cache-dir", str(first), "--out", str(archive))
    assert r.returncode == 0 and r.stdout.startswith("packed 1 kernels"), r.stdout + r.stderr
    assert any(f.endswith(".ttir") for f in _files(first))  # the source cache keeps its IR
    r = _run("unpack", str(archive), "--cache-dir", str(second))
    assert r.returncode == 0 and r.stdout.startswith("unpacked 1 kernels"), r.stdout + r.stderr
    unpacked = _files(second)
    assert {Path(f).suffix for f in unpacked} == {".json", ".ptx", ".cubin"}
    assert _compile(second) == "ptx True cubin True"
    assert _files(second) == unpacked  # a hit: nothing compiled, nothing written
    r = _run("unpack", str(archive), "--cache-dir", str(second))
    assert r.returncode == 0 and "(1 already there)" in r.stdout


def test_bad_archives_and_caches_are_one_line(tmp_path):
    bad = tmp_path / "bad.tar.xz"
    bad.write_bytes(b"not an archive")
    r = _run("unpack", str(bad), "--cache-dir", str(tmp_path / "c"))
    assert r.returncode == 1 and r.stderr.startswith(f"error: {bad}: not a Triton cache archive")
    assert len(r.stderr.strip().splitlines()) == 1
    r = _run("unpack", str(tmp_path / "none.tar.xz"))
    assert r.returncode == 1 and r.stderr.strip() == f"error: no such archive: {tmp_path / 'none.tar.xz'}"
    r = _run("pack", "--cache-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "o.tar.xz"))
    assert r.returncode == 1 and r.stderr.strip() == f"error: no Triton cache at {tmp_path / 'nothing'}"
