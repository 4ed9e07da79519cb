"""Expert-tier benchmark (GPU machine, a script, not a test): decode tok/s at 1K and 8K depth with the
primary cache sized as on a smaller card, hit rates, CPU-pool time, host overhead per token, and the
placement roofline (GPU expert bytes / HBM bandwidth vs CPU expert bytes / host bandwidth): once with the
H200 machine's measured rates below (of_roofline: every session's runs compare by it), once with this
machine's, measured before the decode (of_roofline_here; --hbm-gbs / --host-gbs give them instead).

    python scripts/bench_tiers.py --model /tmp/m.gguf [--layers 12] [--card-gib 24] [--decode 32]

Without --model it writes a synthetic qwen3next 80b-a3b (Q4_0 experts) with --layers trunk layers to
/tmp. A sample of L of the 48 layers emulates the full model on a --card-gib card: the cache gets the
share of expert bytes the full model would get on that card (card - reserve - fp32 dense weights),
applied to the sample's expert bytes.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import logging
import os
import pstats
import time
from types import SimpleNamespace

import numpy as np
import torch
from bandwidth import device_copy_gbs, host_copy_gbs  # a sibling module (scripts/ is sys.path[0] when run)

from strata_ray.config import (
    ConfigError,
    EngineConfig,
    build_arg_parser,
    config_from_args,
    float_arg,
    int_list,
)
from strata_ray.engine.prefill import chunk_bytes
from strata_ray.engine.sampling import Sampler, SamplingParams
from strata_ray.experts.build import build_expert_backend, precompiling
from strata_ray.experts.layer_clock import LayerClock
from strata_ray.experts.profile import ProfileError
from strata_ray.kernels.cpu_pool import CpuPool
from strata_ray.kernels.cpu_token_rows import PHASES, cycles_per_second, phases_of
from strata_ray.model.decode_graph import decode_chain
from strata_ray.model.forward import Model
from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.synth import write_synth
from strata_ray.model.weights import keeps_q8, load_dense_weights

FULL_LAYERS = 48
HBM_GBS = 4250.0  # measured device copy bandwidth on the H200 (GPU-MACHINE.md)
HOST_GBS = 61.0  # measured 16-core host memory copy bandwidth on the H200 machine


def dense_split(file, quantized: bool = False) -> tuple[int, int, int]:
    """(device bytes of the non-layer dense tensors, dense bytes per trunk layer, expert bytes): fp32, or
    with `quantized` the file's bytes for the Q8_0 matrices the engine keeps as they are (dense_q8)."""
    glob, per_layer, experts = 0, 0, 0
    n_layer = file.hparams.n_layer
    for name, t in file.tensors.items():
        size = t.n_bytes if quantized and keeps_q8(name, t) else 4 * int(np.prod(t.shape))
        if name.endswith("_exps.weight"):
            experts += t.n_bytes if int(name.split(".")[1]) < n_layer else 0
        elif name.startswith("blk."):
            per_layer += size if int(name.split(".")[1]) < n_layer else 0
        else:
            glob += size
    return glob, per_layer // n_layer, experts


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profiled(label: str, work, row_limit: int, trace_out: str | None = None):
    """work() under torch.profiler (CPU + CUDA): prints the op tables by device and host time, writes a
    Chrome trace to trace_out when given; returns work()'s result."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        result = work()
        sync()
    for key in ("self_cuda_time_total", "self_cpu_time_total"):
        if key == "self_cuda_time_total" and not torch.cuda.is_available():
            continue
        print(f"{label} under the profiler, by {key}:", flush=True)
        table = prof.key_averages().table(sort_by=key, row_limit=row_limit, max_name_column_width=60)
        print(table, flush=True)
    if trace_out:
        prof.export_chrome_trace(trace_out)
    return result


def _prefill(model, prompt, state, chunk: int, trace: bool):
    """The prompt in chunks; trace: under torch.profiler, printing where the time went."""
    if trace:
        def chunks():
            return _prefill(model, prompt, state, chunk, False)

        return _profiled(f"prefill of {len(prompt)} tokens", chunks, row_limit=20)
    for c in range(0, len(prompt), chunk):
        logits = model.forward(prompt[c : c + chunk], state)
    return logits


def _trace_decode(model, tok: int, state, n_tokens: int, trace_out: str | None, sampler: Sampler) -> int:
    """n_tokens more decode steps under torch.profiler: the op tables, and a Chrome trace (`trace_out`) that
    shows where a token's time goes between the device and the host."""
    def steps(tok=tok):
        return _decode(model, tok, state, n_tokens, sampler)

    return _profiled(f"decode of {n_tokens} tokens", steps, row_limit=25, trace_out=trace_out)


