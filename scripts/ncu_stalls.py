"""Where a kernel's warps wait, instruction by instruction, from ncu's source page as CSV.

    ncu --import r.ncu-rep --page source --csv --print-source sass > r.csv
    python scripts/ncu_stalls.py r.csv [--top 12] [--kernel 0]

ncu's details page gives a launch's stall reasons in total; its source page gives them per SASS instruction
("Warp Stall Sampling" and one column per reason). This folds that page into what session 47 read by hand:
per launch, the samples and executed instructions, the stall reasons, the samples and executions by opcode
(`IMAD.WIDE` counts as IMAD), the share of samples up to the first CTA barrier (BAR.SYNC: a prologue of
dependent loads shows up there), and the instructions that hold the most samples with their two largest
reasons and the instruction just before each (a stall is charged to the instruction that waits, so the load
it waits on sits earlier). The CSV holds one table a profiled launch, each opened by a "Kernel Name" line.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_launches(path: str) -> list[tuple[str, list[dict]]]:
    """(kernel name, rows as dicts by column) of each launch in the CSV, in order."""
    launches, header = [], None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                launches.append((row[1] if len(row) > 1 else "?", []))
            elif row[0] == "Address":
                header = row
            elif launches and header:
                launches[-1][1].append(dict(zip(header, row, strict=False)))  # a trailing comma or not
    return launches


def _int(text: str | None) -> int:
    return int((text or "0").replace(",", "") or 0)


def opcode(sass: str) -> str:
    """The opcode's family: `@!P0 IMAD.WIDE R8, ...` -> IMAD."""
    return re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).split(" ")[0].split(".")[0]


def summary(rows: list[dict], top: int) -> list[str]:
    """The report's lines for one launch."""
    samples = [_int(r.get(SAMPLES)) for r in rows]
    total = sum(samples) or 1
    reasons = [c for c in (rows[0] if rows else {}) if c.startswith("stall_") and "Not Issued" not in c]
    by_reason = Counter({c[6:]: sum(_int(r.get(c)) for r in rows) for c in reasons})
    by_op, ex_op = Counter(), Counter()
    for r, n in zip(rows, samples, strict=True):
        by_op[opcode(r["Source"])] += n
        ex_op[opcode(r["Source"])] += _int(r.get(EXECUTED))
    executed = sum(ex_op.values())
    bar = next((i for i, r in enumerate(rows) if "BAR.SYNC" in r["Source"]), None)
    before_bar = f"{100 * sum(samples[: bar + 1]) / total:.1f}%" if bar is not None else "-"

    def pct(counter: Counter, whole: int, n: int = 8) -> str:
        return ", ".join(f"{k} {100 * v / whole:.1f}%" for k, v in counter.most_common(n) if v)

    lines = [f"{len(rows)} instructions, {sum(samples)} samples, {executed} executed",
             f"  stall reasons: {pct(by_reason, total)}",
             f"  samples by opcode: {pct(by_op, total, 10)}",
             f"  executed by opcode: {pct(ex_op, executed or 1, 10)}",
             f"  up to the first barrier (instruction {bar}): {before_bar} of samples" if bar is not None
             else "  no CTA barrier"]
    lines.append("  most samples (index, share, instruction, top reasons; the instruction before it):")
    for i in sorted(range(len(rows)), key=lambda i: -samples[i])[:top]:
        if not samples[i]:
            break
        why = sorted(((_int(rows[i].get("stall_" + k)), k) for k in by_reason), reverse=True)[:2]
        before = rows[i - 1]["Source"].strip() if i else ""
        lines.append(f"  {i:5d} {100 * samples[i] / total:5.1f}%  {rows[i]['Source'].strip()[:56]:56s} "
                     f"{', '.join(f'{k} {v}' for v, k in why if v)}  | {before[:40]}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=12, help="instructions listed by samples, per launch")
    ap.add_argument("--kernel", type=int, default=None, help="only the launch of this index (0: the first)")
    args = ap.parse_args()
    launches = read_launches(args.csv)
    if not launches:
        ap.error(f"{args.csv}: no launch table (a 'Kernel Name' line, then an 'Address' header)")
    if args.kernel is not None and not 0 <= args.kernel < len(launches):
        ap.error(f"--kernel {args.kernel}: the file holds {len(launches)} launches")
    for i, (name, rows) in enumerate(launches):
        if args.kernel in (None, i):
            print(f"launch {i} ({name}): " + "\n".join(summary(rows, args.top)))


if __name__ == "__main__":
    main()
