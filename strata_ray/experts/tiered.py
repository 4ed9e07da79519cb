"""TieredExperts: the ExpertBackend that computes every routed expert through the contract kernels,
from whichever tier holds it.

Per layer, each (token, k) entry is classified by the residency table: resident -> the slot cache
(the GPU grouped kernel on CUDA, the numba kernels over the CPU slot tier otherwise); the others -> the
CPU pool from the host store. The CPU work is submitted first, then the cache's kernel is launched,
then both are joined, so they overlap. Rows land in one [N*K, E] buffer by entry index and every
token's k rows are combined with the router weights in k order (`combine_rows`), whatever produced
them: with the contract's bit-identical rows, the output cannot depend on placement.

Prompt chunks on CUDA (more than DECODE_MAX_TOKENS tokens) stream the non-resident experts through the
cache's ring slots instead of the CPU pool (DESIGN section 8, prompt path).

Windows: a decode step (a forward of at most DECODE_MAX_TOKENS tokens) is one window. At the start of
each forward (layer 0) the previous window is closed: pending swaps land, its routing counts go to the
round planner, and the swaps a round returns are scheduled (victims leave now, newcomers are copied on
the swap stream and become resident at a later boundary).
"""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch
from torch.profiler import record_function

from strata_ray.experts.adaptive import AdaptiveTier, Swap
from strata_ray.experts.host_store import HostStore
from strata_ray.experts.layer_clock import LayerClock
from strata_ray.experts.metrics import TierMetrics
from strata_ray.experts.pcie_share import auto_pcie_share
from strata_ray.experts.profile import Profile, learned_profile, write_profile
from strata_ray.experts.slot_cache import SlotCache
from strata_ray.kernels.contract import DECODE_MAX_TOKENS
from strata_ray.kernels.cpu_pool import SINGLE_THREAD_BYTES, CpuPool, cpu_count, default_pool, spin_default
from strata_ray.kernels.expert_cpu import (
    TokenLayer,
    expert_ffn_cpu,
    expert_ffn_cpu_token,
    token_form_fits,
    token_layer,
)
from strata_ray.kernels.tile_plan import plan_tiles_host
from strata_ray.kernels.token_moe_cpu import TokenMoe, token_moe_cpu_serves
from strata_ray.model.moe import combine_rows
from strata_ray.model.routing_digest import routing_digest

# a loan (the ring's slots while decoding): pairs copied at each window boundary, ~113 MB for the 80b-a3b's
# 1.77 MB blobs, ~2.5 ms of PCIe: each step lands within the next token, so its boundary does not wait
LOAN_STEP = 64
ALIGN_INT32 = 4  # _upload's arrays start on 16-byte boundaries (4 int32)
STREAM_ALL_TOKENS = 1024  # prompt chunks from this size stream every non-resident expert (DESIGN section 8)


class LocalRounds:
    """Adaptive rounds in this process (no Ray, tests): the AdaptiveTier decides at once."""

    def __init__(self, tier: AdaptiveTier):
        self.tier = tier

    def window_done(self, counts: np.ndarray, resident: np.ndarray, busy: bool) -> list[Swap]:
        self.tier.record(counts)
        if not self.tier.window_done():
            return []
        rnd = self.tier.run_round(resident, primary_busy=busy)
        return [] if rnd is None else rnd.primary

    def drain(self) -> list[Swap]:
        """Nothing is ever in flight here."""
        return []

    def flush(self, resident: np.ndarray) -> list[Swap]:
        """Nothing is ever left due here: each round ran at its boundary."""
        return []


class DueCounts:
    """Routed-entry counts cut at the rounds' boundaries: one [L, X] sum for each `every` windows. A round's
    usage is then its own windows' counts however late its message goes (an answer still in flight, or one
    whose swaps must reach the resident mask first), and a late coordinator still runs one round a
    boundary."""

    def __init__(self, n_layers: int, n_expert: int, every: int):
        self.every = max(1, every)
        self._open = np.zeros((n_layers, n_expert), dtype=np.int64)  # [L, X] since the last boundary
        self._windows = 0
        self._due: list[np.ndarray] = []  # [L, X] each, oldest first

    def add(self, counts: np.ndarray) -> None:
        """A closed window's counts [L, X]."""
        self._open += counts
        self._windows += 1
        if self._windows % self.every == 0:
            self._due.append(self._open)
            self._open = np.zeros_like(self._open)

    def take(self) -> list[np.ndarray]:
        """The due rounds' counts not yet taken, oldest first; the windows past the last boundary stay."""
        due, self._due = self._due, []
        return due