def _decode(model, tok: int, state, n_tokens: int, sampler: Sampler) -> int:
    """n_tokens decode steps after `tok` drawn by `sampler` (greedy at temperature 0): chained where the
    decode graphs chain, else one token at a time; returns the last token."""
    graphs = model.decode_graphs
    if getattr(graphs, "chain", False):  # STRATA_DECODE_CHAIN=1; sampled: the draws made on the device
        choose = sampler.choose_into if sampler.params.temperature > 0 else None
        return list(decode_chain(graphs, tok, state, n_tokens, choose))[-1]
    for _ in range(n_tokens):
        tok = sampler.sample(model.forward([tok], state)[-1])
    return tok


def _layer_times(clock: LayerClock, depth: int, kind_of=None) -> dict:
    """Print and return the prefill's per-layer split (LayerClock): experts, dense part, host in the call, and
    the named phases' mean ms a call by layer kind (kind_of(layer), e.g. "gdn" / "attention")."""
    s = clock.summary()
    calls = s.pop("calls")
    kind = "device" if clock.cuda else "host"
    print(f"depth {depth}: prefill layer times over {len(calls)} expert calls (ms a call, {kind} clock): "
          f"experts {s['experts_ms_mean']:.2f}, dense before them {s['dense_ms_mean']:.2f}, host inside the "
          f"call {s['host_ms_mean']:.2f}", flush=True)
    for c in sorted(calls, key=lambda c: -c["experts"])[:3]:
        print(f"  slowest: layer {c['layer']} experts {c['experts']:.2f} ms, host {c['host']:.2f} ms",
              flush=True)
    phases: dict[str, dict[str, list[float]]] = {}  # kind -> phase -> ms per call
    for c in calls:
        if c["dense"] is None:  # a forward's first layer: its dense part has no mark before it
            continue
        group = phases.setdefault(kind_of(c["layer"]) if kind_of else "all", {})
        for name, ms in c["phases"].items():
            group.setdefault(name, []).append(ms)
    out = {f"prefill_{k}": round(v, 3) for k, v in s.items()}
    for group, by_name in sorted(phases.items()):
        means = {name: sum(v) / len(v) for name, v in by_name.items()}
        n = max(len(v) for v in by_name.values())
        print(f"  {group} layers ({n} calls), ms a call: "
              + ", ".join(f"{name} {ms:.2f}" for name, ms in means.items()), flush=True)
        out[f"prefill_phases_{group}"] = {name: round(ms, 3) for name, ms in means.items()}
    return out


