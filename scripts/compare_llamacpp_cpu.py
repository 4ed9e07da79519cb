"""Our engine vs llama.cpp (llama-cpp-python) on the CPU, same GGUF, same token ids, greedy.

    PYTHONPATH=. python scripts/compare_llamacpp_cpu.py [--model M.gguf] [--contexts 256,1024] [--gen 128]
        [--repeats 3] [--threads 2] [--ray] [--json-out r.json]

Per context and repeat, one prompt of exactly N tokens is built with `strata_ray.bench.prompts` (the bench's
corpus prompt; bench id = the repeat number, so both engines see the same ids and no prefix cache helps
across repeats). Both engines then run it the same way:
- prefill tok/s = N / (prompt forward until the first token's logits are ready);
- decode tok/s  = (G - 1) / (time of the G - 1 one-token forwards + greedy picks), i.e. decode at depth N.
No stop token ends a run (both run G tokens), so the rates count the same work. Tables: the best run of the
repeats (the estimate for a quiet machine: other processes only slow a run down) and the medians.
Ours: the in-process Engine (`--device cpu`, the same object `bench --local` uses) driven through the engine's
generate loop; with `--ray` also the Ray path (`strata:primary`, caller-side timing as `bench` takes it).
llama.cpp: `llama_cpp.Llama(n_threads=T, n_threads_batch=T, n_gpu_layers=0)`, n_batch = n_ubatch = 512 (our
prompt chunk), logits of the last position only.
Greedy agreement: positions where both picked the same id among the first G, and the common prefix.
Floor: bytes a decoded token reads (top-k experts x layers at their stored size + the dense matrices as each
engine holds them: ours float32, llama.cpp as stored; the embedding row and the MTP layer not counted) /
measured memcpy rate (numpy, one thread, counted read + write).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import numpy as np

from strata_ray.bench.prompts import PromptBuilder
from strata_ray.config import int_list
from strata_ray.engine.generate import generate
from strata_ray.engine.sampling import SamplingParams

LLAMA_BATCH = 512  # = strata's DEFAULT_PREFILL_CHUNK: both engines take the prompt in the same chunks
GREEDY = SamplingParams(temperature=0.0)


# ------------------------------------------------------------------------------------------------- prompts


def bench_prompts(engine, contexts: list[int], gen: int, repeats: int) -> dict[int, list[tuple[int, ...]]]:
    """{context: [ids of repeat r]}: the bench's corpus prompt with bench id r (exact length)."""
    add_bos = bool(engine.loaded.file.fields.get("tokenizer.ggml.add_bos_token", False))
    builder = PromptBuilder(engine.tokenizer, engine.loaded.hp.context_length, add_bos)
    out = {}
    for n in contexts:
        out[n] = [builder.bench_prompt(n, gen, bench_id=f"{r:016x}").ids for r in range(repeats)]
    return out


# --------------------------------------------------------------------------------------------- the engines


def run_ours(engine, ids: tuple[int, ...], gen: int) -> dict:
    result = generate(engine.loaded.model, ids, gen, GREEDY, stop_ids=())
    if engine.tiers is not None:
        engine.tiers.finish()  # as Engine.generate does after every request (closes the last window)
    return {"prompt_s": result.prompt_seconds, "decode_s": result.decode_seconds, "tokens": result.token_ids}


class LlamaCpp:
    def __init__(self, path: str, n_ctx: int, threads: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=path, n_ctx=n_ctx, n_batch=LLAMA_BATCH, n_ubatch=LLAMA_BATCH, n_threads=threads,
            n_threads_batch=threads, n_gpu_layers=0, logits_all=False, verbose=False, seed=0,
        )
        self.n_vocab = self.llm.n_vocab()

    def last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,))

    def run(self, ids: tuple[int, ...], gen: int) -> dict:
        llm = self.llm
        llm.reset()  # n_tokens = 0: eval() then clears the whole sequence (recurrent state included)
        t0 = time.perf_counter()
        llm.eval(list(ids))
        tokens = [int(np.argmax(self.last_logits()))]
        t1 = time.perf_counter()
        while len(tokens) < gen:
            llm.eval(tokens[-1:])
            tokens.append(int(np.argmax(self.last_logits())))
        return {"prompt_s": t1 - t0, "decode_s": time.perf_counter() - t1, "tokens": tokens}

    def close(self) -> None:
        self.llm.close()