class CoordinatorRounds:
    """Adaptive rounds decided by the coordinator actor, off the critical path.

    Counts go to `Coordinator.adapt_round` at the rounds' boundaries, one [L, X] sum a round (`DueCounts`;
    one request in flight at a time); the swaps it returns are applied at the first window boundary after
    they arrive. Late answers only delay placement, never change output."""

    def __init__(self, coordinator, n_layers: int, n_expert: int, send_every: int):
        self.coordinator = coordinator
        self._counts = DueCounts(n_layers, n_expert, send_every)
        self._inflight = None

    def window_done(self, counts: np.ndarray, resident: np.ndarray, busy: bool) -> list[Swap]:
        import ray

        self._counts.add(counts)
        swaps: list[Swap] = []
        if self._inflight is not None:
            ready, _ = ray.wait([self._inflight], timeout=0)
            if not ready:
                return []
            swaps = [Swap(*s) for s in ray.get(self._inflight)]
            self._inflight = None
            if swaps:
                return swaps  # the mask sent next must include them: send next window
        due = self._counts.take()
        if due:
            self._inflight = self.coordinator.adapt_round.remote(due, resident, busy)
        return swaps

    def drain(self, timeout: float = 30.0) -> list[Swap]:
        """End of a generation: wait for the round in flight (its answer would otherwise land in the next
        request, or never, depending on timing) and return its swaps."""
        import ray

        if self._inflight is None:
            return []
        ready, _ = ray.wait([self._inflight], timeout=timeout)
        swaps = [Swap(*s) for s in ray.get(self._inflight)] if ready else []
        self._inflight = None
        return swaps

    def flush(self, resident: np.ndarray, timeout: float = 30.0) -> list[Swap]:
        """End of a generation, after drain() and its swaps scheduled: the rounds due but not sent yet (the
        answer before them came late, or brought swaps the mask had to include first), planned now against
        `resident` [L, X] (nothing in flight), so that no round's counts carry into the next request."""
        due = self._counts.take()
        if not due:
            return []
        self._inflight = self.coordinator.adapt_round.remote(due, resident, False)
        return self.drain(timeout)



def cuda_pool_threads() -> int:
    """The CPU pool's threads on CUDA: every core but one, which the caller's thread keeps launching GPU work
    on (a pool thread descheduled inside a parallel region would hold the others at its barrier)."""
    return max(1, cpu_count() - 1)

