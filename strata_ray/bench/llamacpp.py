"""The Python half of scripts/compare_llamacpp.sh: llama.cpp's --n-cpu-moe for a VRAM budget, and the
side-by-side table of llama-bench's JSON and flashbench's JSON.

    python -m strata_ray.bench.llamacpp n-cpu-moe --model M.gguf --budget-mib 24576 [--reserve-mib 700]
    python -m strata_ray.bench.llamacpp compare --setup NAME --ours ours.json --llama prefill.json decode.json

`--n-cpu-moe N` keeps the routed experts of layers 0..N-1 in host memory. For a budget of M MiB, the dense
weights and the reserve come first, and N is the number of expert layers that do not fit in what is left:
the same budget our `--vram-budget-mib M` gives the expert cache (which spends it on the hottest experts of
every layer instead of on whole layers).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Sequence

MIB = 1024 * 1024
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.")


class CompareError(RuntimeError):
    """A missing or unreadable input of the comparison; one line."""


def expert_bytes_by_layer(file) -> dict[int, int]:
    """Bytes of routed-expert tensors per block (the MTP/nextn block included: llama.cpp loads it too)."""
    out: dict[int, int] = {}
    for name, info in file.tensors.items():
        m = EXPERT_TENSOR.match(name)
        if m:
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + info.n_bytes
    return out


def n_cpu_moe_for_budget(file, budget_mib: int, reserve_mib: int) -> int:
    """The smallest N such that the dense weights, the reserve and the experts of the layers >= N fit."""
    by_layer = expert_bytes_by_layer(file)
    total = sum(info.n_bytes for info in file.tensors.values())
    dense = total - sum(by_layer.values())
    free = budget_mib * MIB - reserve_mib * MIB - dense
    fit, used = 0, 0
    for layer in sorted(by_layer, reverse=True):  # llama.cpp offloads the first N layers' experts to the CPU
        if used + by_layer[layer] > free:
            break
        used += by_layer[layer]
        fit += 1
    return len(by_layer) - fit


# ---- reading both results --------------------------------------------------------------------------------


def _load_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CompareError(f"{path}: not found") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CompareError(f"{path}: not JSON ({type(e).__name__})") from None


def _tps(entry: dict) -> float:
    """llama-bench's tokens/s of one test: the median of its samples (flashbench reports medians)."""
    samples = entry.get("samples_ts") or []
    return float(statistics.median(samples)) if samples else float(entry.get("avg_ts", 0.0))


def read_llama_bench(paths: Sequence[str]) -> dict[str, dict[int, float]]:
    """{'prefill': {context: tok/s}, 'decode': {depth: tok/s}} from llama-bench -o json outputs (a missing
    file is skipped: a failed decode run still leaves the prefill numbers)."""
    out: dict[str, dict[int, float]] = {"prefill": {}, "decode": {}}
    errors = []
    for path in paths:
        try:
            entries = _load_json(path)
        except CompareError as e:
            errors.append(str(e))
            continue
        if not isinstance(entries, list):
            raise CompareError(f"{path}: not llama-bench JSON (expected a list of tests)")
        for e in entries:
            if e.get("n_prompt", 0) > 0 and e.get("n_gen", 0) == 0:
                out["prefill"][int(e["n_prompt"])] = _tps(e)
            elif e.get("n_gen", 0) > 0 and e.get("n_prompt", 0) == 0:
                out["decode"][int(e.get("n_depth", 0))] = _tps(e)
    if errors and len(errors) == len(paths):
        raise CompareError("; ".join(errors))
    return out


def read_ours(path: str) -> dict[str, dict[int, float]]:
    doc = _load_json(path)
    try:
        contexts = doc["results"]["contexts"]
    except (KeyError, TypeError):
        raise CompareError(f"{path}: not a flashbench report (no results.contexts)") from None
    return {
        "prefill": {int(c["context"]): float(c["prefill_tps"]) for c in contexts},
        # a decode not measurable (null, its reason in decode_note) is left out: the table shows n/a
        "decode": {int(c["context"]): float(c["decode_tps"]) for c in contexts
                   if c.get("decode_tps") is not None},
    }


# ---- the table -------------------------------------------------------------------------------------------


def _cell(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "n/a" if not ours or not theirs else f"{ours / theirs:.2f}x"


def side_by_side(setup: str, ours: dict | None, llama: dict | None, ours_failure: str | None = None) -> str:
    """A markdown table: per context, prefill and decode tok/s of both and ours/llama.cpp ratios."""
    contexts = sorted({c for src in (ours, llama) if src for part in src.values() for c in part})
    lines = [
        f"### {setup}",
        "",
        "| context | prefill ours | prefill llama.cpp | ratio | decode ours | decode llama.cpp | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in contexts:
        po = ours["prefill"].get(c) if ours else None
        pl = llama["prefill"].get(c) if llama else None
        do = ours["decode"].get(c) if ours else None
        dl = llama["decode"].get(c) if llama else None
        lines.append(f"| {c} | {_cell(po)} | {_cell(pl)} | {_ratio(po, pl)} | {_cell(do)} | {_cell(dl)} | "
                     f"{_ratio(do, dl)} |")
    if ours is None:
        lines += ["", f"ours: no result ({ours_failure or 'the bench did not run'})"]
    if llama is None:
        lines += ["", "llama.cpp: no result (llama-bench failed; see its output above)"]
    return "\n".join(lines)


def _last_line(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def _try(read, *args):
    try:
        return read(*args), None
    except CompareError as e:
        return None, str(e)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata_ray.bench.llamacpp")
    sub = parser.add_subparsers(dest="command", required=True)
    n = sub.add_parser("n-cpu-moe", help="print llama.cpp's --n-cpu-moe for a VRAM budget")
    n.add_argument("--model", required=True, help="the GGUF llama.cpp will load")
    n.add_argument("--budget-mib", type=int, required=True, help="the GPU memory llama.cpp may use, MiB")
    n.add_argument("--reserve-mib", type=int, default=700,
                   help="MiB of the budget kept for llama.cpp's buffers and KV cache (default 700)")
    c = sub.add_parser("compare", help="print flashbench and llama-bench results side by side")
    c.add_argument("--setup", required=True, help="the table's title (the setup both engines ran)")
    c.add_argument("--ours", required=True, help="our flashbench JSON report (run bench --json-out)")
    c.add_argument("--ours-log", help="our bench's output; its last line explains a missing result")
    c.add_argument("--llama", nargs="+", required=True,
                   help="llama-bench -o json outputs (a missing file is skipped)")
    ns = parser.parse_args(argv)
    if ns.command == "n-cpu-moe":
        from strata_ray.model.gguf_file import GGUFFile
        from strata_ray.model.hparams import ModelFormatError

        try:
            print(n_cpu_moe_for_budget(GGUFFile(ns.model), ns.budget_mib, ns.reserve_mib))
        except ModelFormatError as e:
            print(f"strata_ray llamacpp: {e}", file=sys.stderr)
            return 2
        return 0
    ours, ours_error = _try(read_ours, ns.ours)
    llama, _ = _try(read_llama_bench, ns.llama)
    print(side_by_side(ns.setup, ours, llama, _last_line(ns.ours_log) or ours_error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
