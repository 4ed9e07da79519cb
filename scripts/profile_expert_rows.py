"""One layer's decode expert rows (T tokens x top-10, Q4_0 or --type, E = 2048, n_ff = 512), a few launches
of each form, for a kernel profiler:
`ncu --kernel-name regex:expert_rows python scripts/profile_expert_rows.py`. Where the warps wait, line by
line: `STRATA_NVRTC_LINEINFO=1 ncu --kernel-name regex:expert_rows --launch-skip 2 --launch-count 2 --section
WarpStateStats --section SourceCounters -o r python scripts/profile_expert_rows.py --tokens 4`, then `ncu
--import r.ncu-rep --page source --csv --print-source sass > r.csv` (a row a SASS instruction: the CSV has
no source lines; the report keeps them for ncu's UI), read by `python scripts/ncu_stalls.py r.csv`.
With --tokens T > 1 the tokens' experts overlap, so the CUDA rows take tiles of several entries of an expert
(a verify window's case: issue 5's "16+ experts a launch").

Plain timing is bench_kernels.py's; this only runs the kernels (the CUDA C rows, then the Triton words tile).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

import strata_ray.kernels.expert_words as ew
from strata_ray.config import int_list
from strata_ray.kernels.contract import Q4_0, Q8_0, ExpertLayer
from strata_ray.kernels.expert_gpu import expert_ffn_gpu
from strata_ray.kernels.random_weights import Q_TYPES_FOR_TESTS as TYPES
from strata_ray.kernels.random_weights import random_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=64, help="slots of the random layer")
    ap.add_argument("--calls", type=int, default=3, help="calls of each form")
    ap.add_argument("--rpw", default="2", type=int_list(1),
                    help="the CUDA form's rows a row group, comma-separated")
    ap.add_argument("--tokens", type=int, default=1, help="tokens a launch, each routed to 10 experts")
    ap.add_argument("--type", default="Q4_0", choices=sorted(TYPES), help="the experts' weight type")
    ap.add_argument("--early", action="store_true",
                    help="the CUDA form's EARLY prologue (WORDS['cuda_early']: one-entry tiles' slot and "
                         "order loaded beside TILE_START)")
    args = ap.parse_args()
    if not 1 <= args.tokens <= 8:
        ap.error("--tokens must be from 1 to 8")
    os.environ["STRATA_ROWS_EARLY"] = "1" if args.early else "0"  # over WORDS and the caller's environment
    rng = np.random.default_rng(0)
    wtype = TYPES[args.type]
    # gguf quantizes Q4_0 / Q8_0 from floats, not the K-quants: random blocks with sane scales for those
    host = random_layer(rng, args.experts, 2048, 512, (wtype,) * 3, from_floats=wtype in (Q4_0, Q8_0))
    mats = (torch.from_numpy(w).cuda() for w in (host.gate, host.up, host.down))
    slots = ExpertLayer(*mats, wtype, wtype, wtype)
    x = torch.randn(args.tokens, 2048, device="cuda")  # [T, E]
    tok = torch.arange(args.tokens, dtype=torch.int32, device="cuda").repeat_interleave(10)  # [T*10]
    outs = {}
    forms = [("1", rpw) for rpw in args.rpw] + [("0", 2)]
    for form, rpw in forms:  # STRATA_WORDS_CUDA: the CUDA C rows, then the Triton words tile
        os.environ["STRATA_WORDS_CUDA"] = form
        ew.WORDS["cuda_rpw"] = rpw
        for i in range(args.calls):
            ids = np.concatenate([rng.permutation(args.experts)[:10] for _ in range(args.tokens)])
            ids = torch.from_numpy(ids.astype(np.int32)).cuda()  # [T*10], each token's experts distinct
            outs[form, rpw, i] = (ids, expert_ffn_gpu(x, tok, ids, slots, mode="decode", variant="words"))
    torch.cuda.synchronize()
    print("done", len(outs), "calls")


if __name__ == "__main__":
    main()
