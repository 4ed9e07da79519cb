"""One layer's one-token expert rows (1 token x top-10, Q4_0, E = 2048, n_ff = 512), a few launches of each
form, for a kernel profiler: `ncu --kernel-name regex:q4_0_rows python scripts/profile_expert_rows.py`.

Plain timing is bench_kernels.py's; this only runs the kernels (the CUDA C rows, then the Triton words tile).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

import strata_ray.kernels.expert_words as ew
from strata_ray.kernels.contract import Q4_0, ExpertLayer
from strata_ray.kernels.expert_gpu import expert_ffn_gpu
from strata_ray.kernels.random_weights import random_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64, help="slots of the random layer")
    ap.add_argument("--calls", type=int, default=3, help="calls of each form")
    ap.add_argument("--rpw", default="2", help="the CUDA form's rows a row group, comma-separated")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    host = random_layer(rng, args.experts, 2048, 512, (Q4_0,) * 3)
    mats = (torch.from_numpy(w).cuda() for w in (host.gate, host.up, host.down))
    slots = ExpertLayer(*mats, Q4_0, Q4_0, Q4_0)
    x = torch.randn(1, 2048, device="cuda")
    tok = torch.zeros(10, dtype=torch.int32, device="cuda")
    outs = {}
    forms = [("1", int(rpw)) for rpw in args.rpw.split(",")] + [("0", 2)]
    for form, rpw in forms:  # STRATA_WORDS_CUDA: the CUDA C rows, then the Triton words tile
        os.environ["STRATA_WORDS_CUDA"] = form
        ew.WORDS["cuda_rpw"] = rpw
        for i in range(args.calls):
            ids = torch.from_numpy(rng.permutation(args.experts)[:10].astype(np.int32)).cuda()
            outs[form, rpw, i] = (ids, expert_ffn_gpu(x, tok, ids, slots, mode="decode", variant="words"))
    torch.cuda.synchronize()
    print("done", len(outs), "calls")


if __name__ == "__main__":
    main()