def run_depth(loaded, tiers, depth: int, n_decode: int, chunk: int = 1024, profile: bool = False,
              prompt_seed: int = 0,
              temperature: float = 0.0,
              trace_prefill: bool = False, trace_decode: int = 0, trace_out: str | None = None,
              layer_times: bool = False, team_sizes: list[int] | None = None) -> dict:
    model = loaded.model
    rng = np.random.default_rng([depth, prompt_seed] if prompt_seed else depth)  # 0: the prompts before
    prompt = rng.integers(10, loaded.hp.n_vocab - 10, depth).tolist()
    tiers.metrics.counts = type(tiers.metrics.counts)()
    clock = LayerClock(tiers.device) if layer_times else None
    with torch.inference_mode():
        state = model.new_state()
        tiers.clock = clock
        t0 = time.perf_counter()
        logits = _prefill(model, prompt, state, chunk, trace_prefill)
        sync()
        prefill_s = time.perf_counter() - t0
        tiers.clock = None
        print(f"depth {depth}: prefill {prefill_s:.1f} s", flush=True)

        def kind_of(layer: int) -> str:
            return "gdn" if loaded.hp.is_recurrent(layer) else "attention"

        split = _layer_times(clock, depth, kind_of) if clock is not None else {}
        tok = int(logits[-1].argmax())
        for _ in range(3):  # warm-up steps (kernel autotune, CPU pool threads)
            tok = int(model.forward([tok], state)[-1].argmax())
        tiers.metrics.counts = type(tiers.metrics.counts)()
        sync()
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        rows = getattr(model.decode_graphs, "rows", None) if model.decode_graphs is not None else None
        gap0 = np.array(getattr(rows, "gap_parts", [0.0] * 4))
        idle0 = getattr(rows, "device_idle", 0.0)
        sampler = Sampler(SamplingParams(temperature=temperature, seed=0))  # 0: greedy
        with _RowsByEntries(model) as by_entries:
            tok = _decode(model, tok, state, n_decode, sampler)
            decode_s = time.perf_counter() - t0
            # the pipelined decode's gap between tokens, by part (ms a token): finish after the join, the
            # caller until the next token_begin, token_begin, the launches
            gap = (np.array(getattr(rows, "gap_parts", [0.0] * 4)) - gap0) * 1e3 / max(1, n_decode)
            idle = (getattr(rows, "device_idle", 0.0) - idle0) * 1e3 / max(1, n_decode)
            tiers.finish()  # the last tokens joined inside: their outputs counted
        if prof:
            prof.disable()
            print(f"decode profile at depth {depth} ({n_decode} tokens), by own time:", flush=True)
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
            print(f"decode profile at depth {depth}, by cumulative time:", flush=True)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        timed = dataclasses.replace(tiers.metrics.counts)
        team = _team_sweep(model, tiers, tok, state, n_decode, team_sizes) if team_sizes else []
        tok = team[-1].pop("tok") if team else tok
        tiers.metrics.counts = timed
        if trace_decode:  # after the timed steps, and out of their counts: the profiler slows them
            _trace_decode(model, tok, state, trace_decode, trace_out, sampler)
            tiers.metrics.counts = timed
    tiers.finish()
    s = tiers.metrics.summary()
    out = {"depth": depth, "prefill_tok_s": depth / prefill_s, "decode_tok_s": n_decode / decode_s,
           "temperature": temperature, **s, **split}
    if gap.any():
        out["gap_parts_ms"] = dict(zip(("finish", "caller", "begin", "launch"), gap.round(3).tolist(),
                                       strict=True))
        out["gap_parts_ms"]["device_idle"] = round(idle, 3)
    if team_sizes:
        out["team_sweep"] = team
    if by_entries.counts.any():
        out["cpu_rows_us_by_entries"] = by_entries.summary()
        print("CPU rows a layer by its CPU entries (the worker's own time; layers):",
              ", ".join(f"{m}: {us:.0f} us ({n})" for m, (us, n) in out["cpu_rows_us_by_entries"].items()),
              flush=True)
        out["cpu_rows_phases_us_by_entries"] = by_entries.phase_summary()
        for m, parts in out["cpu_rows_phases_us_by_entries"].items():
            print(f"  {m} entries, the team's steps (us): "
                  + ", ".join(f"{name} {u}" for name, u in parts.items()), flush=True)
    return out


def _pipelined_worker(model):
    """The pipelined decode's CPU worker (kernels/cpu_token_rows.CpuTokenRows), or None without one (no
    decode graphs, or their rows are not the pipelined form)."""
    rows = getattr(model.decode_graphs, "rows", None) if model.decode_graphs is not None else None
    return getattr(rows, "worker", None)


