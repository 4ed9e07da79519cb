"""Compile every PDL-converted Triton kernel for sm_90 with its PDL branch on, on a machine without a GPU.

The CPU tests run the kernel bodies under Triton's interpreter with PDL off, so a PDL branch that no longer
compiles would only show on the GPU machine. Here each launch wrapper runs over CPU tensors of decode shapes
with `pdl_on` forced true and Triton's launch replaced by a recorder; each recorded launch is then compiled
ahead of time for an H100 (`triton.compile`, ptxas from Triton's wheel), and its PTX must hold
griddepcontrol.wait. Run by tests/kernels/test_pdl.py in a process of its own: TRITON_INTERPRET must be off
before triton is imported (the test process has it on).

    python tests/kernels/pdl_compile_probe.py    -> one line a kernel, exit 1 on any failure
"""

from __future__ import annotations

import os
import sys

import torch

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.int8: "i8", torch.uint8: "u8",
           torch.int32: "i32", torch.int64: "i64"}


def _record_launches() -> list:
    """Replace JITFunction.run by a recorder; the list fills with (function, args, kwargs)."""
    from triton.runtime.jit import JITFunction

    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = run
    return launches


def _force_pdl() -> None:
    """pdl_on True for every tensor: each module's pdl_args looks it up in kernels/pdl at each call."""
    from strata_ray.kernels import pdl

    pdl.pdl_on = lambda t: True


def _launch_all() -> None:
    """Each converted kernel once, through its wrapper, at the 80b-a3b's decode shapes (one token)."""
    from strata_ray.kernels.attention_decode import DeviceAttention, attention_decode
    from strata_ray.kernels.decode_plan import decode_plan_pcie
    from strata_ray.kernels.expert_words import _swiglu_tail
    from strata_ray.kernels.flag_wait import wait_flag
    from strata_ray.kernels.fused_small import (
        add_rms_norm_fused,
        combine_fused,
        rms_norm_fused,
        shared_act_fused,
    )
    from strata_ray.kernels.gdn_step import GDNDims, gdn_step
    from strata_ray.kernels.norm_rope import norm_rope_fused
    from strata_ray.kernels.publish import ActCodes, publish
    from strata_ray.kernels.router import route_topk, router_logits

    i8, i32, i64 = torch.int8, torch.int32, torch.int64
    E, K, X = 2048, 10, 512
    x = torch.zeros(1, E)
    rms_norm_fused(x, torch.ones(E), 1e-6)
    add_rms_norm_fused(x, x, torch.ones(E), 1e-6)
    combine_fused(x, torch.zeros(1, K, E), torch.zeros(1, K), x,
                  gather=(torch.zeros(3, E), torch.zeros(1, K, dtype=i32), torch.zeros(1, K, dtype=i32)))
    shared_act_fused(torch.zeros(1, 512), torch.zeros(1, 512), x, torch.zeros(E))
    dims = GDNDims(nk=16, nv=32, dk=128, dv=128)
    c = 2 * dims.key_dim + dims.nv * dims.dv
    nv = dims.nv
    gdn_step(torch.zeros(1, c), torch.zeros(1, nv * dims.dv), torch.zeros(1, 2 * nv),
             torch.zeros(nv, dims.dk, dims.dv), torch.zeros(3, c), torch.zeros(c, 4), torch.zeros(nv),
             torch.zeros(nv), torch.ones(dims.dv), dims, 1e-6)
    route_topk(router_logits(x, torch.zeros(X, E)), K)
    ids = torch.zeros(K, dtype=i64)
    codes = ActCodes(torch.zeros(1, E, dtype=i8), torch.zeros(1, E // 32), torch.zeros(1, E // 32, dtype=i32))
    flag, base = torch.zeros(1, dtype=i32), torch.zeros(1, dtype=i64)
    ids_host, ids_all = torch.zeros(K, dtype=i64), torch.zeros(48, K, dtype=i64)
    publish(ids, x, ids_host, ids_all, codes, flag, base, 3, codes=codes)
    wait_flag(flag, base, 3)
    decode_plan_pcie(torch.zeros(48 * X, dtype=i32), 0, ids, X, 250)
    _swiglu_tail(torch.zeros(4, 2, 512), torch.zeros(4, 512, dtype=i8), torch.zeros(4, 16),
                 torch.zeros(4, 16, dtype=i32), 512)
    norm_rope_fused(torch.zeros(1, 16, 512), torch.zeros(1, 2, 256), torch.ones(256), torch.ones(256), 1e-6,
                    torch.zeros(1, 1, 64), torch.zeros(1, 1, 64))
    attention_decode(torch.zeros(1, 16, 256), torch.zeros(64, 2, 256), torch.zeros(64, 2, 256), 63, 0.0625)
    att = DeviceAttention(16, 2, 256, 1024, torch.device("cpu"))
    table, pos = torch.zeros(2, dtype=i64), torch.zeros(1, dtype=i64)
    att.append(table, pos, torch.zeros(1, 2, 256), torch.zeros(1, 2, 256))
    att(torch.zeros(1, 16, 256), table, pos, 0.0625)


def _signature(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of one recorded launch."""
    names = fn.arg_names
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    constexpr_names = {fn.params[i].name for i in fn.constexprs}
    signature, constexprs = {}, {}
    for name in names:
        v = values[name]
        if name in constexpr_names:
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _DTYPES[v.dtype]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            signature[name] = "i32" if -2**31 <= v < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    options = {k: v for k, v in kwargs.items() if k not in names}
    return signature, constexprs, options


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("pdl_compile_probe: run with TRITON_INTERPRET unset (it compiles for the GPU)")
    import triton
    from triton.backends.compiler import GPUTarget

    launches = _record_launches()
    _force_pdl()
    _launch_all()
    failed = 0
    for fn, args, kwargs in launches:
        name = fn.fn.__name__
        try:
            signature, constexprs, options = _signature(fn, args, kwargs)
            src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
            ok = "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
            print(f"{name}: {'compiled, waits' if ok else 'compiled, NO griddepcontrol'}", flush=True)
            failed += not ok
        except Exception as e:  # noqa: BLE001 (each kernel's one line)
            first = str(e).splitlines()[0] if str(e) else ""
            print(f"{name}: FAILED {type(e).__name__}: {first}", flush=True)
            failed += 1
    print(f"{len(launches)} launches, {failed} failed")
    return 1 if failed or not launches else 0


if __name__ == "__main__":
    sys.exit(main())
