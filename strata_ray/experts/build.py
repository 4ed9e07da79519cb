"""Assembling the expert tiers for one model: host store, residency, slot cache, rounds, backend.

`load_tiered_model` is what the Engine calls: when the routed experts are block-quantized it loads the
dense weights without them and routes all expert math through `TieredExperts` (the contract kernels),
which is what makes the output independent of placement. Float experts keep the plain float path.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

import torch

from strata_ray.config import parse_value, ring_slots_value
from strata_ray.engine.progress import LoadProgress
from strata_ray.experts.adaptive import AdaptiveTier
from strata_ray.experts.host_store import HostStore, experts_block_quantized
from strata_ray.experts.prefault import spare_memory_gib
from strata_ray.experts.profile import check_shape, read_profile
from strata_ray.experts.residency import Residency
from strata_ray.experts.slot_cache import SlotCache, cache_slots
from strata_ray.experts.tiered import LocalRounds, TieredExperts, cuda_pool_threads

log = logging.getLogger("strata_ray.experts")

RING_SLOTS = 32  # prompt-path ring on CUDA (~57 MB at the 80b-a3b Q4_0 blob), STRATA_RING_OVERLAP=0
# The overlapped ring (the default): two halves, copies into one while the kernels read the other, and the
# next layer's first half copied while this layer computes and during the next one's attention / GDN. As
# many slots as RING_BYTES holds, within [RING_SLOTS_OVERLAP_MIN, RING_SLOTS_OVERLAP] and at most a layer's
# experts a half; the cache gives them up at auto sizing. 80b-a3b (1.77 MB blobs): 606 slots, a half holds
# the ~275 experts a layer streams at a 24 GiB budget, so a layer's copies all run ahead of it (session 8,
# 8K prefill at that budget: 1,140 tok/s with 64 slots and a layer at a time, 1,728 with 256).
RING_SLOTS_OVERLAP, RING_SLOTS_OVERLAP_MIN = 1024, 32
RING_BYTES = 1 << 30


def _warm_cpu_steps(hp, device) -> None:
    """On the CPU, a decode step's small chains (kernels/fused_small_cpu), its router (kernels/router_cpu),
    its attention core (kernels/attention_decode_cpu) and a qwen3next's GDN core where its state is small
    (kernels/gdn_step_cpu) run as numba kernels: compiled at load (float-expert files too), not at the first
    decode step."""
    from strata_ray.kernels import attention_decode_cpu, fused_small_cpu, router_cpu
    from strata_ray.kernels.gdn_step import GDNDims
    from strata_ray.kernels.gdn_step_cpu import cpu_step_serves, warm_up

    probe = torch.zeros(1, 1, device=device)
    if fused_small_cpu.cpu_norm_serves(probe, torch.ones(1, device=device), 1):
        fused_small_cpu.warm_up()
        router_cpu.warm_up()
        attention_decode_cpu.warm_up()
    if not any(hp.recurrent):
        return
    dims = GDNDims(hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_head_v_dim)
    if cpu_step_serves(probe, 1, dims):
        warm_up(dims, hp.ssm_conv_kernel)


def build_expert_backend(config, loaded_file, hp, device, progress=True) -> TieredExperts:
    """TieredExperts over `loaded_file` (an open GGUFFile) on `device`, sized and filled per `config`.
    progress: a LoadProgress (stages and fill count reported to it), or a bool for SlotCache.fill.

    Raises ProfileError (one line) for an unreadable or mismatched --expert-profile."""
    device = torch.device(device)
    profile = None
    if config.expert_profile is not None:
        profile = read_profile(config.expert_profile)
        check_shape(profile, hp)
    reporter = progress if isinstance(progress, LoadProgress) else None
    if reporter is not None:
        reporter.stage("host store")
    pin_gib = config.arena_pin_gib
    if pin_gib is None:
        pin_gib = auto_pin_gib() if device.type == "cuda" else 0.0
    store = HostStore(loaded_file, pin_gib=pin_gib)
    # a CPU primary streams no prompt through a ring; STRATA_RING_SLOTS still gives it one, for a loan
    # alone (the tests' view of the CUDA decode's loan)
    cuda_ring = device.type == "cuda" or bool(os.environ.get("STRATA_RING_SLOTS"))
    ring = ring_slots(config.ring_overlap, store.max_blob, hp.n_expert) if cuda_ring else 0
    n_slots = cache_slots(config, store, device, ring_slots=ring)
    residency = Residency(hp.n_layer, hp.n_expert, n_slots, n_lendable=loan_slots(config, n_slots, ring, hp))
    cache = SlotCache(store, residency, device, ring_slots=ring)
    cache.fill(profile, progress=reporter.fill if reporter is not None else progress)
    rounds = None
    if config.adapt_every > 0 and config.adapt_swaps > 0 and 0 < n_slots < hp.n_layer * hp.n_expert:
        rounds = LocalRounds(
            AdaptiveTier(hp.n_layer, hp.n_expert, config.adapt_every, config.adapt_swaps, config.adapt_decay)
        )
    return TieredExperts(store, cache, device, rounds=rounds, prior=profile,
                         kernel_variant=config.kernel_variant, ring_overlap=config.ring_overlap,
                         decode_cpu_thread=config.decode_cpu_thread, decode_pipeline=config.decode_pipeline,
                         pcie_share=config.pcie_share, decode_prefetch=config.decode_prefetch,
                         loan_order=config.loan_order)


def loan_slots(config, n_slots: int, ring: int, hp) -> int:
    """The ring slots decode borrows (config.ring_loan): all of them, where the cache holds some experts
    but the cache and the ring together hold fewer than all (a loan that made every expert resident would
    switch the decode to its all-resident form mid-request); else none."""
    pairs = hp.n_layer * hp.n_expert
    return ring if config.ring_loan and 0 < n_slots and n_slots + ring < pairs else 0


def ring_slots(overlap: bool, blob_bytes: int, n_expert: int) -> int:
    """The prompt ring's slots on CUDA: RING_SLOTS without overlap, else an even count from RING_BYTES (see
    there); STRATA_RING_SLOTS sets another even count (a benchmark knob)."""
    raw = os.environ.get("STRATA_RING_SLOTS", "")
    if not raw:  # unset or empty, as config reads it
        if not overlap:
            return RING_SLOTS
        fit = min(RING_SLOTS_OVERLAP, RING_BYTES // max(1, blob_bytes), 2 * n_expert)
        return max(RING_SLOTS_OVERLAP_MIN, fit - fit % 2)
    return parse_value(ring_slots_value, raw, "STRATA_RING_SLOTS")  # config refused a bad one already


def auto_pin_gib() -> float:
    """GiB of expert layers to page-lock by default on CUDA: the host's available memory (which counts the
    page cache, so the GGUF's own pages) less what is left for everything else. Pinned layers stream to
    the device at ~50 GB/s instead of ~7-15 GB/s through staging buffers (an 8K prompt at a 24 GiB budget
    on the H200: 7.0 s instead of 14.4 s), at ~0.2 s of load time per GiB."""
    return spare_memory_gib()


def precompile_in_background(device: str):
    """On CUDA, start a process for each CPU kernel form numba's cache lacks (kernels/precompile.start), so
    that on a fresh install they compile beside the load and each other instead of one after another in
    this process (~5 minutes on the H200 host, most of it the decode worker's forms, which otherwise
    compile in the decode graphs' stage). None where nothing is gained: not CUDA, fewer than two cold
    forms, fewer than three cores (the load needs one), or STRATA_PRECOMPILE=0."""
    if torch.device(device).type != "cuda" or os.environ.get("STRATA_PRECOMPILE", "1") == "0":
        return None
    from strata_ray.kernels import precompile
    from strata_ray.kernels.cpu_pool import cpu_count

    if cpu_count() < 3:
        return None
    n_threads = cuda_pool_threads()  # TieredExperts' pool on CUDA: its forms' thread count
    cold = precompile.cold_forms(precompile.forms_for(n_threads))
    if len(cold) < 2:
        return None
    log.info("compiling the CPU kernels' forms %s in %d processes beside the load", ", ".join(cold),
             len(cold))
    return precompile.start(cold, n_threads)


def _join_precompile(background, stage=lambda _name: None, poll_s: float = 0.5) -> None:
    """Wait for precompile_in_background's processes, the load stage counting the forms done; a failed one
    only means that form compiles here."""
    if background is None:
        return
    n = len(background.procs)
    while (done := background.n_done()) < n:
        stage(f"compiling kernels ({done} of {n} forms)")
        time.sleep(poll_s)
    steps = background.wait()
    log.info("CPU kernels precompiled: %s", "; ".join(f"{s.label} {s.seconds:.1f} s" for s in steps))
    for form, why in background.failed.items():
        log.warning("the %s kernels' precompile process failed (%s); they compile in this process", form, why)


@contextmanager
def precompiling(device: str, stage=lambda _name: None):
    """precompile_in_background for the block (the load beside it): joined as the block ends, the stage
    counting the forms done; killed where the block raises, so a failed load leaves no compiler behind.
    Yields the Background, or None where nothing was started."""
    background = precompile_in_background(device)
    try:
        yield background
    except BaseException:
        if background is not None:
            background.kill()
        raise
    _join_precompile(background, stage)


def _decode_graphs(config, model, stage) -> None:
    """On CUDA, capture the one-token dense segments now (a second or so) rather than in the first request."""
    if model.device.type != "cuda" or not config.decode_graphs:
        return
    stage("capturing decode graphs")
    model.use_decode_graphs()
    try:
        model.decode_graphs.capture_now()
        log.info("decode graphs: %s", model.decode_graphs.describe())
    except RuntimeError as e:  # an op this torch cannot capture: run op by op (the same bits), and say so
        model.decode_graphs = None
        reason = str(e).strip().splitlines()[:1] or [type(e).__name__]  # the message's first line
        log.warning("decode graphs: capture failed (%s); decoding without them (STRATA_DECODE_GRAPHS=0 "
                    "skips the attempt)", reason[0])


def load_tiered_model(config, device: str, progress: LoadProgress | bool | None = None):
    """(LoadedModel, TieredExperts | None). Block-quantized experts -> dense weights without experts +
    TieredExperts; otherwise the plain `load_model` (float experts, no tiers). progress: a LoadProgress
    that follows the stages and the cache fill; None or False: no progress is shown."""
    from strata_ray.model.forward import Model
    from strata_ray.model.gguf_file import GGUFFile
    from strata_ray.model.loader import LoadedModel, load_model_file, resolve_model_path
    from strata_ray.model.tokenizer import Tokenizer
    from strata_ray.model.weights import load_dense_weights

    reporter = progress if isinstance(progress, LoadProgress) else None
    stage = reporter.stage if reporter is not None else (lambda _name: None)
    path = resolve_model_path(config.model)
    file = GGUFFile(path)
    if not experts_block_quantized(file):
        stage("weights")
        loaded = load_model_file(file, device=device)  # the file is open: no second header parse
        _warm_cpu_steps(file.hparams, device)
        _decode_graphs(config, loaded.model, stage)
        return loaded, None
    stage("dense weights")
    with precompiling(device, stage):
        with torch.inference_mode():
            # on CUDA the dense Q8_0 matrices stay Q8_0 (config.dense_q8): VRAM for the expert cache instead
            quantized = config.dense_q8 and torch.device(device).type == "cuda"
            # on the CPU with cpu_dense_blocks: every quantized matrix as its blocks (kernels/dense_blocks)
            blocks = config.cpu_dense_blocks and torch.device(device).type == "cpu"
            weights = load_dense_weights(file, device=device, include_experts=False, quantized=quantized,
                                         blocks=blocks)
        tiers = build_expert_backend(config, file, file.hparams, device, progress=reporter or False)
        stage("compiling kernels")  # numba caches them: minutes on a first run, about a second after
    log.info("expert kernels compiled in %.1f s", tiers.warm_up())
    _warm_cpu_steps(file.hparams, device)
    stage("tokenizer")
    model = Model(file.hparams, weights, experts=tiers)
    _decode_graphs(config, model, stage)
    loaded = LoadedModel(
        file=file, hp=file.hparams, model=model, tokenizer=Tokenizer.from_gguf(file), path=path
    )
    return loaded, tiers