class _RowsByEntries:
    """The pipelined decode's CPU rows a layer by how many CPU entries the layer had: the worker's busy
    cycles, its team's steps and entry counts of every joined token (PipelinedDecodeRows.on_worker_outputs,
    chained or not), summed by entry count. Separates the rows' fixed cost a layer from their cost an entry
    in the engine itself (bench_token_rows.py measures them without the GPU's PCIe reads beside them)."""

    def __init__(self, model):
        worker = _pipelined_worker(model)
        self.rows = None if worker is None else model.decode_graphs.rows  # None: nothing is ever counted
        k = 0 if worker is None else worker.k
        self.counts = np.zeros(k + 1, np.int64)
        self.cycles = np.zeros(k + 1, np.float64)
        self.phases = np.zeros((k + 1, len(PHASES)), np.float64)  # the team's steps' cycles, summed

    def __enter__(self) -> _RowsByEntries:
        if self.rows is not None:
            self.rows.on_worker_outputs = self.token
        return self

    def __exit__(self, *exc) -> None:
        if self.rows is not None:
            self.rows.on_worker_outputs = None

    def token(self, out) -> None:
        m = out.n_miss
        self.counts += np.bincount(m, minlength=self.counts.size)
        self.cycles += np.bincount(m, weights=out.busy, minlength=self.counts.size)
        np.add.at(self.phases, m, phases_of(out.stamps))

    def summary(self) -> dict[int, tuple[float, int]]:
        """{CPU entries: (mean us a layer, layers)} for the entry counts seen."""
        rate = cycles_per_second() or 1.0
        return {int(m): (float(self.cycles[m] / self.counts[m] / rate * 1e6), int(self.counts[m]))
                for m in np.flatnonzero(self.counts)}

    def phase_summary(self) -> dict[int, dict[str, float]]:
        """{CPU entries: {team step: mean us a layer}} (kernels/cpu_token_rows.PHASES) for the entry counts
        seen with a team (the two-region form stamps nothing)."""
        if not self.phases.any():
            return {}
        rate = cycles_per_second() or 1.0
        return {int(m): {name: round(float(u), 1) for name, u in
                         zip(PHASES, self.phases[m] / self.counts[m] / rate * 1e6, strict=True)}
                for m in np.flatnonzero(self.counts)}


def _team_sweep(model, tiers, tok: int, state, n_decode: int, sizes: list[int]) -> list[dict]:
    """The same decode again with the pipelined decode's CPU team at each size: tok/s and the CPU rows' ms a
    token, in one process (one load, one host). The adaptive cache keeps learning from round to round (its
    hit rate rises on a skewed model), so list the sizes interleaved and repeated. The last entry keeps
    "tok"."""
    worker = _pipelined_worker(model)
    if worker is None:
        raise SystemExit("--team-sizes needs the pipelined decode (a CUDA device, decode graphs)")
    first, out = worker.n_threads, []
    for n in sizes:
        worker.n_threads = n
        tiers.metrics.counts = type(tiers.metrics.counts)()
        sync()
        t0 = time.perf_counter()
        for _ in range(n_decode):
            tok = int(model.forward([tok], state)[-1].argmax())
        dt = time.perf_counter() - t0
        tiers.finish()
        s = tiers.metrics.summary()
        out.append({"team": n, "decode_tok_s": n_decode / dt, "cpu_ms_per_token": s["cpu_ms_per_token"],
                    "cpu_entries": s["cpu_entries"], "wait_ms_per_token": s["wait_ms_per_token"]})
        print(f"team {n}: {n_decode / dt:.1f} tok/s, CPU rows {s['cpu_ms_per_token']:.2f} ms a token "
              f"({s['cpu_entries'] / max(1, s['tokens']) / tiers.n_layers:.2f} entries a layer)", flush=True)
    worker.n_threads = first
    out[-1]["tok"] = tok
    return out


