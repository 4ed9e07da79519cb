"""The CPU team's gate/up units on one core: half tiles (8 rows, `STRATA_TEAM_UNITS=half`) against whole tiles
(16 rows, `whole`), and what each split leaves the slowest member of a team.

    PYTHONPATH=. python scripts/bench_team_units.py [--entries 1,2,3] [--team 15] [--reps 200] [--cold]

One thread runs `gate_up_rows_share` over every unit of a layer's m experts (one token, one entry each, Q4_0,
Qwen3-Next-80B shapes: E 2048, n_ff 512), so the time is the work a team splits, and the us a row of each
unit size say whether half tiles cost more a row (their activation loads and scale setup are paid per 8
rows instead of 16). `--cold` walks a pool of experts twice the L3 so the rows come from DRAM, as in the
engine; by default the same experts repeat (L2/L3: the kernel's own rate). Then for a team of `--team`
members: the units of each form, the most a member holds and member 0's share, in us at this rate: the
barrier's least wait.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from strata_ray.config import int_list
from strata_ray.kernels.act_quant import quantize_act_sums
from strata_ray.kernels.block_dots import HALF_ROWS, ROWS
from strata_ray.kernels.contract import Q4_0, readonly_blocks
from strata_ray.kernels.expert_cpu_kernels import gate_up_rows_share
from strata_ray.kernels.random_weights import random_layer

E, N_FF = 2048, 512


def _shares(n_units: int, n_team: int) -> list[int]:
    """Units of each member: expert_cpu_kernels._share's contiguous split."""
    members = min(n_team, n_units)
    return [(n_units * (t + 1)) // members - (n_units * t) // members for t in range(members)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", default="1,2,3", type=int_list(1),
                    help="CPU entries (experts) a layer, a list")
    ap.add_argument("--team", type=int, default=15, help="members the split is reported for")
    ap.add_argument("--reps", type=int, default=200, help="timed layers of each case")
    ap.add_argument("--cold", action="store_true", help="a pool of experts twice a 32 MiB L3: rows from DRAM")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    blob = 3 * N_FF * E // 32 * 18  # Q4_0 gate + up + down of one expert
    n_expert = max(16, (64 << 20) // blob) if args.cold else 16
    lay = random_layer(rng, n_expert, E, N_FF, (Q4_0, Q4_0, Q4_0), from_floats=False)
    gate, up = readonly_blocks(lay.gate), readonly_blocks(lay.up)
    xq, xd, xs = quantize_act_sums(rng.standard_normal((1, E)).astype(np.float32))
    where = "from DRAM" if args.cold else "cached"
    print(f"one core, Q4_0, E {E}, n_ff {N_FF}; {n_expert} experts ({where})")
    for m in args.entries:
        tok = np.zeros(m, np.int64)
        ents = np.arange(m, dtype=np.int64)
        g_start = np.arange(m + 1, dtype=np.int64)
        h = np.empty((m, N_FF), np.float32)
        per_row = {}
        for unit_rows in (ROWS, HALF_ROWS, ROWS, HALF_ROWS):  # twice each, interleaved: the second counts
            times = []
            for _ in range(args.reps):
                g_exp = np.sort(rng.choice(n_expert, m, replace=False)).astype(np.int64)
                t = time.perf_counter()
                gate_up_rows_share(gate, Q4_0, up, Q4_0, xq, xd, xs, tok, ents, g_start, g_exp, 0, 1,
                                   unit_rows, h)
                times.append(time.perf_counter() - t)
            per_row[unit_rows] = float(np.median(times)) / (m * N_FF) * 1e6  # us a gate+up row pair
        print(f"{m} CPU entries: us a gate+up row: whole tiles {per_row[ROWS]:.4f}, half tiles "
              f"{per_row[HALF_ROWS]:.4f} ({per_row[HALF_ROWS] / per_row[ROWS] - 1:+.1%})")
        for unit_rows, name in ((ROWS, "whole"), (HALF_ROWS, "half")):
            sh = _shares(m * N_FF // unit_rows, args.team)
            us = per_row[unit_rows] * unit_rows
            print(f"  {name:5s}: {m * N_FF // unit_rows} units over {args.team}: most {max(sh)} "
                  f"({max(sh) * us:.1f} us), member 0 {sh[0]} ({sh[0] * us:.1f} us): its least wait "
                  f"{(max(sh) - sh[0]) * us:.1f} us")


if __name__ == "__main__":
    main()
