"""The CUDA C kernels' registers, spills and shared memory on an H100 / H200 (sm_90), and the CTAs an SM holds
with them, without a GPU: NVRTC compiles each form with the options the engine gives it (each module's
build_options), and ptxas reports what the code needs.

    pip install -e ".[cuda-offline]"   # NVRTC and ptxas as wheels: no driver or GPU needed
    python scripts/cuda_resources.py [--arch sm_90] [--types Q4_0,Q8_0,Q4_K,Q6_K] [--kernels rows,mma,gemv]

A memory-bound kernel needs bytes in flight (the H200: ~4.8 TB/s x ~0.7 us, ~25 KB an SM), so the resident
warps an SM bound what its loads can cover: that is the column to read first. STRATA_NVRTC_LIB and
STRATA_PTXAS name the library and the binary where the wheels are not installed.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata_ray.config import name_list  # noqa: E402
from strata_ray.kernels import dense_q8_cuda, expert_mma_cuda, expert_rows_cuda  # noqa: E402
from strata_ray.kernels.expert_words import WORDS  # noqa: E402
from strata_ray.kernels.random_weights import Q_TYPES_FOR_TESTS as TYPES  # noqa: E402

E, N_FF, SMS = 2048, 512, 132  # Qwen3-Next-80B-A3B's expert shapes; the H200's SMs
# an sm_90 SM: 64K registers (allocated 256 a warp at a time), 228 KiB of shared memory (1 KiB reserved a
# CTA), 64 warps, 32 CTAs
REGS, SMEM, WARPS_MAX, CTAS_MAX = 65536, 233472, 64, 32


def _package_file(package: str, *parts: str) -> Path | None:
    try:
        mod = __import__(package, fromlist=["__path__"])
    except ImportError:
        return None
    for root in getattr(mod, "__path__", []):
        path = Path(root, *parts)
        if path.exists():
            return path
    return None


def find_tools() -> tuple[Path, Path]:
    """(libnvrtc, ptxas), or SystemExit with the one line that says how to get them."""
    lib = os.environ.get("STRATA_NVRTC_LIB")
    lib = Path(lib) if lib else _package_file("nvidia.cuda_nvrtc", "lib", "libnvrtc.so.12")
    ptxas = os.environ.get("STRATA_PTXAS") or shutil.which("ptxas")
    ptxas = Path(ptxas) if ptxas else _package_file("nvidia.cuda_nvcc", "bin", "ptxas")
    if lib is None or not lib.exists() or ptxas is None or not ptxas.exists():
        raise SystemExit("error: needs NVRTC and ptxas: pip install nvidia-cuda-nvrtc-cu12 "
                         "nvidia-cuda-nvcc-cu12 (or set STRATA_NVRTC_LIB and STRATA_PTXAS)")
    if not os.access(ptxas, os.X_OK):  # a wheel unpacked by hand loses the mode bits
        ptxas.chmod(ptxas.stat().st_mode | stat.S_IXUSR)
    return lib, ptxas


class Compiler:
    def __init__(self, lib: Path, ptxas: Path, arch: str):
        self.nvrtc, self.ptxas, self.arch = ctypes.CDLL(str(lib)), ptxas, arch

    def ptx(self, source: str, name: str, options: tuple[str, ...]) -> str:
        nv, prog = self.nvrtc, ctypes.c_void_p()
        if nv.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None):
            raise RuntimeError("nvrtcCreateProgram failed")
        try:
            opts = [o.encode() for o in ("-std=c++17", f"-arch=compute_{self.arch[3:]}", *options)]
            rc = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            if rc:
                size = ctypes.c_size_t()
                nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value)
                nv.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(f"NVRTC: {log.value.decode().strip().splitlines()[-1]}")
            size = ctypes.c_size_t()
            nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            nv.nvrtcGetPTX(prog, buf)
            return buf.value.decode()
        finally:
            nv.nvrtcDestroyProgram(ctypes.byref(prog))

    def resources(self, source: str, name: str, options: tuple[str, ...]) -> dict:
        """ptxas -v's registers, spill bytes, static shared memory and stack frame of the kernel."""
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp, "k.ptx")
            ptx.write_text(self.ptx(source, name, options))
            cmd = [str(self.ptxas), "-v", f"-arch={self.arch}", str(ptx), "-o", str(Path(tmp, "k.o"))]
            r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"ptxas: {r.stderr.strip().splitlines()[-1]}")
        info = r.stderr

        def first(pattern: str) -> int:
            m = re.search(pattern, info)
            return int(m.group(1)) if m else 0

        return {"regs": first(r"Used (\d+) registers"), "spill_stores": first(r"(\d+) bytes spill stores"),
                "spill_loads": first(r"(\d+) bytes spill loads"), "smem": first(r"(\d+) bytes smem"),
                "stack": first(r"(\d+) bytes stack frame")}