def _env_config() -> EngineConfig:
    """The engine's reading of the STRATA_* environment (config.config_from_args with no flags): a value the
    engine would refuse ends the run with its one line, where a loose reading here once took anything but
    "0" for on."""
    try:
        return config_from_args(build_arg_parser().parse_args([]), os.environ)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def _set_sched(kind: str) -> None:
    """The primary context's scheduling flag (cuDevicePrimaryCtxSetFlags), before torch makes the context:
    spin (the host thread spins while it waits for the device), yield, or blocking (it sleeps)."""
    import ctypes

    flags = {"spin": 1, "yield": 2, "blocking": 4}[kind]  # CU_CTX_SCHED_SPIN / _YIELD / _BLOCKING_SYNC
    lib = ctypes.CDLL("libcuda.so.1")
    if lib.cuInit(0) != 0 or lib.cuDevicePrimaryCtxSetFlags_v2(0, flags) != 0:
        raise SystemExit(f"--sched {kind}: the driver refused cuDevicePrimaryCtxSetFlags")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: a synth of --preset with --layers "
                    "layers, made once in /tmp)")
    ap.add_argument("--layers", type=int, default=12, help="layers of the default synth model")
    ap.add_argument("--card-gib", type=float_arg(0.0, 1e6, lo_open=True), default=24.0,
                    help="the GPU budget emulated, GiB (the issue's 24 GB card)")
    ap.add_argument("--decode", type=int, default=32, help="greedy tokens decoded at each depth")
    ap.add_argument("--depths", default="1024,8192", type=int_list(1),
                    help="prompt depths, a list: a prefill and a decode each")
    ap.add_argument("--json-out", default=None, help="also write the results as JSON here")
    ap.add_argument("--preset", default="80b-a3b", help="synth preset (small: a CPU dry run)")
    ap.add_argument("--pin-gib", type=float_arg(0.0, 1e6), default=None,
                    help="GiB of expert layers in pinned memory (default: the engine's, as much as the "
                         "host's memory allows; 0: none)")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="CPU pool threads (default: the engine's, every core but one on CUDA)")
    ap.add_argument("--cpu-driver", choices=["numba", "pool"], default="numba",
                    help="numba: one parallel numba call per expert call; pool: a Python thread per share")
    ap.add_argument("--trace-prefill", type=int, default=None, metavar="DEPTH",
                    help="run this depth's prefill under torch.profiler and print the op table")
    ap.add_argument("--trace-decode", type=int, default=0, metavar="N",
                    help="after the first depth's timed decode, N more tokens under torch.profiler")
    ap.add_argument("--trace-out", default=None, help="with --trace-decode: write a Chrome trace here")
    ap.add_argument("--ring-overlap", choices=["0", "1"], default="1",
                    help="1 (default): prompt ring copies overlap its kernels; 0: on the compute stream")
    ap.add_argument("--decode-cpu-thread", choices=["0", "1"], default=None,
                    help="1: a decode layer's CPU rows on a helper thread behind a device flag; 0: on the "
                    "host thread (default: the engine's, STRATA_DECODE_CPU_THREAD)")
    ap.add_argument("--decode-pipeline", choices=["0", "1"], default=None,
                    help="1: the whole decode token enqueued at once, a numba worker serving every layer's "
                    "CPU rows (default: STRATA_DECODE_PIPELINE, on)")
    ap.add_argument("--dense-q8", choices=["0", "1"], default=None,
                    help="1: dense Q8_0 matrices stay Q8_0 on CUDA; 0: float32 (default: STRATA_DENSE_Q8, 1)")
    ap.add_argument("--fused-decode", choices=["0", "1"], default=None,
                    help="1: fused Triton kernels in decode on CUDA (GDN core, norms, combine, attention); "
                    "0: the torch ops (default: STRATA_FUSED_DECODE, 1)")
    ap.add_argument("--gather-copy", choices=["0", "1"], default=None,
                    help="1: the prompt path's pinned expert copies as one gather kernel a batch; 0: three "
                    "copies an expert (default: STRATA_GATHER_COPY, 1)")
    ap.add_argument("--swiglu-fold", choices=["0", "1"], default=None,
                    help="1: one-entry decode tiles make the SwiGLU's codes in the CUDA C down launch; "
                    "0: the SwiGLU kernel between the launches (default: expert_words.WORDS['cuda_swiglu'], "
                    "1)")
    ap.add_argument("--layer-times", action="store_true",
                    help="time each layer's expert call and the dense part before it during prefill (events)")
    ap.add_argument("--no-graphs", action="store_true", help="one-token forwards without CUDA graphs")
    ap.add_argument("--adapt-every", type=int, default=None, metavar="N",
                    help="adaptive rounds every N windows (0: none; default: the engine's); each round's "
                         "swap copies share PCIe with the decode's own copies")
    ap.add_argument("--profile", action="store_true", help="cProfile the first depth's decode")
    ap.add_argument("--team-sizes", default=None, metavar="N,N,...", type=int_list(1),
                    help="after the first depth's timed decode, the same decode again with the pipelined "
                    "decode's CPU team at each of these sizes (threads), in this order")
    ap.add_argument("--sched", choices=["auto", "spin", "yield", "blocking"], default="auto",
                    help="how the host thread waits for the device (the CUDA context's scheduling flag)")
    ap.add_argument("--chunk", type=int, default=1024, help="prompt chunk (each chunk streams every "
                    "non-resident expert once)")
    ap.add_argument("--expert-profile", default=None, metavar="P.strp",
                    help="fill the cache in this profile's order (the engine's --expert-profile)")
    ap.add_argument("--save-expert-profile", default=None, metavar="P.strp",
                    help="after the last depth, save the learned profile here (the engine's "
                    "--expert-profile-save: resident pairs first, then heat)")
    ap.add_argument("--prompt-seed", type=int, default=0,
                    help="another random prompt at each depth (0: the one every run used before)")
    ap.add_argument("--hbm-gbs", type=float_arg(0.0, 1e6, lo_open=True), default=None,
                    help="this machine's device copy rate for the roofline here, GB/s (default: measured, "
                         "a 1 GiB copy)")
    ap.add_argument("--host-gbs", type=float_arg(0.0, 1e6, lo_open=True), default=None,
                    help="this machine's host copy rate for the roofline here, GB/s (default: measured "
                         "over the CPU pool's threads)")
    ap.add_argument("--temperature", type=float_arg(0.0, 100.0), default=0.0,
                    help="the timed decode draws seeded samples at this temperature (0: greedy)")
    args = ap.parse_args()
    if args.swiglu_fold is not None:  # read at each launch (expert_words.launch_words_swiglu)
        from strata_ray.kernels.expert_words import WORDS

        WORDS["cuda_swiglu"] = int(args.swiglu_fold)
    if args.fused_decode is not None:  # read where each op runs (kernels/fused_small.fused_enabled)
        os.environ["STRATA_FUSED_DECODE"] = args.fused_decode
    if args.gather_copy is not None:  # read at each copy (experts/slot_cache.SlotCache.copy_blobs)
        os.environ["STRATA_GATHER_COPY"] = args.gather_copy
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.sched != "auto":
        _set_sched(args.sched)
    path = args.model or f"/tmp/synth-{args.preset}-{args.layers}l.gguf"
    if not os.path.exists(path):
        t = time.perf_counter()
        write_synth(
            path, arch="qwen3next", preset=args.preset, layers=args.layers, expert_type="Q4_0", progress=False
        )
        print(f"wrote {path} in {time.perf_counter() - t:.0f} s", flush=True)
    file = GGUFFile(path)
    hp = file.hparams
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dense_q8 = (args.dense_q8 or os.environ.get("STRATA_DENSE_Q8") or "1") == "1" and dev == "cuda"
    glob, per_layer, expert_bytes = dense_split(file, quantized=dense_q8)
    full_dense = glob + per_layer * FULL_LAYERS
    full_experts = expert_bytes / hp.n_layer * FULL_LAYERS
    # what the engine keeps free besides the cache: --vram-reserve-mib and the prompt chunk's temporaries
    reserve = 700 * 2**20
    prompt = chunk_bytes(hp, args.chunk) if dev == "cuda" else 0
    share = max(0.0, (args.card_gib * 2**30 - reserve - prompt - full_dense) / full_experts)
    # the CPU kernels' cold forms compile beside the load, as the engine's load does: without it the decode
    # worker's team compiled inside the first timed decode (minutes on a fresh numba cache, no output: session
    # 43's H200 runs were cut there and looked like a hang)
    t_pre = time.perf_counter()
    with precompiling(dev) as background:  # joined at the block's end, killed where it raises
        # dense weights first, to learn the device memory they take; then the budget that leaves the share
        t = time.perf_counter()
        with torch.inference_mode():
            weights = load_dense_weights(file, device=dev, include_experts=False, quantized=dense_q8)
        dense_s = time.perf_counter() - t
        used = 0  # a CPU dry run: the budget is host memory for the cache alone
        if dev == "cuda":
            free, total = torch.cuda.mem_get_info()
            used = total - free
        budget_mib = int((used + reserve + prompt + share * expert_bytes + 64 * 2**20) / 2**20)
        print(f"dense weights: {dense_s:.1f} s, {used / 2**30:.1f} GiB on the device", flush=True)
        # STRATA_KERNEL_VARIANT, STRATA_PCIE_SHARE, STRATA_DECODE_PREFETCH, STRATA_RING_LOAN and
        # STRATA_LOAN_ORDER as the engine reads them (EngineConfig alone ignores the environment)
        env = _env_config()
        cfg = EngineConfig(model=path, device=dev, vram_budget_mib=budget_mib, arena_pin_gib=args.pin_gib,
                           prefill=args.chunk, ring_overlap=args.ring_overlap == "1", dense_q8=dense_q8,
                           kernel_variant=env.kernel_variant, pcie_share=env.pcie_share,
                           decode_prefetch=env.decode_prefetch, ring_loan=env.ring_loan,
                           loan_order=env.loan_order)
        if args.decode_cpu_thread is not None:
            cfg = dataclasses.replace(cfg, decode_cpu_thread=args.decode_cpu_thread == "1")
        if args.decode_pipeline is not None:
            cfg = dataclasses.replace(cfg, decode_pipeline=args.decode_pipeline == "1")
        if args.adapt_every is not None:
            if args.adapt_every < 0:
                raise SystemExit(f"error: --adapt-every must be >= 0, got {args.adapt_every}")
            cfg = dataclasses.replace(cfg, adapt_every=args.adapt_every)
        if args.expert_profile is not None:
            cfg = dataclasses.replace(cfg, expert_profile=args.expert_profile)
        t = time.perf_counter()
        try:
            tiers = build_expert_backend(cfg, file, hp, dev, progress=False)
        except ProfileError as e:
            raise SystemExit(f"error: {e}") from None
        if args.cpu_threads is not None or args.cpu_driver != "numba":  # else the engine's own pool
            n = args.cpu_threads or tiers.pool.n_threads
            tiers.pool = CpuPool(n, numba_parallel=args.cpu_driver == "numba")
    if background is not None:
        print(f"CPU kernels compiled beside the load: {time.perf_counter() - t_pre:.1f} s from its start",
              flush=True)
    # compile (or load from numba's cache) every kernel the run calls, as the engine's load does: in session 3
    # a profiled decode spent 0.4 s of its 2.5 s in llvmlite loading them
    from strata_ray.kernels.expert_rows_cuda import cuda_rows_on

    rows_note = " (Q4_0 one-token rows: CUDA C)" if dev == "cuda" and cuda_rows_on() else ""
    print(f"kernels ready in {tiers.warm_up():.1f} s (GPU expert kernels: {cfg.kernel_variant}{rows_note}, "
          f"PCIe share {tiers.pcie_share / 10:g}%)", flush=True)
    model = Model(hp, weights, experts=tiers)
    graphs = {"token_graph": False, "device_attention": False, "ahead": 0, "warm": False}
    if dev == "cuda" and not args.no_graphs:
        t = time.perf_counter()
        model.use_decode_graphs()
        model.decode_graphs.capture_now()
        g = model.decode_graphs
        graphs = {"token_graph": g.token_graph, "device_attention": g.attn is not None,
                  "ahead": getattr(g.rows, "ahead", 0), "warm": getattr(g.rows, "warm", False)}
        print(f"decode graphs captured in {time.perf_counter() - t:.1f} s ({g.describe()})", flush=True)
    loaded = SimpleNamespace(model=model, hp=hp)
    print(
        f"dense weights in {dense_s:.1f} s, tiers in {time.perf_counter() - t:.1f} s; "
        f"slots {tiers.residency.n_slots} of {hp.n_layer * hp.n_expert} pairs (share {share:.3f}); "
        f"pinned {tiers.store.pinned_bytes / 2**30:.1f} GiB",
        flush=True,
    )
    blob = tiers.store.max_blob
    host_here = args.host_gbs or host_copy_gbs(tiers.pool, 1 << 30)
    hbm_here = args.hbm_gbs or (device_copy_gbs(dev) if dev == "cuda" else host_here)  # CPU: one memory
    print(f"copy rates here: device {hbm_here:.0f} GB/s, host {host_here:.1f} GB/s ({tiers.pool.n_threads} "
          f"threads; the roofline of every session takes the H200 machine's {HBM_GBS:.0f} / {HOST_GBS:.0f})",
          flush=True)
    results = []
    for depth in args.depths:
        first = not results
        r = run_depth(loaded, tiers, depth, args.decode, chunk=args.chunk, profile=args.profile and first,
                      prompt_seed=args.prompt_seed,
                      temperature=args.temperature,
                      trace_prefill=args.trace_prefill == depth,
                      trace_decode=args.trace_decode if first else 0, trace_out=args.trace_out,
                      layer_times=args.layer_times,
                      team_sizes=list(args.team_sizes) if first and args.team_sizes else None)
        k = hp.n_expert_used
        gpu_bytes = r["hit_rate"] * k * hp.n_layer * blob + per_layer * hp.n_layer + glob / 2  # + lm head
        cpu_bytes = (1 - r["hit_rate"]) * k * hp.n_layer * blob
        r["roofline_tok_s"] = 1.0 / max(gpu_bytes / (HBM_GBS * 1e9), cpu_bytes / (HOST_GBS * 1e9))
        r["of_roofline"] = r["decode_tok_s"] / r["roofline_tok_s"]
        r["roofline_here_tok_s"] = 1.0 / max(gpu_bytes / (hbm_here * 1e9), cpu_bytes / (host_here * 1e9))
        r["of_roofline_here"] = r["decode_tok_s"] / r["roofline_here_tok_s"]
        results.append(r)
        print(
            json.dumps({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in r.items()}), flush=True
        )
    report = {
        "model": path,
        "cpu_threads": tiers.pool.n_threads,
        "hbm_gbs_here": hbm_here,  # the copy rates of this machine's roofline (of_roofline_here)
        "host_gbs_here": host_here,
        "cpu_driver": args.cpu_driver,
        "decode_graphs": model.decode_graphs is not None,
        "ring_overlap": args.ring_overlap == "1",
        "decode_cpu_thread": cfg.decode_cpu_thread,
        "decode_pipeline": cfg.decode_pipeline,
        "dense_q8": cfg.dense_q8,
        "kernel_variant": cfg.kernel_variant,
        "pcie_share": tiers.pcie_share,
        "share_host_gbs": tiers.host_gbs,  # the host rate an unset share came from (None: set, or none)
        "decode_prefetch": graphs["ahead"],  # the experts a layer copies ahead, as the decode took them
        "token_graph": graphs["token_graph"],
        "device_attention": graphs["device_attention"],
        "decode_warm": graphs["warm"],  # the worker reads each layer's predicted CPU rows ahead
        "fused_decode": os.environ.get("STRATA_FUSED_DECODE", "1") == "1",
        "gather_copy": os.environ.get("STRATA_GATHER_COPY", "1") == "1",
        "pinned_gib": tiers.store.pinned_bytes / 2**30,
        "layers": hp.n_layer,
        "card_gib": args.card_gib,
        "budget_mib": budget_mib,
        "expert_profile": args.expert_profile,
        "prompt_seed": args.prompt_seed,
        "slots": tiers.residency.n_slots,
        "loan_slots": tiers.residency.n_lendable,  # the prompt ring's slots lent to the decode
        "loan_order": tiers.loan_order,
        "pairs": hp.n_layer * hp.n_expert,
        "blob_bytes": blob,
        "fill": tiers.cache.fill_seconds,
        "results": results,
    }
    if args.save_expert_profile:
        tiers.save_profile(args.save_expert_profile)
        print(f"learned profile saved to {args.save_expert_profile}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
