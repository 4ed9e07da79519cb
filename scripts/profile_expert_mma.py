"""One prompt chunk's expert layer (T tokens x top-10 over --experts slots, Q4_0 or --type, E = 2048,
n_ff = 512) through the int8 MMA rows, a few calls, for a kernel profiler:
`ncu --kernel-name regex:expert_mma --launch-skip 2 --launch-count 2 --section SpeedOfLight --section
WarpStateStats python scripts/profile_expert_mma.py --tokens 4096` (the gate / up launch, then the down).
bench_kernels.py's prompt rows use the same shape (4096 tokens; 1024 with --quick): about 160 (40) entries an
expert, tiles of up to 64 entries. Plain timing is bench_kernels.py's; this only runs the kernels.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from strata_ray.kernels.contract import Q4_0, Q8_0, ExpertLayer
from strata_ray.kernels.expert_gpu import expert_ffn_gpu
from strata_ray.kernels.random_weights import Q_TYPES_FOR_TESTS as TYPES
from strata_ray.kernels.random_weights import random_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=256, help="slots of the random layer")
    ap.add_argument("--calls", type=int, default=3, help="calls (each a gate / up and a down launch)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the chunk, each routed to 10 experts")
    ap.add_argument("--type", default="Q4_0", choices=sorted(TYPES), help="the experts' weight type")
    args = ap.parse_args()
    if args.tokens < 1 or args.experts < 10:
        ap.error("--tokens must be at least 1 and --experts at least 10")
    rng = np.random.default_rng(0)
    wtype = TYPES[args.type]
    host = random_layer(rng, args.experts, 2048, 512, (wtype,) * 3, from_floats=wtype in (Q4_0, Q8_0))
    slots = ExpertLayer(*(torch.from_numpy(w).cuda() for w in (host.gate, host.up, host.down)),
                        wtype, wtype, wtype)
    x = torch.randn(args.tokens, 2048, device="cuda")  # [T, E]
    tok = torch.arange(args.tokens, dtype=torch.int32, device="cuda").repeat_interleave(10)  # [T*10]
    for _ in range(args.calls):
        ids = np.concatenate([rng.permutation(args.experts)[:10] for _ in range(args.tokens)])
        ids = torch.from_numpy(ids.astype(np.int32)).cuda()  # [T*10], each token's experts distinct
        expert_ffn_gpu(x, tok, ids, slots, mode="prompt", variant="words")
    torch.cuda.synchronize()
    print("done", args.calls, "calls")


if __name__ == "__main__":
    main()