def run_ray(path: str, prompts: dict[int, list[tuple[int, ...]]], gen: int) -> dict[int, list[dict]]:
    """The Ray path as `bench` drives it (actors placed and loaded as `run` does); caller-side timing."""
    from strata_ray.bench.measure import RayRunner
    from strata_ray.bench.prompts import Prompt
    from strata_ray.bench.targets import ray_target
    from strata_ray.config import EngineConfig

    out: dict[int, list[dict]] = {}
    with ray_target(EngineConfig(model=path, device="cpu"), None, False, False) as target:
        runner: RayRunner = target.runner
        runner.run(Prompt("warmup", "", prompts[min(prompts)][0], 0), 8, GREEDY)
        for n, runs in prompts.items():
            out[n] = []
            for ids in runs:
                t = runner.run(Prompt(f"ctx{n}", "", ids, len(ids)), gen, GREEDY)
                out[n].append({"prompt_s": t.ttft_s, "decode_s": t.decode_s, "decode_tokens": t.decode_tokens,
                               "generated": t.generated_tokens})
    return out


# ------------------------------------------------------------------------------------------ bytes and floor


def memcpy_gbps(mib: int = 1024, repeats: int = 5) -> float:
    """Best numpy copy rate over a big array, GB/s counted read + write (one thread)."""
    src = np.ones(mib << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def bytes_per_token(file) -> dict[str, float]:
    """Weight bytes one decoded token reads, per engine (see the module docstring)."""
    hp = file.hparams
    experts = dense_stored = dense_f32 = 0
    for name, t in file.tensors.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        if layer is not None and layer >= hp.n_layer:
            continue  # MTP (nextn) layer: not run when decoding without drafts
        if "_exps." in name:
            experts += t.n_bytes / hp.n_expert * hp.n_expert_used  # [X, ...]: top-k of the X experts
        elif name == "token_embd.weight":
            if "output.weight" not in file.tensors:  # tied: the head reads all of it
                dense_stored += t.n_bytes
                dense_f32 += 4 * int(np.prod(t.shape))
        else:
            dense_stored += t.n_bytes
            dense_f32 += 4 * int(np.prod(t.shape))
    return {"experts": experts, "ours": experts + dense_f32, "llama.cpp": experts + dense_stored}


# ----------------------------------------------------------------------------------------------- the table


def rates(runs: list[dict], n_prompt: int) -> dict[str, tuple[float, float]]:
    """{"median": (prefill, decode), "best": (prefill, decode)} tok/s of runs. On a shared machine a run that
    another process slowed only ever loses speed: the best run is the estimate for a quiet machine."""
    pre = [n_prompt / r["prompt_s"] for r in runs]
    # ours / llama.cpp: G - 1 timed forwards; Ray: tokens seen after the first arrival
    dec = [r.get("decode_tokens", len(r.get("tokens", ())) - 1) / r["decode_s"] for r in runs]
    return {"median": (statistics.median(pre), statistics.median(dec)), "best": (max(pre), max(dec))}


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(positions with the same id, length of the common prefix)."""
    same = sum(x == y for x, y in zip(a, b, strict=False))
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return same, prefix


def table(doc: dict, stat: str) -> str:
    gen = doc["gen"]
    has_ray = any("ray" in row for row in doc["rows"])
    head = "| context | llama.cpp prefill | ours prefill | ratio | llama.cpp decode | ours decode | ratio |"
    sep = "|---:|---:|---:|---:|---:|---:|---:|"
    if has_ray:
        head += " ours via Ray prefill / decode |"
        sep += "---:|"
    head += f" greedy ids same (of {gen}) / common prefix |"
    sep += "---:|"
    lines = [head, sep]
    for row in doc["rows"]:
        lp, ld = row["llama.cpp"][stat]
        op, od = row["ours"][stat]
        cells = [f"{row['context']}", f"{lp:.0f}", f"{op:.0f}", f"{op / lp:.2f}", f"{ld:.1f}", f"{od:.1f}",
                 f"{od / ld:.2f}"]
        if has_ray:
            rp, rd = row["ray"][stat]
            cells.append(f"{rp:.0f} / {rd:.1f}")
        cells.append(f"{row['greedy_same']} / {row['greedy_prefix']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def floor_lines(doc: dict) -> str:
    bw, b = doc["memcpy_gbps"], doc["bytes_per_token"]
    out = [f"memcpy (numpy, 1 thread, read + write): {bw:.1f} GB/s; weight bytes per decoded token: experts "
           f"{b['experts'] / 1e6:.2f} MB, ours {b['ours'] / 1e6:.2f} MB (dense float32), llama.cpp "
           f"{b['llama.cpp'] / 1e6:.2f} MB (dense as stored)"]
    for row in doc["rows"]:
        parts = []
        for eng in ("llama.cpp", "ours"):
            floor = bw * 1e9 / b[eng]  # tok/s if the weights streamed at memcpy rate
            parts.append(f"{eng} floor {floor:.0f} tok/s, best run reached {row[eng]['best'][1] / floor:.1%}")
        out.append(f"ctx {row['context']}: " + "; ".join(parts))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded model)")
    ap.add_argument("--contexts", default="256,1024", type=int_list(1),
                    help="prompt lengths in tokens, a list")
    ap.add_argument("--gen", type=int, default=128, help="tokens generated at each context")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each context (the best and the medians "
                    "reported)")
    ap.add_argument("--threads", type=int, default=2,
                    help="llama.cpp and torch threads (our expert pool: one per core this process may use)")
    ap.add_argument("--ray", action="store_true", help="also measure our Ray path (strata:primary)")
    ap.add_argument("--json-out", default=None, help="also write the results as JSON here")
    ns = ap.parse_args(argv)
    contexts = list(ns.contexts)
    if importlib.util.find_spec("llama_cpp") is None:
        say("llama-cpp-python is not installed here (pip install llama-cpp-python; .ci/run builds it)")
        return 2

    import torch

    from strata_ray.config import EngineConfig
    from strata_ray.engine.engine import Engine

    torch.set_num_threads(ns.threads)  # the same thread count for both engines' dense math
    engine = Engine(EngineConfig(model=ns.model, device="cpu"), progress=False)
    path = str(engine.loaded.path)
    prompts = bench_prompts(engine, contexts, ns.gen, ns.repeats)
    say(f"{os.path.basename(path)}: torch threads {torch.get_num_threads()}, llama.cpp threads {ns.threads}")
    run_ours(engine, prompts[contexts[0]][0][:64], 8)  # warm-up (numba compiles, allocator)
    llama = LlamaCpp(path, max(contexts) + ns.gen + 16, ns.threads)
    llama.run(prompts[contexts[0]][0][:64], 8)

    rows = []
    for n in contexts:
        ours_runs, llama_runs = [], []
        for ids in prompts[n]:  # alternate engines so drifting machine load hits both alike
            llama_runs.append(llama.run(ids, ns.gen))
            ours_runs.append(run_ours(engine, ids, ns.gen))
        same, prefix = agreement(ours_runs[0]["tokens"], llama_runs[0]["tokens"])
        rows.append({"context": n, "ours": rates(ours_runs, n), "llama.cpp": rates(llama_runs, n),
                     "greedy_same": same, "greedy_prefix": prefix,
                     "runs": {"ours": strip(ours_runs), "llama.cpp": strip(llama_runs)}})
        say(f"ctx {n}: ours {rows[-1]['ours']['best']}, llama.cpp {rows[-1]['llama.cpp']['best']} (best), "
            f"greedy same {same}")
    llama.close()
    if ns.ray:
        for row, (n, runs) in zip(rows, run_ray(path, prompts, ns.gen).items(), strict=True):
            row["ray"] = rates(runs, n)
            row["runs"]["ray"] = runs
    doc = {"model": path, "file_bytes": os.path.getsize(path), "gen": ns.gen, "repeats": ns.repeats,
           "threads": ns.threads, "torch_threads": torch.get_num_threads(), "rows": rows,
           "bytes_per_token": bytes_per_token(engine.loaded.file), "memcpy_gbps": memcpy_gbps()}
    for stat in ("best", "median"):
        print(f"model: {os.path.basename(path)} ({doc['file_bytes'] / 1e6:.1f} MB), G = {ns.gen}, "
              f"{stat} of {ns.repeats} runs; ratio = ours / llama.cpp; tok/s\n")
        print(table(doc, stat) + "\n")
    print(floor_lines(doc))
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def strip(runs: list[dict]) -> list[dict]:
    return [{"prompt_s": r["prompt_s"], "decode_s": r["decode_s"], "tokens": list(r["tokens"])} for r in runs]


def say(line: str) -> None:
    sys.stderr.write(f"compare: {line}\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
