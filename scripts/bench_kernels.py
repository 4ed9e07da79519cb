"""Expert kernel benchmarks (a script, not a test): GPU decode GB/s vs HBM copy bandwidth, prompt
int8 TOP/s vs the int8 peak, CPU pool GB/s vs host memcpy bandwidth. Writes a "Kernels" section.

    python scripts/bench_kernels.py [--section-out kernels.md] [--quick]

Shape: Qwen3-Next-80B-A3B experts (E = 2048, n_ff = 512, top-10). Targets: GPU decode >= 60% of
HBM copy bandwidth at 16+ experts per launch, CPU >= 50% of host copy bandwidth, prompt >= 30% of
the int8 tensor-core peak.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import subprocess
import sys
import time

import numpy as np
from bandwidth import device_copy_gbs, host_copy_gbs  # a sibling module (scripts/ is sys.path[0] when run)

from strata_ray.config import int_list, name_list
from strata_ray.kernels.contract import KERNEL_VARIANTS, Q4_0, Q4_K, Q8_0, ExpertLayer, type_name
from strata_ray.kernels.cpu_pool import CpuPool, cpu_count
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.kernels.expert_mma_cuda import MMA, WARP_TILES
from strata_ray.kernels.random_weights import Q_TYPES_FOR_TESTS as TYPES  # the types random_layer builds
from strata_ray.kernels.random_weights import random_layer

E, N_FF, TOP_K = 2048, 512, 10
INT8_PEAK_TOPS = {"H200": 1979.0, "H100": 1979.0, "A100": 624.0}  # dense, vendor sheets


def expert_bytes(layer: ExpertLayer) -> int:
    return int(sum(w.shape[1] * w.shape[2] for w in (layer.gate, layer.up, layer.down)))


def bench_cpu(rows: list, pool: CpuPool, quick: bool) -> None:
    rng = np.random.default_rng(0)
    n_expert = 64
    for wtype in (Q4_0, Q8_0):
        layer = random_layer(rng, n_expert, E, N_FF, (wtype,) * 3)
        per = expert_bytes(layer)
        for n_tok in (1, 4):
            x = rng.standard_normal((n_tok, E)).astype(np.float32)
            sets = [rng.choice(n_expert, TOP_K, replace=False) for _ in range(6)]
            tok = np.repeat(np.arange(n_tok), TOP_K).astype(np.int32)
            calls = [(tok, np.concatenate([rng.permutation(s) for _ in range(n_tok)]).astype(np.int32))
                     for s in sets]
            expert_ffn_cpu(x, *calls[0], layer, pool=pool)  # compile / warm
            reps = 2 if quick else 5
            t = time.perf_counter()
            for _ in range(reps):
                for tok, exp in calls:
                    expert_ffn_cpu(x, tok, exp, layer, pool=pool)
            dt = (time.perf_counter() - t) / (reps * len(calls))
            gbs = TOP_K * per / dt / 1e9
            rows.append(("cpu", type_name(wtype), f"{n_tok} tok x top-{TOP_K} ({TOP_K} experts)",
                         f"{dt * 1e3:.2f} ms", f"{gbs:.1f} GB/s"))


# profiler names of the expert kernels
EXPERT_KERNELS = ("_expert_mm", "_act_quant_kernel", "_expert_terms", "_expert_sum", "_expert_words",
                  "_swiglu_quant", "expert_rows", "expert_mma")


def device_seconds(fn, reps: int, per_kernel: dict | None = None) -> tuple[float, float]:
    """(all GPU kernels, expert kernels) device seconds per fn() call, from the CUDA profiler:
    pure kernel time, free of Python launch gaps; per_kernel, when given, gets each expert kernel's."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = ours = 0.0
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        if ev.key.startswith("Memcpy") or ev.key.startswith("Memset") or us <= 0:
            continue
        total += us
        if any(name in ev.key for name in EXPERT_KERNELS):
            ours += us
            if per_kernel is not None:
                per_kernel[ev.key] = per_kernel.get(ev.key, 0.0) + us / reps / 1e6
    return total / reps / 1e6, ours / reps / 1e6


