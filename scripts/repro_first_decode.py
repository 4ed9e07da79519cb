"""Is the first decode after a load bit-reproducible? A hunt script for the CUDA tiers (sessions 55-56).

On an H100, tests/experts/test_tiered_gpu.py::test_prompt_logprobs_leave_the_generation_alone_on_cuda
failed 2 runs in 6: the first `generate` after `load_tiered_model` gave the same ids but token logprobs
1e-5-3e-5 off from its second token on, while every later generate of the same load agreed with passing
runs. This script repeats that case, without pytest or the CPU half, so one device call can try many loads
under many knobs:

    # on the GPU machine, a fresh process a run (the flake may need a cold process); --tag names the variant
    STRATA_PDL=0 python scripts/repro_first_decode.py --tag pdl0 --loads 3 >> runs.jsonl
    # anywhere: which loads' first generate left the bits every other generate agrees on
    python scripts/repro_first_decode.py --analyze runs.jsonl

Each load: the tiny Qwen3-Next synth with Q4_0 experts (written once to --model), `--cache` device slots
(10: most experts miss, so the CPU worker, the PCIe share and the adaptive rounds all run), three generates
of a 600-token prompt (layer 3's KV cache grows in the first decode step) and 10 tokens with logprobs; one
JSON line of ids and logprob bits per load. --fill makes torch fill every new allocation with NaN (a read
of memory nothing wrote then shows in every run); --poison-kv fills a grown KV cache's rows past its length
with 3e4 (a read of a row before its append then moves the logprobs by far more than 1e-5).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

PROMPT = [3 + i % 200 for i in range(600)]  # the test's: > 512 rows, a KV cache grown by the first decode
DECODE = 10


def poison_grown_kv() -> None:
    """KVCache.reserve fills the rows past the length of a buffer it grows with 3e4 (finite: a masked read
    adds exact zeros; an unmasked read of an unwritten row is off by far more than any rounding)."""
    from strata_ray.model import state

    plain = state.KVCache.reserve

    def reserve(self, need, like):
        before = None if self._k is None else self._k.shape[0]
        at = plain(self, need, like)
        if self._k.shape[0] != before:
            self._k[self.length:].fill_(3e4)
            self._v[self.length:].fill_(3e4)
        return at

    state.KVCache.reserve = reserve


def run(args) -> None:
    import torch

    from strata_ray.config import EngineConfig
    from strata_ray.engine.generate import generate
    from strata_ray.engine.prefill import prefill_chunk
    from strata_ray.experts.build import load_tiered_model
    from strata_ray.model.synth import write_synth

    if not os.path.exists(args.model):  # written whole or not at all (the GGUF writer renames it in)
        os.makedirs(os.path.dirname(os.path.abspath(args.model)), exist_ok=True)
        write_synth(args.model, arch="qwen3next", preset="tiny", expert_type="Q4_0", progress=False)
    if args.fill:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    if args.poison_kv:
        poison_grown_kv()
    cfg = EngineConfig(model=args.model, device=args.device, expert_cache=args.cache,
                       adapt_every=args.adapt_every)
    for load in range(args.loads):
        t0 = time.perf_counter()
        loaded, tiers = load_tiered_model(cfg, args.device, progress=False)
        chunk = prefill_chunk(cfg, args.device)
        outs = []
        with torch.inference_mode():
            for _ in range(args.generates):
                r = generate(loaded.model, PROMPT, DECODE, logprobs=2, prefill_chunk=chunk)
                outs.append([r.token_ids, [float(x).hex() for x in r.token_logprobs]])
        share = None if tiers is None else [tiers.pcie_share, getattr(tiers, "host_gbs", None)]
        if tiers is not None:
            tiers.finish()
        print(json.dumps({"tag": args.tag, "load": load, "secs": round(time.perf_counter() - t0, 1),
                          "share": share, "outs": outs}), flush=True)


def analyze(path: str) -> None:
    """Per tag: loads, and how many had a generate off the bits that most later generates agree on (first:
    the load's first generate; later: any other)."""
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    if not rows:
        sys.exit(f"error: {path} holds no runs")
    later = collections.Counter(json.dumps(o) for r in rows for o in r["outs"][1:])
    (good_text, n_good), *others = later.most_common()
    good = json.loads(good_text)
    print(f"{len(rows)} loads; the later generates' bits: {n_good} agree, {sum(n for _, n in others)} not")
    by_tag: dict[str, list[str]] = collections.defaultdict(list)
    for r in rows:
        by_tag[r["tag"]].append("".join("." if o == good else ("i" if o[0] != good[0] else "x")
                                        for o in r["outs"]))
    for tag, marks in by_tag.items():
        first = sum(m[0] != "." for m in marks)
        rest = sum(any(c != "." for c in m[1:]) for m in marks)
        print(f"{tag:10s} loads {len(marks):3d}  first off {first:3d}  later off {rest:3d} ", *marks)
    for r in rows:
        for i, (ids, bits) in enumerate(r["outs"]):
            if [ids, bits] != good and ids == good[0]:
                diffs = [abs(float.fromhex(a) - float.fromhex(b)) for a, b in zip(bits, good[1], strict=True)]
                step = next(j for j, d in enumerate(diffs) if d)
                print(f"  {r['tag']} load {r['load']} generate {i}: from token {step}, max |d logprob| "
                      f"{max(diffs):.2e}, share {r.get('share')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--analyze", metavar="JSONL", help="summarise runs written by this script, run nothing")
    ap.add_argument("--tag", default="run", help="the variant's name in the JSON lines")
    ap.add_argument("--model", default="/tmp/strata-repro/tiny-q4.gguf",
                    help="the synth model's path (written if missing)")
    ap.add_argument("--device", default="cuda", help="cuda (the case), or cpu (the script's own check)")
    ap.add_argument("--loads", type=int, default=3, help="loads in this process")
    ap.add_argument("--generates", type=int, default=3, help="identical generates a load")
    ap.add_argument("--cache", type=int, default=10, help="device expert slots")
    ap.add_argument("--adapt-every", type=int, default=4, help="windows between adaptive rounds (0: off)")
    ap.add_argument("--fill", action="store_true", help="torch fills new allocations with NaN")
    ap.add_argument("--poison-kv", action="store_true", help="a grown KV cache's new rows hold 3e4")
    args = ap.parse_args()
    if args.analyze:
        analyze(args.analyze)
        return
    if args.loads < 1 or args.generates < 2:
        ap.error("--loads must be >= 1 and --generates >= 2 (the first is compared with the later ones)")
    run(args)


if __name__ == "__main__":
    main()