def ctas_an_sm(regs: int, threads: int, smem: int) -> tuple[int, str]:
    """CTAs an SM holds and what bounds them."""
    warps = -(-threads // 32)
    regs_a_warp = -(-regs * 32 // 256) * 256
    bounds = {"registers": REGS // max(1, regs_a_warp * warps), "shared memory": SMEM // (smem + 1024),
              "warps": WARPS_MAX // warps, "CTAs": CTAS_MAX}
    limit = min(bounds, key=bounds.get)
    return bounds[limit], limit


def forms(kernels: list[str], types: list[int], kquant_ctas: int = expert_mma_cuda.KQUANT_CTAS,
          gemv_ctas: int = 1, mma_warp_entries: int | None = None):
    """(kernel, what, source, name, options, threads, dynamic shared bytes) of each form the engine launches
    at Qwen3-Next-80B-A3B's shapes."""
    names = {v: k for k, v in TYPES.items()}
    # decode rows: gate + up (two) over E values, then down over N_FF; 1, 4, 8 entries a tile
    if "rows" in kernels:
        for wt in types:
            for k, two in ((E, True), (N_FF, False)):
                if expert_rows_cuda.geometry(k, wt) is None:
                    continue
                # each tile size in its one-block form, and in the walking form where the engine walks
                forms_bt = [(bt, False) for bt in (1, 2, 4, 8)]
                forms_bt += [(bt, True) for bt in (1, 2, 4, 8) if expert_rows_cuda.rows_iters(bt, two) > 1]
                # a down launch's forms with the SwiGLU folded in (WORDS["cuda_swiglu"]) beside the plain ones
                folds = (False,) if two else (False, True)
                for (bt, prefetch), swiglu in itertools.product(forms_bt, folds):
                    yield ("rows", f"{names[wt]} {'gate+up' if two else 'down'} k={k} bt={bt}"
                           f"{' prefetch' if prefetch else ''}{' swiglu' if swiglu else ''}",
                           expert_rows_cuda._SOURCE, "expert_rows",
                           expert_rows_cuda.build_options(
                               **expert_rows_cuda.engine_form(k, two, bt, wt, prefetch, swiglu)),
                           WORDS["cuda_warps"] * 32, 0)
    if "mma" in kernels:  # prompt rows on the int8 tensor cores
        for wt in types:
            for k, two in ((E, True), (N_FF, False)):
                geo = expert_mma_cuda.geometry(k, wt)
                if geo is None:
                    continue
                yield ("mma", f"{names[wt]} {'gate+up' if two else 'down'} k={k}", expert_mma_cuda._SOURCE,
                       "expert_mma",
                       expert_mma_cuda.engine_options(k, two, wt, kquant_ctas, mma_warp_entries), 128,
                       expert_mma_cuda.shared_bytes(geo))
    if "gemv" in kernels:  # the dense Q8_0 GEMV: the 80b's widest matrices at 1 and 4 tokens
        for n, k in ((12352, 2048), (2048, 4096), (151936, 2048)):
            for n_tok in (1, 4):
                rpw_g, tt = dense_q8_cuda.rows_a_group(n, k, SMS), dense_q8_cuda.tokens_a_cta(k, n_tok)
                yield ("gemv", f"{n}x{k} tokens={n_tok}", dense_q8_cuda._SOURCE, "q8_gemv",
                       dense_q8_cuda.build_options(k, rpw_g, tt, min_ctas=gemv_ctas),
                       dense_q8_cuda.WARPS * 32, dense_q8_cuda.x_bytes(k) * tt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90", help="ptxas target (default sm_90: H100 / H200)")
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K", type=name_list(TYPES),
                    help="expert weight types, a list")
    ap.add_argument("--kernels", default="rows,mma,gemv", type=name_list(("rows", "mma", "gemv")),
                    help="rows (decode experts), mma (prompt experts), "
                    "gemv (dense Q8_0), a list")
    ap.add_argument("--kquant-ctas", type=int, default=expert_mma_cuda.KQUANT_CTAS, choices=range(1, 5),
                    metavar="N", help="the K-quant prompt rows compiled for N CTAs an SM "
                    f"(STRATA_MMA_KQUANT_CTAS; default {expert_mma_cuda.KQUANT_CTAS}, the engine's; 1: the "
                    "compiler's choice)")
    ap.add_argument("--mma-warp-entries", type=int, choices=sorted(expert_mma_cuda.WARP_TILES), metavar="N",
                    help="the prompt rows' warp tile: N entries a warp (32 or 64; default the engine's, "
                    f"{expert_mma_cuda.MMA['warp_entries']})")
    ap.add_argument("--gemv-ctas", type=int, default=1, choices=range(1, 5), metavar="N",
                    help="the dense GEMV compiled for N CTAs an SM (STRATA_GEMV_MIN_CTAS; default 1)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"sm_\d+a?", args.arch):
        ap.error(f"--arch: invalid value {args.arch!r} (e.g. sm_90)")
    kernels = list(args.kernels)
    comp = Compiler(*find_tools(), args.arch)
    print(f"{'kernel':5s} {'form':34s} {'regs':>4s} {'spill':>9s} {'smem':>7s} {'thr':>4s} "
          f"{'CTAs/SM':>7s} {'warps/SM':>8s}  bound")
    types = [TYPES[t] for t in args.types]
    for kernel, what, source, name, options, threads, dyn in forms(kernels, types, args.kquant_ctas,
                                                                   args.gemv_ctas, args.mma_warp_entries):
        res = comp.resources(source, name, options)
        smem = res["smem"] + dyn
        ctas, bound = ctas_an_sm(res["regs"], threads, smem)
        spill = f"{res['spill_stores']}/{res['spill_loads']}"
        print(f"{kernel:5s} {what:34s} {res['regs']:4d} {spill:>9s} {smem:7d} {threads:4d} {ctas:7d} "
              f"{ctas * threads // 32:8d}  {bound}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