def graph_seconds(fn, reps: int) -> float:
    """Wall seconds per fn() call replayed from one CUDA graph (what a captured decode step pays)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / 1e3 / reps


WIDE_DECODE_SWEEP = [  # wide-kernel decode knobs (bits must not change)
    {}, {"gu_nb": 4}, {"gu_nb": 16}, {"gu_nb": 4, "gu_warps": 4}, {"down_br": 32}, {"down_nb": 16},
    {"decode_stages": 2},
]
WIDE_PROMPT_SWEEP = [{}, {"prompt_br": 128}, {"prompt_bt": 128}, {"prompt_warps": 4}, {"prompt_stages": 2}]


SPLIT_SWEEP = [  # split decode tile knobs (bits must not change)
    {"br": 16}, {"br": 64}, {"nb": 4}, {"nb": 16}, {"warps": 2}, {"warps": 8}, {"sum_br": 32},
    {"sum_br": 256, "sum_warps": 8},
]
WORDS_SWEEP = [  # words decode tile knobs (bits must not change)
    {"cuda": False},  # the Triton words tile (the --sweep-with cuda baseline)
    {"chunk_pairs": 2}, {"chunk_pairs": 4}, {"chunk_pairs": 8}, {"gu_warps": 4}, {"gu_br": 64},
    {"down_br": 16}, {"down_br": 64}, {"down_warps": 8}, {"chunk_pairs": 2, "gu_warps": 4, "down_br": 16},
    {"dp4a": False}, {"split_gu": True}, {"split_gu": True, "gu_split_br": 32},
    {"split_gu": True, "chunk_pairs": 2},
    {"cuda": True},  # the CUDA C form (expert_rows_cuda.py), the default where cupy is installed
    {"cuda": True, "cuda_rpw": 1}, {"cuda": True, "cuda_rpw": 1, "cuda_warps": 8},
    {"cuda": True, "cuda_rpw": 4}, {"cuda": True, "cuda_rpw": 8}, {"cuda": True, "cuda_warps": 8},
    {"cuda": True, "cuda_rpw": 4, "cuda_warps": 2},
    {"cuda": True, "cuda_iters": 2}, {"cuda": True, "cuda_iters": 4}, {"cuda": True, "cuda_iters": 8},
    {"cuda": True, "cuda_iters": 16},  # CTAs walking row blocks, the next one's words loaded ahead
    {"cuda": True, "cuda_down_iters": 2}, {"cuda": True, "cuda_down_iters": 4},  # the down launch walking too
    {"cuda": True, "cuda_swiglu": 0}, {"cuda": True, "cuda_swiglu": 8},  # the SwiGLU kernel between the
    # launches at every tile size, or folded into the down launch at every one (the default: one-entry tiles)
    {"cuda": True, "cuda_bt": 0}, {"cuda": True, "cuda_bt": 1}, {"cuda": True, "cuda_bt": 2},  # tiles cut
    {"cuda": True, "cuda_bt": 1, "cuda_swiglu": 0},  # one-entry tiles with the SwiGLU kernel between
    {"cuda": True, "cuda_cta_fold": False},  # each warp's rows folded by its own lanes (CTAFOLD's before)
    {"cuda": True, "cuda_early": True},  # one-entry tiles' slot and order loaded beside TILE_START
    {"cuda": True, "cuda_early": False},  # the prologue before EARLY (the default's rows: EARLY is on)
    {"cuda": True, "cuda_early": True, "cuda_early_down": False},  # EARLY in the gate / up launch only
    {"cuda": True, "cuda_bias": True},  # the terms' float() as one subtraction of the int-to-float bias
]


def knob_sweep(rows, variant, x, calls, want, slots, wname, n_tok, nbytes, reps) -> None:
    """Decode tile tuning for the split or words variant (its knobs one set at a time over the defaults);
    every setting must give the simple bits."""
    import torch

    import strata_ray.kernels.expert_gpu as eg
    import strata_ray.kernels.expert_words as ew

    knobs_now, sweep = {"split": (eg.SPLIT, SPLIT_SWEEP), "words": (ew.WORDS, WORDS_SWEEP)}[variant]

    def run_all():
        return [eg.expert_ffn_gpu(x, t, s_, slots, mode="decode", variant=variant) for t, s_ in calls]

    base = dict(knobs_now)
    if variant == "words" and (n_tok > 1 or wname not in ("Q4_0", "Q8_0")):  # only the CUDA C form takes
        sweep = [k for k in sweep if k.get("cuda")]  # tiles of several entries and the K-quants
    try:
        for knobs in sweep:
            knobs_now.update(base, **knobs)
            got = run_all()
            same = all(map(torch.equal, got, want))
            per: dict = {}
            _, kern_s = device_seconds(run_all, reps, per)
            dt = kern_s / len(calls)
            label = ", ".join(f"{k}={v}" for k, v in knobs.items())
            graph_us = graph_seconds(run_all, reps) / len(calls) * 1e6
            parts = "; ".join(f"{name[:24]} {t / len(calls) * 1e6:.1f}" for name, t in sorted(per.items()))
            rows.append((f"gpu decode sweep ({variant})", wname, f"{n_tok} tok; {label}",
                         f"{dt * 1e6:.1f} us (graph {graph_us:.1f} us; {parts})",
                         f"{nbytes / dt / 1e9:.0f} GB/s, {'bits same' if same else 'BITS DIFFER'}"))
    finally:
        knobs_now.update(base)


def _calls(rng, n_slots, n_tok, dev):
    import torch

    tok = torch.from_numpy(np.repeat(np.arange(n_tok), TOP_K).astype(np.int32)).to(dev)
    return [(tok, torch.from_numpy(np.concatenate(
        [rng.permutation(cand)[:TOP_K] for _ in range(n_tok)]).astype(np.int32)).to(dev))
        for cand in (rng.permutation(n_slots)[:TOP_K * n_tok] for _ in range(8))]


def decode_sweep(rows, slots, wname, per, rng, n_slots, quick) -> None:
    """Wide decode tile tuning; every setting must give the bits of the simple kernel."""
    import torch

    import strata_ray.kernels.expert_gpu as eg

    dev = torch.device("cuda")
    defaults = dict(eg.WIDE)
    for n_tok in (1, 4):
        x = torch.randn(n_tok, E, device=dev)
        calls = _calls(rng, n_slots, n_tok, dev)
        want = [eg.expert_ffn_gpu(x, t, s_, slots, mode="decode", variant="simple") for t, s_ in calls]
        for knobs in WIDE_DECODE_SWEEP:
            eg.WIDE.update(defaults, **knobs)
            outs = [eg.expert_ffn_gpu(x, t, s_, slots, mode="decode", variant="wide") for t, s_ in calls]
            same = all(torch.equal(a, b) for a, b in zip(want, outs, strict=True))

            def run_all(x=x, calls=calls):
                for t, s_ in calls:
                    eg.expert_ffn_gpu(x, t, s_, slots, mode="decode", variant="wide")

            _, kern = device_seconds(run_all, 3 if quick else 10)
            dt = kern / len(calls)
            experts = np.mean([len(set(s_.tolist())) for _, s_ in calls])
            gbs = experts * per / dt / 1e9
            label = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "defaults"
            rows.append(("gpu decode sweep (wide)", wname, f"{n_tok} tok; {label}",
                         f"{dt * 1e6:.1f} us", f"{gbs:.0f} GB/s, bits {'same' if same else 'DIFFER'}"))
    eg.WIDE.update(defaults)


def prompt_sweep(rows, slots, wname, x, tok, slot, peak, quick) -> None:
    """Wide prompt tile tuning; every setting must give the bits of the simple kernel."""
    import torch

    import strata_ray.kernels.expert_gpu as eg

    defaults = dict(eg.WIDE)
    want = eg.expert_ffn_gpu(x, tok, slot, slots, mode="prompt", variant="simple")
    for knobs in WIDE_PROMPT_SWEEP[1:]:
        eg.WIDE.update(defaults, **knobs)
        same = torch.equal(want, eg.expert_ffn_gpu(x, tok, slot, slots, mode="prompt", variant="wide"))
        _, dt = device_seconds(functools.partial(eg.expert_ffn_gpu, x, tok, slot, slots, mode="prompt",
                                                 variant="wide"), 3 if quick else 10)
        tops = 2 * tok.numel() * 3 * E * N_FF / dt / 1e12
        pct = f" ({100 * tops / peak:.0f}%)" if peak else ""
        label = ", ".join(f"{k}={v}" for k, v in knobs.items())
        rows.append(("gpu prompt sweep (wide)", wname, label, f"{dt * 1e3:.2f} ms",
                     f"{tops:.0f} TOP/s{pct}, bits {'same' if same else 'DIFFER'}"))
    eg.WIDE.update(defaults)


def bench_gpu(rows: list, quick: bool, use_graphs: bool, types=(Q4_0, Q8_0, Q4_K), sweeps: bool = True,
              variants=KERNEL_VARIANTS, tokens=(1, 2, 4, 8), prompt: bool = True, mma_stages=(4,),
              mma_warp_entries=(MMA["warp_entries"],), mma_full_tiles=(None,)) -> dict:
    import torch

    import strata_ray.kernels.expert_words as ew
    from strata_ray.kernels import expert_mma_cuda as emc
    from strata_ray.kernels.expert_gpu import VARIANTS, expert_ffn_gpu

    ew.WORDS["types"] = (Q4_0, Q8_0)  # the opt-in Q8_0 words tile is measured too (bits checked)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"bench_kernels: unknown variant(s) {', '.join(unknown)} (of {', '.join(VARIANTS)})")

    dev = torch.device("cuda")
    info = {"gpu": torch.cuda.get_device_name(0)}
    info["hbm_copy_gbs"] = device_copy_gbs(dev)
    rng = np.random.default_rng(1)
    n_slots = 256
    for wtype in types:
        host = random_layer(rng, n_slots, E, N_FF, (wtype,) * 3)
        slots = ExpertLayer(*(torch.from_numpy(w).to(dev) for w in (host.gate, host.up, host.down)),
                            wtype, wtype, wtype)
        per = expert_bytes(host)
        del host
        for n_tok in tokens:
            # 8 entry sets over different experts, run round-robin so L2 (50 MB) cannot serve them.
            calls, n_exp = [], []
            x = torch.randn(n_tok, E, device=dev)
            tok = torch.from_numpy(np.repeat(np.arange(n_tok), TOP_K).astype(np.int32)).to(dev)
            for _ in range(8):
                # tokens share experts like real routing: each picks 10 of the same 10 * min(T, 4)
                cand = rng.permutation(n_slots)[:TOP_K * min(n_tok, 4)]
                ids = np.concatenate([rng.permutation(cand)[:TOP_K] for _ in range(n_tok)])
                n_exp.append(len(set(ids.tolist())))
                calls.append((tok, torch.from_numpy(ids.astype(np.int32)).to(dev)))
            want = [expert_ffn_gpu(x, t, s_, slots, mode="decode", variant="simple") for t, s_ in calls]
            for variant in variants:
                got = [expert_ffn_gpu(x, t, s_, slots, mode="decode", variant=variant) for t, s_ in calls]
                bits = "bits same" if all(map(torch.equal, got, want)) else "BITS DIFFER from simple"
                reps = 5 if quick else 20

                def run_all(x=x, calls=calls, slots=slots, variant=variant):
                    for t, s_ in calls:
                        expert_ffn_gpu(x, t, s_, slots, mode="decode", variant=variant)

                parts: dict = {}
                dev_s, kern_s = device_seconds(run_all, reps, parts)
                dt = kern_s / len(calls)
                # each expert kernel's share of a call: what a fused launch would take away
                print(f"decode {variant} {type_name(wtype)} {n_tok} tok: "
                      + ", ".join(f"{name[:40]} {sec / len(calls) * 1e6:.1f} us"
                                  for name, sec in sorted(parts.items(), key=lambda kv: -kv[1])))
                graph_note = ""
                if use_graphs:
                    graph_note = f", graph {graph_seconds(run_all, reps) / len(calls) * 1e6:.1f} us"
                experts = float(np.mean(n_exp))
                gbs = experts * per / dt / 1e9
                pct = 100 * gbs / info["hbm_copy_gbs"]
                rows.append((f"gpu decode ({variant})", type_name(wtype),
                             f"{n_tok} tok x top-{TOP_K} ({experts:.0f} experts)",
                             f"{dt * 1e6:.1f} us (all kernels {dev_s / len(calls) * 1e6:.1f} us{graph_note})",
                             f"{gbs:.0f} GB/s ({pct:.0f}% of copy), {bits}"))
                # the Triton words tile serves one token, its CUDA C form 1-8 (more take the simple tile)
                sweep_toks = {"split": (1, 8), "words": (1, 4, 8)}.get(variant, ())
                if sweeps and n_tok in sweep_toks and (variant == "words" or wtype in (Q4_0, Q8_0)):
                    knob_sweep(rows, variant, x, calls, want, slots, type_name(wtype), n_tok, experts * per,
                               reps)
        if sweeps and wtype in (Q4_0, Q8_0) and "wide" in variants:
            decode_sweep(rows, slots, type_name(wtype), per, rng, n_slots, quick)
        if not prompt:
            del slots
            torch.cuda.empty_cache()
            continue
        # Prompt chunk: 4096 tokens x top-10 over all slots (about 160 entries per expert).
        n_tok = 1024 if quick else 4096
        x = torch.randn(n_tok, E, device=dev)
        tok = torch.arange(n_tok, device=dev, dtype=torch.int32).repeat_interleave(TOP_K)
        slot = torch.stack([torch.randperm(n_slots, device=dev)[:TOP_K] for _ in range(n_tok)]).reshape(-1)
        slot = slot.to(torch.int32)
        peak = next((v for k, v in INT8_PEAK_TOPS.items() if k in info["gpu"]), None)
        want = expert_ffn_gpu(x, tok, slot, slots, mode="prompt", variant="simple")
        # words: the int8 MMA rows (expert_mma_cuda) where they serve the type, else simple's tile; once per
        # stage size in mma_stages (Q8_0 / Q4_0: 32-blocks a stage), warp tile in mma_warp_entries and full
        # tiles' form in mma_full_tiles (Q8_0 / Q4_0; in the order given, so 0,1,0,1 interleaves them)
        runs = [(v, None, None, None) for v in variants if v not in ("split", "words")]  # split: simple's
        if "words" in variants:
            runs += [("words", kb, we, full) for kb in (mma_stages if wtype in (Q4_0, Q8_0) else (None,))
                     for we in mma_warp_entries
                     for full in (mma_full_tiles if wtype in (Q4_0, Q8_0) else (None,))]
        for variant, kb, we, full in runs:
            if kb is not None:
                emc.MMA["stage_blocks"] = {**emc.MMA["stage_blocks"], wtype: kb}
            if we is not None:
                emc.MMA["warp_entries"] = we
            if full is not None:  # read at the kernel's build (its cache key too)
                os.environ["STRATA_MMA_FULL_TILES"] = str(full)
            same = torch.equal(want, expert_ffn_gpu(x, tok, slot, slots, mode="prompt", variant=variant))
            parts: dict = {}
            dt, _ = device_seconds(functools.partial(expert_ffn_gpu, x, tok, slot, slots, mode="prompt",
                                                     variant=variant), 3 if quick else 10, parts)
            by_time = sorted(parts.items(), key=lambda kv: -kv[1])
            tile = ("" if we is None else f" we={we}") + ("" if full is None else f" full={full}")
            print(f"prompt {variant}{tile} {type_name(wtype)}: all kernels {dt * 1e6:.1f} us; "
                  + ", ".join(f"{name[:40]} {sec * 1e6:.1f} us" for name, sec in by_time))
            tops = 2 * tok.numel() * 3 * E * N_FF / dt / 1e12
            pct = f" ({100 * tops / peak:.0f}% of {peak:.0f})" if peak else ""
            bits = "same" if same else "DIFFER"
            label = variant if kb is None else f"{variant}, {kb} blocks a stage"
            label += "" if we is None else f", warps of {we} entries"
            label += "" if full is None else f", full tiles {full}"
            rows.append((f"gpu prompt ({label})", type_name(wtype),
                         f"{n_tok} tok x top-{TOP_K} over {n_slots} experts",
                         f"{dt * 1e3:.2f} ms", f"{tops:.0f} int8 TOP/s{pct}, bits {bits}"))
        if sweeps and wtype == Q4_0 and "wide" in variants:
            prompt_sweep(rows, slots, type_name(wtype), x, tok, slot, peak, quick)
        del slots
        torch.cuda.empty_cache()
    return info


def bench_host_weights(rows: list, variants, reps: int = 10) -> None:
    """The decode tiles reading the weights straight from pinned host memory (zero-copy over PCIe, as a
    budget decode could for some of a layer's misses): 1 token x top-10 Q4_0, GB/s of expert bytes; the rows
    must have the bits of the same tile over device slots."""
    import torch

    from strata_ray.kernels.expert_gpu import expert_ffn_gpu

    rng = np.random.default_rng(3)
    n_slots = 64
    host = random_layer(rng, n_slots, E, N_FF, (Q4_0,) * 3)
    pinned = ExpertLayer(*(torch.from_numpy(w).pin_memory() for w in (host.gate, host.up, host.down)),
                         Q4_0, Q4_0, Q4_0)
    device = ExpertLayer(*(w.cuda() for w in (pinned.gate, pinned.up, pinned.down)), Q4_0, Q4_0, Q4_0)
    per = expert_bytes(host)
    x = torch.randn(1, E, device="cuda")
    tok = torch.zeros(TOP_K, dtype=torch.int32, device="cuda")
    calls = [torch.from_numpy(rng.permutation(n_slots)[:TOP_K].astype(np.int32)).cuda() for _ in range(6)]
    for variant in variants:
        if variant not in ("words", "simple"):
            continue
        want = [expert_ffn_gpu(x, tok, s_, device, mode="decode", variant=variant) for s_ in calls]
        try:
            got = [expert_ffn_gpu(x, tok, s_, pinned, mode="decode", variant=variant) for s_ in calls]
        except Exception as e:  # a driver or Triton that will not take host pointers: say so, go on
            rows.append((f"gpu decode, host weights ({variant})", "Q4_0", "1 tok x top-10", "n/a",
                         f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"))
            continue
        same = all(map(torch.equal, got, want))

        def run_all(variant=variant):
            for s_ in calls:
                expert_ffn_gpu(x, tok, s_, pinned, mode="decode", variant=variant)

        _, kern_s = device_seconds(run_all, reps)
        dt = kern_s / len(calls)
        rows.append((f"gpu decode, host weights ({variant})", "Q4_0", "1 tok x top-10 (10 experts)",
                     f"{dt * 1e6:.1f} us", f"{TOP_K * per / dt / 1e9:.1f} GB/s over PCIe, "
                     f"{'bits same' if same else 'BITS DIFFER'} as from device slots"))


def bench_staging(rows: list, reps: int = 20) -> None:
    """The decode's PCIe share (STRATA_PCIE_SHARE): n experts copied whole from a page-locked host layer into
    staging slots by gather_copy.stage_experts (one launch, planned on the device), against the copy engine
    (three copy_ calls an expert); GB/s of expert bytes, CUDA events around `reps` launches, bytes checked."""
    import torch

    from strata_ray.experts.host_arena import HostBlock
    from strata_ray.kernels.gather_copy import stage_experts, stage_table

    rng = np.random.default_rng(5)
    n_expert = 64
    host = random_layer(rng, n_expert, E, N_FF, (Q4_0,) * 3)
    parts = [w.reshape(n_expert, -1) for w in (host.gate, host.up, host.down)]  # [X, bytes] each
    sizes = [p.shape[1] for p in parts]
    block = HostBlock(sum(p.nbytes for p in parts), register=True)
    views, off = [], 0
    for p in parts:  # the arena's layout: each part's experts contiguous, one part after the other
        views.append(block.view(off, p.shape))
        views[-1][:] = p
        off += p.nbytes
    blob = sum(sizes)
    offsets = (0, sizes[0], sizes[0] + sizes[1])
    table = stage_table([(v.ctypes.data, v.strides[0], n) for v, n in zip(views, sizes, strict=True)],
                        offsets, blob)
    table_d = torch.from_numpy(table).cuda()
    staging = torch.zeros((TOP_K, blob), dtype=torch.uint8, device="cuda")
    pinned = [torch.from_numpy(v) for v in views]  # page-locked CPU tensors [X, bytes]

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(reps):
            fn()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) / 1e3 / reps

    for n in (1, 2, 3, 5, 10):
        experts = rng.choice(n_expert, TOP_K, replace=False).astype(np.int32)
        start = torch.tensor([k if k < n else -1 for k in range(TOP_K)], dtype=torch.int32, device="cuda")
        staging.zero_()
        dt = timed(functools.partial(stage_experts, start, torch.from_numpy(experts).cuda(), table_d, staging,
                                     max(sizes)))
        got = staging[:n].cpu().numpy()
        same = all(np.array_equal(got[k, o : o + sz], v[experts[k]])
                   for k in range(n) for v, o, sz in zip(views, offsets, sizes, strict=True))
        copies = [(staging[k, o : o + sz], pin[int(experts[k])])
                  for k in range(n) for pin, o, sz in zip(pinned, offsets, sizes, strict=True)]
        de = timed(functools.partial(_copy_all, copies))
        rows.append(("stage experts (PCIe share)", "Q4_0", f"{n} experts of {blob / 1e6:.2f} MB",
                     f"{dt * 1e6:.1f} us", f"{n * blob / dt / 1e9:.1f} GB/s (copy engine, 3 copies an "
                     f"expert: {n * blob / de / 1e9:.1f} GB/s), {'bytes same' if same else 'BYTES DIFFER'}"))
    del pinned, views, copies
    block.close()


def _copy_all(copies) -> None:
    for dst, src in copies:
        dst.copy_(src, non_blocking=True)


class _Printing:
    """Appends to `rows` and prints each row as it lands, so a run cut short by a time limit still reports.
    (It wraps the list: a list subclass built from `rows` was a copy, and the GPU rows never reached the
    markdown section, session 10.)"""

    def __init__(self, rows: list):
        self.rows = rows

    def append(self, row) -> None:
        print("| " + " | ".join(row) + " |", flush=True)
        self.rows.append(row)


def graph_probe(which: str) -> None:
    """Capture expert_ffn_gpu (which=full) or only its Triton launches (which=kernels) in a CUDA
    graph, replay, compare with eager. Run in a subprocess: a fault poisons the CUDA context."""
    import torch

    import strata_ray.kernels.expert_gpu as eg

    dev = torch.device("cuda")
    host = random_layer(np.random.default_rng(3), 16, E, N_FF, (Q8_0,) * 3)
    slots = ExpertLayer(*(torch.from_numpy(w).to(dev) for w in (host.gate, host.up, host.down)),
                        Q8_0, Q8_0, Q8_0)
    x = torch.randn(2, E, device=dev)
    tok = torch.tensor([0] * 10 + [1] * 10, dtype=torch.int32, device=dev)
    slot = torch.tensor(list(range(10)) + list(range(5, 15)), dtype=torch.int32, device=dev)
    want = eg.expert_ffn_gpu(x, tok, slot, slots, mode="decode")
    if which == "kernels":
        plan = eg.plan_tiles(slot, 2, 16)
        eg.plan_tiles = lambda *a: plan
    out = torch.empty_like(want)
    eg.expert_ffn_gpu(x, tok, slot, slots, mode="decode", out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eg.expert_ffn_gpu(x, tok, slot, slots, mode="decode", out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    print(f"graph-{which}: {'PASS' if torch.equal(out, want) else 'MISMATCH'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--section-out", help="write the markdown section to this file")
    ap.add_argument("--quick", action="store_true",
                    help="fewer repeats and a smaller host copy (minutes less, noisier numbers)")
    ap.add_argument("--no-gpu", action="store_true", help="time the CPU kernels only, even where a GPU is")
    ap.add_argument("--graph-probe", choices=["kernels", "full"],
                    help="(internal, run in a child process) check that one expert call captures into a CUDA "
                    "graph and replays to the same rows: its kernels alone, or the whole call")
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K", type=name_list(TYPES),
                    help="GPU weight types to time (comma-separated: Q4_0, Q8_0, Q4_K, Q6_K)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the knob sweeps (wide, split, words)")
    ap.add_argument("--sweep-with", metavar="KNOBS",
                    help="sweep only the knob sets that set one of these (comma-separated, e.g. cuda)")
    ap.add_argument("--variants", default="words,simple,wide,split", type=name_list(KERNEL_VARIANTS),
                    help="GPU kernel variants to time (comma-separated: simple, wide, split, words)")
    ap.add_argument("--tokens", default="1,2,4,8", type=int_list(1, 8),
                    help="decode token counts to time (comma-separated, 1 to 8)")
    ap.add_argument("--no-prompt", action="store_true", help="skip the prompt-chunk kernels")
    ap.add_argument("--mma-stages", default="4", type=int_list(4, 8),
                    help="32-blocks a stage of the MMA prompt rows to time, Q8_0 / Q4_0 (4, 8; e.g. 8,4)")
    ap.add_argument("--mma-warp-entries", default=str(MMA["warp_entries"]), type=int_list(32, 64),
                    help="the MMA prompt rows' warp tiles to time: 32 (32 entries x 32 rows) and / or 64 "
                    f"(64 x 16), e.g. 32,64; default the engine's, {MMA['warp_entries']}")
    ap.add_argument("--mma-full-tiles", default=None, type=int_list(0, 1),
                    help="the Q4_0 / Q8_0 MMA prompt rows' full-tile form (STRATA_MMA_FULL_TILES) to time, "
                    "in this order: e.g. 0,1,0,1 interleaves off and on; default the engine's")
    ap.add_argument("--staging", action="store_true",
                    help="time the PCIe share's staging copies (stage_experts) against copy_ calls")
    ap.add_argument("--host-weights", action="store_true",
                    help="also time the decode tiles over weights in pinned host memory (zero-copy, PCIe)")
    args = ap.parse_args()
    if not set(args.mma_stages) <= {4, 8}:
        ap.error(f"--mma-stages: 4 or 8 blocks a stage, got {','.join(map(str, args.mma_stages))}")
    if not set(args.mma_warp_entries) <= set(WARP_TILES):
        ap.error(f"--mma-warp-entries: 32 or 64, got {','.join(map(str, args.mma_warp_entries))}")
    if args.graph_probe:
        graph_probe(args.graph_probe)
        return
    if os.environ.get("STRATA_ROWS_EARLY"):  # it wins over WORDS: the sweeps' cuda_early rows would lie
        ap.error("unset STRATA_ROWS_EARLY: the sweeps set WORDS['cuda_early'] (--sweep-with cuda_early)")
    if args.sweep_with:
        sweeps, wanted = (WIDE_DECODE_SWEEP, SPLIT_SWEEP, WORDS_SWEEP), set(args.sweep_with.split(","))
        names = sorted({name for sweep in sweeps for knobs in sweep for name in knobs})
        unknown = sorted(wanted - set(names))
        if unknown:  # a typo would sweep nothing and say nothing
            ap.error(f"--sweep-with: unknown knob(s) {', '.join(unknown)} (of {', '.join(names)})")
        for sweep in sweeps:
            sweep[:] = [knobs for knobs in sweep if wanted & set(knobs)]
    rows: list = []
    info: dict = {}
    pool = CpuPool()
    host_gbs = host_copy_gbs(pool, (1 << 28) if args.quick else (1 << 30), repeats=3)
    try:
        import torch

        has_gpu = torch.cuda.is_available() and not args.no_gpu
    except ImportError:
        has_gpu = False
    probes = []
    if has_gpu:
        for which in ("kernels", "full"):
            r = subprocess.run([sys.executable, __file__, "--graph-probe", which], capture_output=True,
                               text=True, timeout=300)
            lines = (r.stdout + r.stderr).strip().splitlines()
            probes.append(next((ln for ln in lines if ln.startswith("graph-")),
                               f"graph-{which}: FAIL ({lines[-1] if lines else r.returncode})"))
        types = tuple(TYPES[t] for t in args.types)
        info = bench_gpu(_Printing(rows), args.quick, use_graphs=probes[-1].endswith("PASS"), types=types,
                         sweeps=not args.no_sweep, variants=args.variants, tokens=args.tokens,
                         prompt=not args.no_prompt, mma_stages=args.mma_stages,
                         mma_warp_entries=args.mma_warp_entries,
                         mma_full_tiles=args.mma_full_tiles or (None,))
        if args.host_weights:
            bench_host_weights(_Printing(rows), args.variants)
        if args.staging:
            bench_staging(_Printing(rows))
    bench_cpu(rows, pool, args.quick)
    lines = ["## Kernels", "",
             f"Expert kernels (`scripts/bench_kernels.py`), shape E={E}, n_ff={N_FF}, top-{TOP_K}; "
             f"{time.strftime('%Y-%m-%d')}, {info.get('gpu', 'no GPU')}, {cpu_count()} CPU threads "
             f"({platform.processor() or platform.machine()}).", "",
             f"- HBM device copy: {info.get('hbm_copy_gbs', 0):.0f} GB/s (read + write)" if info else
             "- HBM device copy: n/a",
             f"- host memcpy ({pool.n_threads} threads): {host_gbs:.1f} GB/s (read + write)",
             *[f"- CUDA graph capture probe: {p}" for p in probes], "",
             "| kernel | weights | case | time/call | throughput |", "|---|---|---|---:|---:|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.section_out:
        with open(args.section_out, "w") as f:
            f.write(text)
    pool.close()


if __name__ == "__main__":
    main()