class TieredExperts:
    def __init__(
        self,
        store: HostStore,
        cache: SlotCache,
        device: torch.device | str,
        pool: CpuPool | None = None,
        rounds=None,
        prior: Profile | None = None,
        kernel_variant: str = "words",
        ring_overlap: bool = False,
        decode_cpu_thread: bool = False,
        decode_pipeline: bool = False,
        pcie_share: int | None = 0,
        decode_prefetch: int | None = None,
        loan_order: str = "profile",
    ):
        self.store, self.cache, self.residency = store, cache, cache.residency
        self.kernel_variant = kernel_variant  # GPU expert kernels: contract.KERNEL_VARIANTS (same bits)
        self.ring_overlap = ring_overlap  # prompt ring: two halves, copies on the ring stream (same bits)
        # decode on CUDA: the CPU pool's rows from a helper thread behind a host flag (DecodeRows)
        self.decode_cpu_thread = decode_cpu_thread
        # decode on CUDA: the whole token enqueued at once, a numba worker serving every layer's CPU rows
        # (PipelinedDecodeRows; the config's default; decode_cpu_thread, an explicit opt-in, wins over it)
        self.decode_pipeline = decode_pipeline
        # the pipelined decode: permille of a layer's misses the GPU reads over PCIe from the page-locked
        # store (contract.pcie_entries; layers not page-locked: none); None: this host's (experts/pcie_share),
        # resolved by resolve_pcie_share (warm_up: after the load's compiles, which would slow the measure)
        self._share_setting = pcie_share
        self.pcie_share = 0 if pcie_share is None else pcie_share
        self.host_gbs: float | None = None  # the host copy rate an unset share came from (measured once)
        # the pipelined decode: experts a page-locked layer copies ahead of its routing, from the routing
        # predicted beside its mixer (decode_pipeline; 0: none; None: its default, 2 in the token graphs)
        self.decode_prefetch = decode_prefetch
        self.device = torch.device(device)
        # On CUDA the caller's thread keeps launching GPU work while the CPU pool runs: leave it a core, so
        # no pool thread is descheduled inside a parallel region (the others would wait at its barrier).
        cuda = self.device.type == "cuda"
        spin_default(spare_core=cuda and cpu_count() > 2)  # the pool's threads spin between decode calls
        self.pool = pool or (CpuPool(cuda_pool_threads()) if cuda else default_pool())
        self._one_thread = CpuPool(1)  # runs jobs in the caller; never starts a thread
        # _token_forms' (layer, TokenLayer or None, its TokenMoe or None), by layer
        self._token_layers: dict[int, tuple] = {}
        self._blob_bytes = store.max_blob  # one expert's gate+up+down bytes (the largest layer's)
        self.rounds = rounds  # LocalRounds / CoordinatorRounds / None (no adaptive rounds)
        self.prior = prior
        self.n_layers, self.n_expert = self.residency.n_layers, self.residency.n_expert
        self.metrics = TierMetrics()
        self.heat = np.zeros((self.n_layers, self.n_expert), dtype=np.float64)  # [L, X] counts since start
        self._window = np.zeros((self.n_layers, self.n_expert), dtype=np.int64)  # this window's counts
        self._in_window = False
        # window_boundary's deferred parts: the closed window's counts, the round planned from them
        # (applied at the next boundary) and the copies of the round applied at this one (with a mark)
        self._closed: np.ndarray | None = None
        self._planned: list[Swap] = []
        self._copies: tuple[list, object] | None = None
        # a round's swaps in flight (they land at the next boundary): the rounds skip while they are, as the
        # reference skips a round while the last one's copies are pending; a loan's copies do not count
        self._round_in_flight = False
        # The one thread besides the caller that runs CPU pool calls (prompt misses beside the GPU's work,
        # decode rows with decode_cpu_thread). libgomp keeps an OpenMP team per thread that starts parallel
        # regions, and once its teams hold more threads than the machine has cores it drops the spin
        # between calls to 100 rounds (GOMP_SPINCOUNT's "more threads than CPUs" rule): a second master
        # thread undoes `spin_default`. So decode's pool calls and warm_up's run on one thread: this one
        # with decode_cpu_thread, else the caller's.
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-cpu-tier")
        self._pinned: dict[str, torch.Tensor] = {}  # staging buffers for host <-> device copies (CUDA)
        self.clock: LayerClock | None = None  # set to time each expert call (bench_tiers --layer-times)
        # the prompt ring: the half the next batch goes to (halves alternate across layers), and the batches
        # layers copied ahead for later ones; STRATA_STREAM_ALL=0 streams only the routed experts, one layer
        # at a time (the plan before session 8; same bits); STRATA_PREFETCH_LAYERS=1 copies one layer ahead,
        # not two (config checks the value)
        self._ring_half = 0
        self._prefetched: dict[int, tuple] = {}  # layer -> (ring half, ring items) copied ahead for it
        self.prefetches_used = 0  # ring batches a layer found already copied (tests, benchmarks)
        self.deep_prefetches = 0  # of those, copies issued two layers ahead (tests)
        self.stream_all = os.environ.get("STRATA_STREAM_ALL", "1") != "0"
        self._loan_order: np.ndarray | None = None  # the open loan's candidates, hottest first
        self._loan_at = 0  # the next of them
        self.loan_order = loan_order  # config.LOAN_ORDERS: "profile", or "prompt" (prompt_heat first)
        # [L, X] the last prompt's routing counts (every chunk since the last decode forward)
        self.prompt_heat = np.zeros((self.n_layers, self.n_expert), dtype=np.int64)
        self._decoding = True  # the last forward was a decode step (or none ran): a prompt starts afresh
        self.in_prompt = False  # inside prompt_forwards(): even a forward of a few tokens is a prompt's
        self.prefetch_deep = os.environ.get("STRATA_PREFETCH_LAYERS", "2") == "2"

    def use_coordinator(self, coordinator, send_every: int) -> None:
        """Let the coordinator actor decide the adaptive rounds (when this cache has rounds at all)."""
        if self.rounds is None:
            return
        coordinator.configure_rounds.remote(self.n_layers, self.n_expert)
        self.rounds = CoordinatorRounds(coordinator, self.n_layers, self.n_expert, send_every)

    @property
    def all_resident(self) -> bool:
        return self.residency.n_resident == self.n_layers * self.n_expert

    # -- the ExpertBackend -----------------------------------------------------------------------------
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        clock = self.clock
        if clock is not None:
            clock.start(layer)
        if not torch.autograd._profiler_enabled():  # record_function costs ~10 us a call even when idle
            out = self._experts(layer, x, ids, weights)
        else:
            with record_function("strata::experts"):  # named in torch.profiler traces (bench_tiers)
                out = self._experts(layer, x, ids, weights)
        if clock is not None:
            clock.end(layer)
        return out

    def _experts(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n_tok, k = ids.shape
        if layer == 0:
            self.start_forward(n_tok)
        decode = n_tok <= DECODE_MAX_TOKENS
        # decode: x comes along for the CPU tier (8 KB a token), in the same single sync as the ids
        ids_h, x_h = self.to_host(ids, x, with_x=decode or not self.cache.is_cuda)  # [M], [N, E]
        clock = self.clock
        if clock is not None:
            clock.point(layer, "sync")  # the routing's copy to the host (the device idles after it)
        t0 = time.perf_counter()
        m = ids_h.size
        trunk = layer < self.n_layers
        slot = self.residency.layer_slots(layer)[ids_h] if trunk else np.full(m, -1, np.int32)
        if m and not self.cache.is_cuda and not (slot >= 0).any():
            # every entry goes to the CPU pool and nothing can overlap it: compute here, in entry order,
            # without the helper thread's two handoffs or the scatter into `rows` (same kernel, same bits)
            return self._all_cpu(layer, x_h, ids_h, weights, n_tok, decode, t0)
        tok = np.arange(m, dtype=np.int64) // k  # entry m = token m // K, slot m % K
        hit = np.flatnonzero(slot >= 0)
        miss = np.flatnonzero(slot < 0)
        stream_misses = self.cache.is_cuda and not decode and miss.size > 0 and self.cache.ring_slots > 0
        cpu_misses = miss.size > 0 and not stream_misses
        if cpu_misses and x_h is None:  # a prompt chunk on CUDA without ring slots
            x_h = x.detach().float().cpu().numpy()
        rows = torch.empty((m, x.shape[1]), dtype=torch.float32, device=self.device)  # [M, E]
        cpu_job: Future | None = None
        if cpu_misses:  # CPU work first: it runs while the cache tier computes
            cpu_job = self._helper.submit(
                self._timed_cpu, x_h, tok[miss], ids_h[miss], self.store.layer(layer)
            )
        mode = "decode" if decode else "prompt"  # the GPU kernels' tile shape
        on_device = None
        if self.cache.is_cuda:  # every index the device needs, the tile plan included, in one copy
            plan = self._plan(slot[hit], mode, n_tok, layer)
            on_device = self._upload(tok[hit], slot[hit], hit, miss, *plan)
        if hit.size:
            self._cache_rows(layer, x, x_h, tok[hit], slot[hit], hit, rows, mode, on_device)
            if clock is not None:
                clock.point(layer, "hits")  # the host's planning and the resident experts' kernels
        if stream_misses:
            self._stream_rows(layer, x, tok[miss], ids_h[miss], miss, rows)
            if clock is not None:
                clock.point(layer, "stream")  # the ring batches: copies (waited for) and kernels
        host = time.perf_counter() - t0
        if cpu_job is not None:
            t1 = time.perf_counter()
            cpu_rows, cpu_s = cpu_job.result()
            t2 = time.perf_counter()
            if self.cache.is_cuda:
                rows[on_device[3]] = self._staged_rows(cpu_rows)
            else:
                rows[torch.from_numpy(miss)] = torch.from_numpy(cpu_rows)
            host += time.perf_counter() - t2
            self.count_cpu_seconds(max(cpu_s, t2 - t1), decode)
        out = self._combine(rows.view(n_tok, k, -1), weights.float())
        if trunk:
            self.count_entries(layer, ids_h, n_tok, hit.size, miss.size, decode, host)
        return out

    def _all_cpu(self, layer: int, x_h: np.ndarray, ids_h: np.ndarray, weights: torch.Tensor, n_tok: int,
                 decode: bool, t0: float) -> torch.Tensor:
        """A layer off CUDA whose every entry is the CPU pool's: its rows and their combine on this thread.
        One token on one thread takes the layer's TokenMoe (the rows and the combine with no Python between
        the kernels, the bits of the two calls); its time, combine included (~1 us), is CPU-pool time."""
        t1 = time.perf_counter()
        k = ids_h.size // n_tok
        pool = self.pool_for(ids_h)
        one, token_moe = self._token_forms(layer) if n_tok == 1 and pool is self._one_thread else (None, None)
        if token_moe is not None and token_moe_cpu_serves(weights):
            out = torch.from_numpy(token_moe(x_h, ids_h, weights.detach().float().numpy()))
            self.count_cpu_seconds(time.perf_counter() - t1, decode)
        else:
            tok = np.arange(ids_h.size, dtype=np.int64) // k  # entry m = token m // K, slot m % K
            cpu_rows = (expert_ffn_cpu_token(x_h, ids_h, one) if one is not None  # the same bits, less Python
                        else expert_ffn_cpu(x_h, tok, ids_h, self.store.layer(layer), pool=pool))
            self.count_cpu_seconds(time.perf_counter() - t1, decode)
            out = combine_rows(torch.from_numpy(cpu_rows).view(n_tok, k, -1), weights.float())
        if layer < self.n_layers:
            self.count_entries(layer, ids_h, n_tok, 0, ids_h.size, decode, t1 - t0)
        return out

    def _combine(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """combine_rows; on CUDA the one-launch kernel with the same bits."""
        if self.cache.is_cuda:
            from strata_ray.kernels.expert_gpu import combine_rows_gpu

            return combine_rows_gpu(rows, weights)
        return combine_rows(rows, weights)

    def _plan(self, slot: np.ndarray, mode: str, n_tok: int, layer: int) -> tuple[np.ndarray, ...]:
        """The GPU kernel's tile plan (order, sorted_slot, tile_start) for these slots, made on the host."""
        from strata_ray.kernels.expert_gpu import tile_entries

        experts = self.cache.layer_view(layer) if slot.size else None
        return plan_tiles_host(slot, tile_entries(n_tok, mode, self.kernel_variant, experts))

    def resolve_pcie_share(self) -> None:
        """An unset share (None): this host's (experts/pcie_share), measured once, where the decode can use
        one: the pipelined decode on CUDA, a cache that misses, some layer page-locked; else 0."""
        if self._share_setting is not None or self.host_gbs is not None:
            return
        if (self.device.type == "cuda" and self.decode_pipeline and not self.decode_cpu_thread
                and self.cache.n_slots < self.n_layers * self.n_expert
                and any(self.store.pinned_addresses(layer) is not None for layer in range(self.n_layers))):
            self.pcie_share, self.host_gbs = auto_pcie_share(self.pool)

    def warm_up(self) -> float:
        """Compile the expert kernels this backend calls (numba's first call compiles for 10-30 s, Triton's
        a few seconds), so that load time includes it and the first request's timings are real ones.
        Computes one expert row on zeros through each path: CPU one thread, the CPU pool (when this model's
        calls can reach it), and on CUDA the cache's decode kernel and the row combine; first resolves an
        unset PCIe share (the load's compiles are done by then). Returns seconds."""
        self.resolve_pcie_share()
        t = time.perf_counter()
        layer = min(self.store.layers)
        lay = self.store.layer(layer)
        x = np.zeros((1, lay.n_embd), np.float32)
        one = np.zeros(1, np.int64)
        expert_ffn_cpu(x, one, one, lay, pool=self._one_thread)
        # the pool's parallel kernel (its first compile takes minutes) only where a call can reach the pool:
        # a prompt chunk that touches every expert of a layer
        if self.pool.n_threads > 1 and self.n_expert * self._blob_bytes >= SINGLE_THREAD_BYTES:
            if (self.decode_cpu_thread or self.decode_pipeline) and self.cache.is_cuda:  # decode's thread
                self._helper.submit(expert_ffn_cpu, x, one, one, lay, pool=self.pool).result()
            else:
                expert_ffn_cpu(x, one, one, lay, pool=self.pool)
        if self.cache.is_cuda and (self.cache.n_slots or self.cache.ring_slots):
            self._warm_gpu_kernels()
        return time.perf_counter() - t

    def _warm_gpu_kernels(self) -> None:
        """Triton compiles a kernel per weight types and per specialization of its integer arguments (a
        count of 1, a multiple of 16, other): without this the first prompt chunk compiled the prompt
        tiles (seconds: the first `run bench` context ran at 40% of the second's speed). Each distinct
        (gate, up, down) type runs the decode tile on 1 entry and the prompt tile on 32 and 33 entries."""
        from strata_ray.kernels.expert_gpu import expert_ffn_gpu

        dev, seen = self.device, set()
        for layer in sorted(self.store.layers):
            lay = self.store.layer(layer)
            types = (lay.gate_type, lay.up_type, lay.down_type)
            if types in seen:
                continue
            seen.add(types)
            view = self.cache.layer_view(layer)
            for mode, m in (("decode", 1), ("prompt", 32), ("prompt", 33)):
                x_d = torch.zeros((m, lay.n_embd), dtype=torch.float32, device=dev)  # [M, E]
                tok = torch.arange(m, dtype=torch.int32, device=dev)
                slot = torch.zeros(m, dtype=torch.int32, device=dev)  # slot 0 (its bytes: any)
                expert_ffn_gpu(x_d, tok, slot, view, mode=mode, variant=self.kernel_variant)
            if self.cache.ring_slots:  # the prompt ring: its index upload, copies (the gather kernel), tiles
                m = 33
                x_d = torch.zeros((m, lay.n_embd), dtype=torch.float32, device=dev)  # [M, E]
                rows = torch.empty((m, lay.n_embd), dtype=torch.float32, device=dev)
                ids = np.arange(m, dtype=np.int64)
                self._stream_rows(layer, x_d, ids, ids % self.n_expert, ids, rows)
        self._combine(torch.zeros((1, 1, lay.n_embd), device=dev), torch.ones((1, 1), device=dev))
        torch.cuda.synchronize(dev)

    @property
    def cpu_thread(self) -> ThreadPoolExecutor:
        """The helper thread of CPU pool calls made beside the caller's work (see __init__)."""
        return self._helper

    def pool_for(self, experts: np.ndarray) -> CpuPool:
        """The pool for a CPU expert call over these experts: the caller's thread when the call is small."""
        # entries bound the distinct experts: np.unique (~8 us) only when the entries alone are not small
        small = (experts.size * self._blob_bytes < SINGLE_THREAD_BYTES
                 or np.unique(experts).size * self._blob_bytes < SINGLE_THREAD_BYTES)
        return self._one_thread if small else self.pool

    def _token_forms(self, layer: int) -> tuple[TokenLayer | None, TokenMoe | None]:
        """The layer's token_layer (expert_ffn_cpu_token's views, checked once) and its TokenMoe, or Nones
        where the token form does not fit it (float experts, a fused gate_up's strided halves): made once
        while the store holds the same layer object."""
        lay = self.store.layer(layer)
        kept = self._token_layers.get(layer)
        if kept is None or kept[0] is not lay:
            tl = token_layer(lay) if token_form_fits(lay) else None
            kept = self._token_layers[layer] = (lay, tl, TokenMoe(tl) if tl is not None else None)
        return kept[1], kept[2]

    def _timed_cpu(self, x_h, tok, exp, layer):
        t = time.perf_counter()
        rows = expert_ffn_cpu(x_h, tok, exp, layer, pool=self.pool_for(exp))
        return rows, time.perf_counter() - t

    # -- host <-> device, through pinned staging buffers -------------------------------------------
    def _staging(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host buffer of at least numel elements, kept and grown per name. Reuse is safe: every
        layer starts with a stream sync (`to_host`), after which the last layer's copies are done."""
        buf = self._pinned.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0), 1024), dtype=dtype,
                              pin_memory=True)
            self._pinned[name] = buf
        return buf[:numel]

    def to_host(self, ids: torch.Tensor, x: torch.Tensor, with_x: bool):
        """(ids int64 [M], x f32 [N, E] or None) as numpy. On CUDA: both copies into pinned buffers and one
        stream sync, instead of one blocking copy each. x_h is a view of a staging buffer: it is only
        valid during this layer (the CPU job that reads it is joined before the layer returns)."""
        if self.device.type != "cuda":
            return (ids.detach().to(torch.int64).reshape(-1).numpy(),
                    x.detach().float().numpy() if with_x else None)
        ids_pin = self._staging("ids", ids.numel(), torch.int64)
        ids_pin.copy_(ids.detach().reshape(-1), non_blocking=True)
        x_pin = None
        if with_x:
            x_pin = self._staging("x", x.numel(), torch.float32).view(x.shape)
            x_pin.copy_(x.detach(), non_blocking=True)
        t = time.perf_counter()
        torch.cuda.current_stream(self.device).synchronize()
        if self._in_window:
            self.metrics.counts.wait_seconds += time.perf_counter() - t
        return ids_pin.numpy().copy(), (x_pin.numpy() if x_pin is not None else None)

    def _upload(self, *arrays: np.ndarray, buffer: str = "index") -> list[torch.Tensor]:
        """int32 device tensors of these host index arrays, in one pinned host-to-device copy through the
        staging buffer `buffer` (one upload per buffer name and layer: the copy may still be in flight)."""
        # each array starts on a 16-byte boundary: Triton compiles a kernel once per pointer alignment
        # (16-byte aligned or not), so unaligned starts cost the first prompt a compile per new combination
        # of its index pointers (session 8: 4.4 s over its first layers)
        sizes = [a.size for a in arrays]
        padded = [-(-n // ALIGN_INT32) * ALIGN_INT32 for n in sizes]
        pin = self._staging(buffer, sum(padded), torch.int32)
        host, starts, at = pin.numpy(), [], 0
        for a, n, p in zip(arrays, sizes, padded, strict=True):
            host[at : at + n] = a
            starts.append(at)
            at += p
        dev = pin.to(self.device, non_blocking=True)
        return [dev[s : s + n] for s, n in zip(starts, sizes, strict=True)]

    def _staged_rows(self, cpu_rows: np.ndarray) -> torch.Tensor:
        """The CPU tier's rows f32 [m, E] on the device, copied through a pinned buffer."""
        pin = self._staging("rows", cpu_rows.size, torch.float32)
        pin.numpy()[:] = cpu_rows.reshape(-1)
        return pin.view(cpu_rows.shape).to(self.device, non_blocking=True)

    def _cache_rows(self, layer, x, x_h, tok, slot, entries, rows, mode, on_device=None) -> None:
        view = self.cache.layer_view(layer)
        if self.cache.is_cuda:
            from strata_ray.kernels.expert_gpu import expert_ffn_gpu

            tok_d, slot_d, entries_d = on_device[:3]
            out = expert_ffn_gpu(x, tok_d, slot_d, view, mode=mode, variant=self.kernel_variant,
                                 plan=on_device[4:7])
            rows[entries_d] = out
        else:
            rows[torch.from_numpy(entries)] = torch.from_numpy(
                expert_ffn_cpu(x_h, tok, slot, view, pool=self.pool_for(slot))
            )

    def _stream_rows(self, layer, x, tok, exp, entries, rows) -> None:
        """Prompt path: copy the non-resident experts into the ring slots, a batch at a time, and compute
        their entries there. Without ring_overlap a batch is the whole ring and the copies share the compute
        stream (a ring slot is only overwritten after the kernel that read it); with it, batches alternate
        between the ring's halves and their copies run on the ring stream while the other half computes.

        A chunk of STREAM_ALL_TOKENS or more streams every non-resident expert of the layer in id order
        (DESIGN section 8: such a chunk routes to nearly all of them), so the plan does not depend on the
        routing: the next layer's first batch is copied here, at the end of this layer, and its copies run
        beside the next layer's attention / GDN instead of after its routing."""
        from strata_ray.kernels.expert_gpu import expert_ffn_gpu

        ring = self.cache.ring_slots
        size = ring // 2 if self.ring_overlap else ring
        stream_all = self.ring_overlap and x.shape[0] >= STREAM_ALL_TOKENS and self.stream_all
        experts = self._streamed_experts(layer) if stream_all else np.unique(exp)
        prefetched = self._prefetched.pop(layer, None)
        batches = []  # (half, ring items, tok, ring slot, entry) per batch, host side
        for n, c0 in enumerate(range(0, experts.size, size)):
            batch = experts[c0 : c0 + size]
            half = (self._ring_half + n) % 2 if self.ring_overlap else 0
            first = half * size  # the batch's first ring slot
            ring_of = np.full(self.n_expert, -1, np.int64)
            ring_of[batch] = self.cache.ring_slot(first) + np.arange(batch.size)
            sel = np.flatnonzero(ring_of[exp] >= 0)
            batches.append((half, self._ring_items(layer, batch, first), tok[sel], ring_of[exp[sel]],
                            entries[sel]))
        if self.ring_overlap:
            self._ring_half = (self._ring_half + len(batches)) % 2
        # every batch's indices in one pinned copy: no host sync between batches, so the host fills the next
        # batch's staging buffers while the device computes this one
        on_device = self._upload(*(a for b in batches for a in b[2:]), buffer="ring_index")
        view = self.cache.layer_view(layer)
        for n, (half, items, *_) in enumerate(batches):
            tok_d, slot_d, entries_d = on_device[3 * n : 3 * n + 3]
            with record_function("strata::ring_copies"):  # once per ring batch: its cost does not matter
                if n == 0 and prefetched == (half, items):  # copied at the end of the previous layer
                    self.cache.ring_wait(half)
                    self.prefetches_used += 1
                elif self.ring_overlap:
                    self.cache.copy_ring(items, half)
                else:
                    self.cache.copy_blobs(items)
            out = expert_ffn_gpu(x, tok_d, slot_d, view, variant=self.kernel_variant)
            if self.ring_overlap:
                self.cache.ring_read(half)
            rows[entries_d] = out
        if stream_all:
            self._prefetch_ahead(layer, size)

    def _streamed_experts(self, layer: int) -> np.ndarray:
        """The experts a STREAM_ALL_TOKENS chunk streams at `layer`: every non-resident one, in id order."""
        if layer >= self.n_layers:  # the MTP layer: nothing of it is resident
            return np.arange(self.n_expert)
        return np.flatnonzero(self.residency.layer_slots(layer) < 0)

    def _prefetch_ahead(self, layer: int, size: int) -> None:
        """At the end of `layer`'s ring batches: copy the next layer's first batch into the next ring half,
        and, where the next layer's stream fits that one half, the layer after it into the half this layer
        just read (its copies wait on the ring stream for this layer's kernels).

        The host blocks at each layer's routing (its ids come to the host), so a copy issued one layer
        ahead starts only when the host gets past the next routing: the ring stream idled between a layer's
        copies and the next one's (session 18, 1K prefill: ~3-5 ms a layer). Two layers ahead, the ring
        stream always holds the next copy and PCIe stays busy."""
        nxt = layer + 1
        if nxt >= self.n_layers:
            return
        if nxt not in self._prefetched:
            self._prefetch(nxt, size, self._ring_half)
        if self.prefetch_deep and nxt + 1 < self.n_layers and nxt + 1 not in self._prefetched:
            if 0 < self._streamed_experts(nxt).size <= size:  # the next layer: one batch, one half
                self._prefetch(nxt + 1, size, (self._ring_half + 1) % 2)
                self.deep_prefetches += 1

    def _prefetch(self, layer: int, size: int, half: int) -> None:
        """Copy `layer`'s first ring batch into ring half `half` now, without the compute stream waiting:
        the batch _stream_rows will plan there (residency does not change inside a forward)."""
        batch = self._streamed_experts(layer)[:size]
        if not batch.size:
            return
        items = self._ring_items(layer, batch, half * size)
        self.cache.copy_ring(items, half, wait=False)
        self._prefetched[layer] = (half, items)

    def _ring_items(self, layer: int, batch: np.ndarray, first: int) -> list[tuple[int, int, int]]:
        """(layer, expert, ring slot) copies of `batch` into the ring from its slot `first` on."""
        return [(layer, int(e), self.cache.ring_slot(first + i)) for i, e in enumerate(batch)]

    def count_entries(
        self, layer: int, ids_h: np.ndarray, n_tok: int, hits: int, misses: int, decode: bool, host: float,
        pcie: int = 0,
    ) -> None:
        """misses: entries the CPU pool computed; pcie: misses the GPU computed from the host store."""
        c = self.metrics.counts
        if not decode or self.in_prompt:  # a short prompt on the pipelined decode: its PCIe entries too
            c.prompt_entries += hits + misses + pcie
            self.prompt_heat[layer] += np.bincount(ids_h, minlength=self.n_expert)
            return
        self._window[layer] += np.bincount(ids_h, minlength=self.n_expert)  # +1 per routed entry
        c.slot_hits += hits
        c.cpu_entries += misses
        c.pcie_entries += pcie
        c.host_seconds += host
        if layer == 0:
            c.windows += 1
            c.tokens += n_tok

    def decode_rows(self, n_embd: int, k: int, capture: bool):
        """A DecodeRows over these tiers: the one-token step with fixed shapes, for the decode graphs; with
        decode_pipeline (captured, CUDA, quantized experts) its pipelined twin."""
        from strata_ray.experts.decode_pipeline import PipelinedDecodeRows, pipeline_supported
        from strata_ray.experts.decode_rows import DecodeRows

        if (self.decode_pipeline and not self.decode_cpu_thread and capture and self.cache.is_cuda
                and pipeline_supported(self)):
            return PipelinedDecodeRows(self, n_embd, k, capture)
        return DecodeRows(self, n_embd, k, capture)

    # -- windows and adaptive rounds ------------------------------------------------------------------
    def count_cpu_seconds(self, seconds: float, decode: bool = True) -> None:
        """A decode forward's CPU-pool time, into the metrics: not a short prompt's (prompt_forwards), nor a
        token's launched in one (decode False: the pipelined decode joins it later), as count_entries."""
        if decode and not self.in_prompt:
            self.metrics.counts.cpu_seconds += seconds

    @contextmanager
    def prompt_forwards(self):
        """The forwards inside are a prompt's, whatever their size: a prompt of <= DECODE_MAX_TOKENS tokens
        runs the decode's kernels but opens no decode window, and its entries count as prompt entries (not
        in the hit rates, the adaptive usage or the host time per token). generate() wraps its prompt. A
        one-token prompt on the CUDA pipelined decode is joined maybe after the prompt: its token keeps the
        flag from its launch (decode_pipeline._LaunchedToken.decode)."""
        self.in_prompt = True
        try:
            yield
        finally:
            self.in_prompt = False

    def start_forward(self, n_tok: int, defer: bool = False) -> None:
        """Layer 0 of a forward: close the previous window; a forward of <= DECODE_MAX_TOKENS opens one.
        defer (the pipelined decode, before it launches the token): the closed window's accounting, the
        round it may plan and the copies of the round applied here wait for after_launch(), which the
        caller runs once the token is launched, beside its device work."""
        self._prefetched = {}  # a prefetch is only used by the forward that made it
        decode = n_tok <= DECODE_MAX_TOKENS  # the decode's kernels and loan, for a short prompt too
        prompt = not decode or self.in_prompt
        if prompt and self._decoding:  # a new prompt: its routing counts alone
            self.prompt_heat[:] = 0
        if not decode:
            self._close_loan()  # before this prompt's first ring copies
        self._decoding = not prompt
        self.window_boundary(defer=defer, lend=decode)
        self._in_window = not prompt

    def window_boundary(self, defer: bool = False, lend: bool = False) -> None:
        """Close the previous window: land the swaps in flight, apply the round planned after the last
        boundary (its victims leave now; its newcomers' copies start in after_launch), and hand the closed
        window's counts to the rounds (in after_launch: now unless defer). A round so takes effect one
        window after the window that planned it, on every decode path alike (placement only: the output
        does not depend on it), and its planning and copies stay off the path between two tokens."""
        if self._closed is not None:  # the last boundary's deferred part never ran (its token failed)
            self.after_launch()
        self._land()
        planned, self._planned = self._planned, []
        if planned and not self.cache.swaps_in_flight():
            self._copies = (self.residency.schedule_swaps(planned), self.cache.mark())
            self.metrics.counts.swaps += len(self._copies[0])
            self._round_in_flight = bool(self._copies[0])
        if lend and self.residency.n_lendable and not self._copies and not self.cache.swaps_in_flight():
            self._lend_step()
        if self._in_window:
            self._in_window = False
            self._closed, self._window = self._window, np.zeros_like(self._window)
        if not defer:
            self.after_launch()

    def after_launch(self) -> None:
        """The boundary's deferred part: the applied round's copies (ordered after the work enqueued before
        the boundary, whose reads of the victims' slots they must follow), then the closed window's counts
        to the heat, the metrics and the rounds; a round planned now is applied at the next boundary."""
        self._issue_copies()
        counts, self._closed = self._closed, None
        if counts is None:
            return
        self.heat += counts
        self.metrics.window_done()
        if self.rounds is None or self.all_resident:
            return
        resident = self.residency.resident_mask(include_pending=True)
        self._planned = self.rounds.window_done(counts, resident, self._round_in_flight)

    def _issue_copies(self) -> None:
        copies, self._copies = self._copies, None
        if copies is not None:
            self.cache.issue_swaps(*copies)

    def _land(self) -> None:
        """Land the pending round's copies (a round counts when its newcomers become resident) or a loan's
        step; copies not yet issued (a token that failed before its after_launch) start first."""
        self._issue_copies()
        landed = self.cache.land_swaps()
        self._round_in_flight = False
        if any(c.slot < self.residency.n_slots for c in landed):
            self.metrics.counts.rounds += 1

    # -- a loan of the ring's slots while decoding (residency.open_loan) -------------------------------
    def _lend_step(self) -> None:
        """The next LOAN_STEP of the hottest non-resident pairs (the learned profile's order: heat since
        start, then the prior profile; with loan_order "prompt" the last prompt's routing counts first)
        into the loan's slots, as a boundary's copies; the loan opens at the first step after a prompt."""
        res = self.residency
        if not res.loan_open:
            res.open_loan()
            self.cache.lend_ring()
            order = self.learned_profile().pair_ids()
            if self.loan_order == "prompt":  # the prompt's hottest first, ties in the profile's order
                order = order[np.argsort(-self.prompt_heat.reshape(-1)[order], kind="stable")]
            self._loan_order = order[~res.resident_mask(include_pending=True).reshape(-1)[order]]
            self._loan_at = 0
        if not res.lent_free or self._loan_at >= self._loan_order.size:
            return
        batch = self._loan_order[self._loan_at : self._loan_at + LOAN_STEP]
        self._loan_at += batch.size
        copies = res.lend(batch, LOAN_STEP)
        if copies:
            self._copies = (copies, self.cache.mark())
            self.metrics.counts.loaned += len(copies)

    def _close_loan(self) -> None:
        """Give the ring's slots back before a prompt streams through them: their pairs leave now, a loan step
        not yet issued is dropped, and the ring's next copies wait for the reads and copies in flight."""
        res = self.residency
        if not res.loan_open:
            return
        res.close_loan()
        if self._copies is not None:
            kept = [c for c in self._copies[0] if c.slot < res.n_slots]
            self._copies = (kept, self._copies[1]) if kept else None
        self.cache.reclaim_ring()
        self._loan_order = None

    def _schedule(self, swaps: list[Swap]) -> None:
        """Start a round's swaps now (victims leave, newcomers copy) unless the last round's are in flight."""
        if swaps and not self.cache.swaps_in_flight():
            copies = self.residency.schedule_swaps(swaps)
            self.cache.issue_swaps(copies)
            self.metrics.counts.swaps += len(copies)
            self._round_in_flight = bool(copies)

    def finish(self) -> None:
        """End of a generation: close the last window, so its counts and swaps are not lost, apply the round
        it planned, land the round still in flight at the coordinator, then plan and land the rounds still
        due there: every round of the request's windows is planned before it ends, none in the next one."""
        self.window_boundary()
        self._land()
        planned, self._planned = self._planned, []
        self._schedule(planned)
        if self.rounds is not None and not self.all_resident:
            self._land()
            self._schedule(self.rounds.drain())
            self._land()
            self._schedule(self.rounds.flush(self.residency.resident_mask(include_pending=True)))
        self._land()
        self.metrics.flush()  # the request's counts to Ray's metrics now: a short request flushes no window

    # -- the learned profile ---------------------------------------------------------------------------
    def learned_profile(self, model: bytes | None = None) -> Profile:
        return learned_profile(self.residency.resident_mask(include_pending=True), self.heat, self.prior,
                               model=model)

    @functools.cached_property
    def model_digest(self) -> bytes:
        """The model's routing identity (model/routing_digest), saved with the learned profile: hashed at
        the first save, not at every start (most runs save nothing)."""
        return routing_digest(self.store.file)

    def save_profile(self, path: str) -> None:
        write_profile(path, self.learned_profile(model=self.model_digest))

    def summary_line(self, since=None) -> str:
        """The tiers' line since load, or since a metrics.snapshot() (one request's)."""
        return self.metrics.line(since)

    def close(self) -> None:
        self._helper.shutdown(wait=True)
        self._one_thread.close()
        self.cache.close()
