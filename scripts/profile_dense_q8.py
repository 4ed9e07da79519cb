"""A decode token's dense Q8_0 GEMV, a few launches of each form, for a kernel profiler:
`ncu --kernel-name regex:"q8_gemv|_gemv_body" python scripts/profile_dense_q8.py [--shape 12352x2048]`.

Plain timing is bench_dense_q8.py's; this only runs the kernels (the CUDA C GEMV, then the Triton one).
"""

from __future__ import annotations

import argparse
import os

import torch

from strata_ray.kernels.dense_q8 import Q8Weight, q8_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="12352x2048", help="NxK of the matrix")
    ap.add_argument("--tokens", type=int, default=1, help="tokens a launch")
    ap.add_argument("--calls", type=int, default=3, help="calls of each form")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.lower().split("x"))
    w = Q8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda"),
                 (torch.rand(n, k // 32, device="cuda") * 0.02 + 1e-3).half())
    x = torch.randn(args.tokens, k, device="cuda")
    for form in ("1", "0"):  # STRATA_DENSE_CUDA: the CUDA C GEMV, then the Triton one
        os.environ["STRATA_DENSE_CUDA"] = form
        for _ in range(args.calls):
            q8_linear(x, w)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
