"""PipelinedDecodeRows: DecodeRows' twin with no host work per layer (STRATA_DECODE_PIPELINE=1, CUDA only).

On the H200 (session 6, bench_tiers at 8K, 24 GiB budget): 33.7 tok/s against DecodeRows' 23.4.

DecodeRows syncs the host with the device at every layer (the routing), classifies the entries, and
computes or hands off the CPU rows with Python around them: ~0.9 ms a layer on the H200 host. Here the host
enqueues a whole token at once, and one nogil numba call per token (kernels/cpu_token_rows.CpuTokenRows, on
the tiers' CPU thread) serves every layer's CPU rows:

    device, layer l:  [segment l: ... router]  [layer graph: ids, x -> pinned, routed := v_l (one kernel,
                      kernels/publish) | the shared expert, forked | resident rows: the slot of each entry
                      from the device residency table, the tile plan on the device, the cache kernels]
                      wait rows >= v_l  [segment l+1: combine, reading the worker's rows in place ...]
    worker, layer l:  wait routed >= v_l -> classify by the host table -> the CPU rows -> rows := v_l

rows() = where(hit, gpu rows, cpu rows[inv]) [K, E], combined in k order as everywhere: the same kernels
and the same combine as DecodeRows, so the same bits. The tables change only at window boundaries
(layer 0 of a token, before the worker starts), so host and device agree on every entry.

With `tiers.pcie_share` (STRATA_PCIE_SHARE) the device also computes the first pcie_entries(M, share) of a
layer's M misses (k order; contract.pcie_entries; kernels/decode_plan.decode_plan_pcie, the same rule as the
worker's), while the worker computes the others: the CPU rows, which bound the budget decode, shrink by that
share. On a forked stream, beside the resident tiles, one kernel copies those experts whole from the
page-locked host store into K staging slots over PCIe (kernels/gather_copy.stage_experts), then the expert
tiles read them there. Layers not page-locked keep every miss on the CPU. The same kernels over the same
bytes: the same bits. (Session 10: the tiles reading the host store in place ran at 21 GB/s.)

With `tiers.decode_prefetch` (STRATA_DECODE_PREFETCH = C) the device also copies experts ahead of the
routing. Once a page-locked layer's input is in its buffer (the decode graphs split the layer's first
segment there and call `ahead_begin`), a graph on a stream of its own routes that input (the MoE's norm and
router over the residual before the mixer, which adds little to it: on the synthetic 80b-a3b 98.5% of the
copies were routed), decode_plan.prefetch_pick takes the first C predicted experts that are not resident,
and stage_experts copies them into staging slots K..K+C-1 with a few programs, beside the layer's mixer,
while the host's memory and PCIe are otherwise idle (the CPU waits for the routing then). The layer graph's
plan gives the routed misses among them to the GPU first, then the share of the others; publish hands the
staged list to the worker, which applies the same rule. A graph of their own computes their rows once the
plan is done and the copies have landed (`_ahead_rows`), beside the CPU rows; the next layer waits for it.
Events the host enqueues tie these graphs to the layer graphs (input ready -> pick -> the layer graph, whose
plan and publish read the staged list; copies landed and plan done -> tiles -> the next layer), so no copy
holds the mixer up (joined
inside the segment's graph, two copies a layer cost more than they saved: 82.3 against 94.5 tok/s). A
wrong prediction costs its copy only; the rows have the same bits wherever they are computed.

Warming (`warm`: STRATA_DECODE_WARM, with copies ahead). While a layer's mixer runs on the device, the host's
cores wait for its routing and its memory is idle, yet the CPU rows that follow read their experts' bytes
from DRAM: with 14 cores ~40 us an expert, against a mixer of ~50-120 us. So the pick also hands its
prediction to the worker (publish with no x: the predicted ids and the staged list into page-locked
buffers, then `predicted` := base + layer), and each member of the worker's team reads, one byte a cache
line, the share of the predicted CPU experts' weights that it will compute (expert_cpu_token.warm_share),
until the routing comes. Then the rows read those bytes from the core's own cache. Only the time moves: the
rows come from the real routing, with the same kernels, so the same bits; a wrong prediction costs reads
of idle memory.

The token graphs (`token_graph`: STRATA_TOKEN_GRAPH, on by default; session 24 made it the all-resident
decode's default too, where with the chain it measured 236-237 tok/s at 8K against ~200). Each
graph launch cost the H200 host 20-60 us in the real decode (session 20: 109 launches a token, 5 a staged
layer with copies ahead), and with copies ahead the host, not the device or the worker, set the pace: the
device sat idle between a layer's graphs. So the decode graphs capture a run of layers as one graph
(token_begin, then token_ahead / token_layer inside the capture, token_end): the same bodies, the events
between the streams as edges inside the graph, and the wait for the worker's rows a one-thread kernel that
spins on the host flag until it reaches base + layer, base read from the device (kernels/flag_wait), so
the graph serves every token. With the device attention a token is one launch. Where the cache holds
every expert, resident tokens replay token graphs of their own, captured without the flag waits
(`resident_graphs`, `resident_form`: session 41, +5.5% at 8K on an H100); a resident token in the other
graphs gets a base too, its flag raised at once.

A token while every expert is resident (`tiers.all_resident`: a card that holds the model) has no CPU rows:
no worker, no waits; a layer is its graph (whose publish also leaves the ids in a pinned row for the window
counts). On the H200 at 8K that removed ~0.2 ms a layer of round trips (session 9). Session 11 moved the
host's per-layer copies and flag write into the graph (one kernel) and let the combine read the worker's
rows where it wrote them: a layer is two graphs and a wait (with STRATA_TOKEN_GRAPH=0; by default the
token graphs make the token one launch, with no flag waits: the resident graphs above). Such a token has no
host wait
at all, so the chained greedy decode (DecodeGraphs.chain) launches the next one before it is joined; each
token's ids are then copied out at its end, before the next token's publish overwrites them
(`_resident_ids`).
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from strata_ray.experts.slot_cache import blob_views
from strata_ray.kernels.block_dots import HALF_ROWS, ROWS
from strata_ray.kernels.contract import QK, ExpertLayer
from strata_ray.kernels.cpu_token_rows import CpuTokenRows, TokenOutputs
from strata_ray.kernels.expert_cpu_token import COUNTER, DYNAMIC, GATHER
from strata_ray.kernels.flag_wait import wait_flag
from strata_ray.kernels.fused_small import fused_enabled, gather_rows
from strata_ray.kernels.gather_copy import ahead_programs, share_programs, stage_experts, stage_table
from strata_ray.kernels.publish import ActCodes, publish
from strata_ray.kernels.stream_flags import HostFlag
from strata_ray.model.graph_capture import capture_graph

# experts a layer copies ahead of its routing by default in the token graphs: on the H200 at 8K, 24 GiB card
# (session 20, one host): 77.2 tok/s with none, 87.0 with 2 (both with the device attention); 3 without it
# measured below 2 (77.1 against 79.0-80.6)
TOKEN_GRAPH_PREFETCH = 2
# whether the worker reads each layer's predicted CPU rows ahead (STRATA_DECODE_WARM unset) where a layer
# copies experts ahead (its prediction is there)
DECODE_WARM = False


TEAM_FORMS = {"counter": COUNTER, "gather": GATHER, "dynamic": DYNAMIC}


def team_form() -> int:
    """STRATA_TEAM_FORM: how the CPU team's members meet and share a layer's rows (kernels/expert_cpu_token,
    the same rows in every form): "gather" (default: gathered barriers, fixed shares), "dynamic" (gathered
    barriers, units taken from a counter: slower at 3 entries a layer in session 28, its scattered units
    stream worse than a member's contiguous share) or "counter" (one shared barrier counter, fixed shares:
    the form before session 28)."""
    return TEAM_FORMS[os.environ.get("STRATA_TEAM_FORM", "") or "gather"]


def down_prefetch() -> bool:
    """STRATA_DOWN_PREFETCH: "1" the CPU team's members prefetch their down units after their gate/up
    shares, "0" or unset off (config refuses other values): on the H200 the down share got faster and the
    gate/up wait longer by as much (session 29, two interleaved pairs at two placements: no change)."""
    return os.environ.get("STRATA_DOWN_PREFETCH", "") == "1"


def team_unit_rows() -> int:
    """STRATA_TEAM_UNITS: the weight rows of a CPU team member's gate/up unit: "half" (default) HALF_ROWS,
    "whole" ROWS (the unit before session 30: at one CPU entry, 32 units over 15 members gave two members a
    unit more than member 0; the same rows either way)."""
    return ROWS if os.environ.get("STRATA_TEAM_UNITS", "") == "whole" else HALF_ROWS


def ahead_layer() -> str:
    """STRATA_AHEAD_LAYER: where a layer's copies ahead are picked. "next" (default): from the input of the
    layer before (the picked layer's norm and router over that earlier residual; layer 0 keeps its own), so
    the copies queue behind the layer before's own and land a layer earlier, filling the PCIe link's idle
    time between layers (session 28's trace: 40-60 us a layer); wrong a little more often
    (scripts/routing_ahead.py: the first 2 picked routed 85-91% of the time against 95% on the synth family,
    61-63% against 74% on the embedded model). "same": from the layer's own input, beside its mixer. "next"
    needs a token to be one graph (the device attention, STRATA_TOKEN_GRAPH_LAYERS unset: a fork joins
    inside its piece); elsewhere "same". Session 36 on the H200 (80b-a3b synth, 24 GiB card, two
    interleaved pairs): 1K 161.4 / 160.4 against 149.3 / 149.2 tok/s for "same", 8K 170.8 / 170.6 against
    160.3 / 159.9."""
    return os.environ.get("STRATA_AHEAD_LAYER", "") or "next"


def pinned_block(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zeroed tensors of the given (shape, dtype) as views of one page-locked block, each at a 64-byte
    boundary (a cache line of its own)."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // 64) * 64
    block = torch.zeros(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    return [block[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for o, (shape, dtype) in zip(offsets, specs, strict=True)]


def decode_warm() -> bool:
    """STRATA_DECODE_WARM: "1" on, "0" off, unset DECODE_WARM (config refuses other values)."""
    v = os.environ.get("STRATA_DECODE_WARM", "")
    return DECODE_WARM if v == "" else v == "1"


class PipelinedDecodeRows:
    """One token's K routed rows per layer for the decode graphs, with the whole token enqueued at once."""

    def __init__(self, tiers, n_embd: int, k: int, capture: bool):
        if not (capture and tiers.cache.is_cuda):
            raise ValueError("the pipelined decode needs CUDA graphs on a CUDA slot cache")
        self.tiers, self.k = tiers, k
        dev = tiers.device
        self.gpu_rows = torch.zeros((k, n_embd), dtype=torch.float32, device=dev)  # [K, E] resident rows
        self.cpu_rows = torch.zeros((k, n_embd), dtype=torch.float32, device=dev)  # [M <= K, E] the misses'
        self.hit = torch.zeros(k, dtype=torch.int32, device=dev)  # [K] 1 where resident (device plan)
        self.inv = torch.zeros(k, dtype=torch.int32, device=dev)  # [K] a miss's row in cpu_rows (worker)
        self.tok = torch.zeros(k, dtype=torch.int32, device=dev)  # every entry is token 0
        self._ident = torch.arange(k, dtype=torch.int32, device=dev)  # [K] the down launches' rows
        # the routing the device hands the worker each layer: ids [K] and the layer input's codes (contract
        # step 1, quantized by publish), in one page-locked block (one page at 2048 values: member 0's copy of
        # three separately allocated buffers cost ~5.5 us a layer whatever their size, session 29, a page walk
        # each being the guess; the members now read the codes in place, and the block's own share of the
        # gain was not measured apart)
        nb = n_embd // QK
        self._ids_pin, *codes = pinned_block([((k,), torch.int64), ((1, n_embd), torch.int8),
                                              ((1, nb), torch.float32), ((1, nb), torch.int32)])
        self._codes_pin = ActCodes(*codes)
        # the device's own copy of the codes, for its rows (static: the layer graphs read them)
        self._codes = ActCodes(torch.zeros((1, n_embd), dtype=torch.int8, device=dev),
                               torch.zeros((1, nb), dtype=torch.float32, device=dev),
                               torch.zeros((1, nb), dtype=torch.int32, device=dev))
        self._rows_pin = torch.zeros((k, n_embd), dtype=torch.float32, pin_memory=True)  # [K, E] the worker's
        self._inv_pin = torch.zeros(k, dtype=torch.int32, pin_memory=True)  # [K]
        self.routed, self.rows_flag = HostFlag(dev), HostFlag(dev)
        layers = [tiers.store.layer(layer) for layer in range(tiers.n_layers)]
        # the misses the device copies over PCIe and computes: each page-locked layer's share, its parts'
        # staging table, and K staging slots for all layers (the forked stream orders them)
        self.shares = [0] * tiers.n_layers
        self._stage: dict[int, tuple[torch.Tensor, int, ExpertLayer]] = {}
        self.staging = None
        # no share when the cache holds every expert: an all-resident token then launches no staging tiles
        partial = tiers.cache.n_slots < tiers.n_layers * tiers.n_expert
        tiers.resolve_pcie_share()  # an unset share, where warm_up did not run first (idempotent)
        # the token graphs (token_begin ... token_end: the decode graphs capture runs of layers as one graph,
        # the worker's rows waited for inside) and the experts a layer copies ahead of its routing
        token_env = os.environ.get("STRATA_TOKEN_GRAPH", "")
        self.token_graph, self.ahead = token_graph_and_ahead(partial, token_env, tiers.decode_prefetch)
        # copies ahead picked a layer early (STRATA_AHEAD_LAYER=next): layer l + 1's copies and staged list
        # are written while layer l's are still read, so both are double-buffered by layer parity (a layer's
        # copies land in its parity's staging, its plan and tiles read them there); the decode graphs turn
        # it back to the same layer's pick where a token is not one graph (set_ahead_next)
        self.ahead_next = bool(self.ahead) and self.token_graph and ahead_layer() == "next"
        self.stagings: list[torch.Tensor] = []
        if (tiers.pcie_share or self.ahead) and partial:
            # [K + C, blob]: slot k for entry k's copy after the routing, K + c for the experts copied ahead
            blob = tiers.store.max_blob
            self.stagings = [torch.empty((k + self.ahead, blob), dtype=torch.uint8, device=dev)
                             for _ in range(2 if self.ahead_next else 1)]
            self.staging = self.stagings[0]
            for layer in range(tiers.n_layers):
                parts = tiers.store.pinned_addresses(layer)
                if parts is not None:
                    self._stage[layer] = _staging_plan(parts, tiers.store.layouts[layer],
                                                       self._staging_of(layer))
                    self.shares[layer] = tiers.pcie_share
        if not self._stage:
            self.ahead = 0
            self.ahead_next = False
        # the experts copied ahead for the layer being planned (int32 [C], -1: none: also every layer that
        # copies none, so the worker never sees another layer's list) and the pick's starts; the worker's copy
        # (by layer parity where the pick is a layer early: _ahead_of)
        self._ahead_experts = [torch.full((max(1, self.ahead),), -1, dtype=torch.int32, device=dev)
                               for _ in range(2 if self.ahead_next else 1)]
        self._ahead_starts = [torch.full((max(1, self.ahead),), -1, dtype=torch.int32, device=dev)
                              for _ in range(2 if self.ahead_next else 1)]
        self._no_ahead = torch.full((max(1, self.ahead),), -1, dtype=torch.int32, device=dev)
        self._staged_pin = torch.full((max(1, self.ahead),), -1, dtype=torch.int64, pin_memory=True)
        # the worker reads each layer's predicted CPU rows ahead while its mixer runs (STRATA_DECODE_WARM):
        # the pick also hands the prediction and the staged list over (ids into _pred_pin, the list into
        # _pred_staged_pin, then `predicted` := base + layer)
        # (not with the pick a layer early: the prediction's buffers hold one layer's, which the worker may
        # still read when the next layer's pick would write them)
        self.warm = bool(self.ahead) and decode_warm() and not self.ahead_next
        self.predicted = HostFlag(dev)
        self._pred_pin = torch.zeros(k, dtype=torch.int64, pin_memory=True)  # [K]
        self._pred_all = torch.zeros((tiers.n_layers, k), dtype=torch.int64, pin_memory=True)  # [L, K]
        self._pred_staged_pin = torch.full((max(1, self.ahead),), -1, dtype=torch.int64, pin_memory=True)
        # the layer plan's tensors, static: the ahead tiles' graphs read them (order, slot, tile_start,
        # host_slot, host_start, pcie_slot, ahead_start; decode_plan.decode_plan_pcie)
        self._plan_out = tuple(torch.full((k,), -1, dtype=torch.int32, device=dev) for _ in range(7))
        # the copies ahead and their tiles: a graph of each a staged layer, each on a stream of its own, tied
        # to the layer graphs by events (input ready, copies landed, plan done, tiles done) the host enqueues
        self._ahead_stream, self._tile_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        self._pick_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._copy_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._tile_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # (input ready, picked, copies landed, plan done, tiles done) a layer
        self._events = {layer: tuple(torch.cuda.Event() for _ in range(5)) for layer in self._stage} \
            if self.ahead else {}
        self._ahead_begun: set[int] = set()
        self.worker = CpuTokenRows(
            layers, tiers.residency.res, k, tiers.pool.n_threads,
            buffers={"ids": self._ids_pin.numpy(), "xq": self._codes_pin.q.numpy(),
                     "xd": self._codes_pin.d.numpy(), "xs": self._codes_pin.s.numpy(),
                     "rows": self._rows_pin.numpy(),
                     "inv": self._inv_pin.numpy(), "routed": self.routed.host,
                     "rows_flag": self.rows_flag.host, "staged": self._staged_pin.numpy(),
                     "predicted": self.predicted.host, "pred_ids": self._pred_pin.numpy(),
                     "pred_staged": self._pred_staged_pin.numpy()},
            n_staged=max(1, self.ahead), warm=self.warm, form=team_form(), prefetch=down_prefetch(),
            unit_rows=team_unit_rows())
        self.worker.shares[:] = self.shares
        # called with each joined token's worker outputs (a benchmark's per-layer accounting; None: nothing)
        self.on_worker_outputs: Callable[[TokenOutputs], None] | None = None
        self._fork = torch.cuda.Stream(dev)  # the PCIe tiles' stream (captured as a fork of each layer graph)
        self._beside = torch.cuda.Stream(dev)  # capture_all's `besides`, forked beside the layer's rows
        self._base_dev = torch.zeros(1, dtype=torch.int64, device=dev)  # [1] this token's flag base
        # the fused combine reads the worker's rows and their index in the page-locked buffers themselves
        # (no copies up a layer: ~20 us of the layer's path on the H200, session 11); the torch form reads
        # device copies
        self.zero_copy = fused_enabled(self.gpu_rows, 1)
        self.table = tiers.residency.device_table(dev)  # [L * X] int32, refreshed in place
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # the launched tokens not yet joined, oldest first (_LaunchedToken): one, or two where the chained
        # decode launches token N+1 before it joins token N. Each a worker job (the one worker thread runs
        # them in order), reading a snapshot of the residency table taken at its token's boundary (two,
        # alternating: a boundary may change the residency while the token before it still runs) and
        # returning copies of its outputs; or an all-resident token's ids
        self._tokens: deque[_LaunchedToken] = deque()
        self._res_snaps = [tiers.residency.res.copy() for _ in range(2)]
        self._n_tokens = 0
        # the chained decode (DecodeGraphs.chain) overlaps two tokens: where the token graphs wait for the
        # worker inside (a per-layer step waits on the host), or where every expert is resident (no worker)
        self.can_chain = self.token_graph or not partial
        # a token while every expert is resident (an 80 GiB card): no worker, no flags, no CPU rows; the
        # ids still come back for the window counts: the layer graphs' publish writes them into one pinned
        # row a layer, which the next token overwrites, so at the token's end they are copied through the
        # device into a page-locked copy of the token's own (two, alternating: at most two tokens are
        # launched), read after the event behind that copy
        self._resident_token = False
        # where the cache holds every expert (the token graphs on an 80 GiB card) the decode graphs capture a
        # second set of token graphs for resident tokens (resident_graphs), captured with resident_form on:
        # no wait for the worker's flag (a launch reading host memory, ~2 us a layer on the H100, session 41)
        # and a combine that reads the device's rows alone (every entry a hit: the same rows, the same bits)
        self.resident_graphs = self.token_graph and not partial
        self.resident_form = False
        self._ids_all = torch.zeros((tiers.n_layers, k), dtype=torch.int64, pin_memory=True)  # [L, K]
        self._ids_dev = torch.zeros((tiers.n_layers, k), dtype=torch.int64, device=dev)  # [L, K]
        self._ids_snaps = [torch.zeros((tiers.n_layers, k), dtype=torch.int64, pin_memory=True)
                           for _ in range(2)]  # [L, K] each
        self._ids_done = [torch.cuda.Event() for _ in range(2)]
        self._n_resident = 0
        self._host = 0.0  # this token's enqueue time on the host (metrics: host ms per token)
        self._finished_at: float | None = None  # when finish() joined the worker (metrics: the gap)
        # the gap's parts, summed over tokens (seconds; bench_tiers reports them a token): the rest of
        # finish() after the join, the caller's time until the next token_begin (its wait for the head,
        # sampling, the step's prologue), token_begin itself, and the launches (to token_end). One token at a
        # time the device idles through them; chained, it runs the token launched ahead meanwhile
        self.gap_parts = [0.0, 0.0, 0.0, 0.0]
        self._stamps = [0.0, 0.0]  # finish()'s end, token_begin's end
        # and the device's idle time between two tokens, by timing events: one after a token's launches, one
        # before the next token's (done when the device reaches it: at once where it idles, at the end of the
        # token before where that still runs, as in the chained decode); the pairs are read once done
        self.device_idle = 0.0
        self._token_done: torch.cuda.Event | None = None
        self._idle_pairs: deque = deque()
        self._base = 1  # v_l = base + l; the flags start at 0, below it
        self._token_base, self._token_t0 = 0, 0.0
        self._predicts: list[Callable[[], torch.Tensor]] | None = None  # capture_all's, for token_ahead

    # -- the captured part ------------------------------------------------------------------------------
    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gpu rows [K, E], cpu rows [K, E], hit int32 [K], inv int32 [K]): the combine reads entry k's row
        from gpu rows where hit, else cpu rows[inv[k]] (kernels/fused_small.gather_rows); with zero_copy
        the cpu rows and inv are the worker's page-locked buffers."""
        if self.zero_copy:
            return self.gpu_rows, self._rows_pin, self.hit, self._inv_pin
        return self.gpu_rows, self.cpu_rows, self.hit, self.inv

    def rows(self) -> torch.Tensor:
        """[K, E]: each entry's row from the tier that computed it (captured into the combine's graph)."""
        return gather_rows(self.gpu_rows[None], self.cpu_rows, self.hit[None], self.inv[None])[0]

    # -- the copies ahead of the routing (STRATA_DECODE_PREFETCH) ------------------------------------------
    def _staging_of(self, layer: int) -> torch.Tensor:
        """The staging slots the layer's copies land in: its parity's where the pick is a layer early."""
        return self.stagings[layer % len(self.stagings)]

    def _ahead_of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts, experts) of the layer's staged list (prefetch_pick's outputs), its parity's."""
        i = layer % len(self._ahead_experts)
        return self._ahead_starts[i], self._ahead_experts[i]

    def set_ahead_next(self, on: bool) -> None:
        """The decode graphs' word, before capture: whether the picks run a layer early (only where asked,
        STRATA_AHEAD_LAYER=next, and a token is one graph). The buffers stay double: harmless either way."""
        self.ahead_next = self.ahead_next and on

    def _pick_ahead(self, layer: int, predict: Callable[[], torch.Tensor]) -> None:
        """What a layer's pick graph holds: predict() -> the layer's routing predicted from its input [1, K]
        (rank order), and its first C misses picked into the staged list (which the layer graph's plan and
        publish read: that graph waits for this one); warming, both handed to the worker."""
        from strata_ray.kernels.decode_plan import prefetch_pick

        tiers = self.tiers
        pred = predict()
        start, expert = self._ahead_of(layer)
        prefetch_pick(self.table, layer * tiers.n_expert, pred, tiers.n_expert, start, expert)
        if self.warm:
            publish(pred.view(-1), None, self._pred_pin, self._pred_all, None, self.predicted.tensor,
                    self._base_dev, layer, expert, self._pred_staged_pin)

    def _copy_ahead(self, layer: int) -> None:
        """What a layer's copy graph holds: the picked experts copied into staging slots K..K+C-1 by a few
        programs (the mixer's kernels run beside them)."""
        table, part_bytes, _ = self._stage[layer]
        start, expert = self._ahead_of(layer)
        stage_experts(start, expert, table, self._staging_of(layer)[self.k:], part_bytes,
                      programs=ahead_programs())

    def _ahead_tiles(self, layer: int, x: torch.Tensor) -> None:
        """What a layer's ahead-tiles graph holds: the rows of the routed misses copied ahead, from their
        staging slots, over the layer plan's static tensors (its ahead_start marks them), and the codes the
        layer's publish wrote (the tiles run after the layer graph, and before the next layer's publish)."""
        from strata_ray.kernels.expert_gpu import expert_ffn_gpu

        order, _, _, _, _, pslot, astart = self._plan_out
        expert_ffn_gpu(x, self.tok, pslot, self._stage[layer][2], mode="decode", out=self.gpu_rows,
                       variant=self.tiers.kernel_variant, plan=(order, pslot, astart), act=self._codes,
                       ident=self._ident)

    def _capture_ahead(self, xs: list[torch.Tensor], predicts: list[Callable[[], torch.Tensor]],
                       capture: bool = True) -> None:
        """Each staged layer's pick, copy and ahead-tiles graphs, after a warm-up (capture=False: the warm-up
        only); the tiles in a memory pool of their own (the three kinds run beside the layer graphs, on
        streams of their own)."""
        dev = self.tiers.device
        bodies = {layer: ((self._pick_graphs, lambda layer=layer: self._pick_ahead(layer, predicts[layer])),
                          (self._copy_graphs, lambda layer=layer: self._copy_ahead(layer)),
                          (self._tile_graphs, lambda layer=layer: self._ahead_tiles(layer, xs[layer])))
                  for layer in self._stage}
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for layer in self._stage:
                for _, body in bodies[layer]:
                    body()
        side.synchronize()
        for expert in self._ahead_experts:  # the warm-up's picks: no layer may plan with them
            expert.fill_(-1)
        self.predicted.set(0)  # the warm-up's predictions: below the first token's base
        ahead_pool, tile_pool = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
        for layer in self._stage if capture else ():
            for graphs, body in bodies[layer]:
                g = torch.cuda.CUDAGraph()
                with capture_graph(g, tile_pool if graphs is self._tile_graphs else ahead_pool):
                    body()
                graphs[layer] = g

    def ahead_begin(self, layer: int) -> None:
        """Enqueue the layer's copies ahead once its input is in the buffer its prediction reads (the decode
        graphs call this right after the layer's first segment): on their own stream, after that segment,
        beside the rest of the layer's dense path. No host sync."""
        if layer not in self._copy_graphs:
            return
        self._enqueue_ahead(layer, self._pick_graphs[layer].replay, self._copy_graphs[layer].replay)
        self._ahead_begun.add(layer)

    def _enqueue_ahead(self, layer: int, pick: Callable[[], None], copy: Callable[[], None]) -> None:
        """pick, then copy, on the ahead stream after the main stream's work so far (the layer's input);
        events: picked (the layer's plan waits for it), copies landed (its tiles wait for them)."""
        main = torch.cuda.current_stream(self.tiers.device)
        ev_in, ev_picked, ev_copied = self._events[layer][:3]
        ev_in.record(main)
        self._ahead_stream.wait_event(ev_in)
        with torch.cuda.stream(self._ahead_stream):
            pick()
            ev_picked.record(self._ahead_stream)
            copy()
        ev_copied.record(self._ahead_stream)

    def _enqueue_tiles(self, layer: int, tiles: Callable[[], None]) -> None:
        """tiles on the tile stream once the main stream's work so far (the layer's plan) is done and the
        copies have landed; event: tiles done (the next layer's combine waits for it)."""
        _, _, ev_copied, ev_plan, ev_tiles = self._events[layer]
        ev_plan.record(torch.cuda.current_stream(self.tiers.device))
        self._tile_stream.wait_event(ev_plan)
        self._tile_stream.wait_event(ev_copied)
        with torch.cuda.stream(self._tile_stream):
            tiles()
        ev_tiles.record(self._tile_stream)

    def _ahead_rows(self, layer: int) -> None:
        """After the layer graph (its plan): the ahead tiles on their own stream once the copies have landed,
        beside the CPU rows."""
        if layer not in self._tile_graphs:
            return
        self._ahead_begun.discard(layer)
        self._enqueue_tiles(layer, self._tile_graphs[layer].replay)

    def _resident_rows(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        """The device's half of a layer: which entries are resident, and their rows (no host in the loop);
        with a PCIe share also the rows of the misses it reads from the host store. One token's tiles hold
        one entry each, so the plan is one launch (kernels/decode_plan.py)."""
        from strata_ray.kernels.decode_plan import decode_plan, decode_plan_pcie
        from strata_ray.kernels.expert_gpu import expert_ffn_gpu, tile_entries

        tiers = self.tiers
        view = tiers.cache.layer_view(layer)
        if tile_entries(1, "decode", tiers.kernel_variant, view) != 1:
            raise RuntimeError("the one-launch decode plan needs tiles of one entry")
        base, share = layer * tiers.n_expert, self.shares[layer]
        device_misses = layer in self._stage  # a share, or experts copied ahead
        main = torch.cuda.current_stream(tiers.device)
        act = self._codes  # [1, E] codes, scales, sums (publish quantized x): both tiers' launches read them
        if device_misses:
            staged = self._ahead_of(layer)[1] if self.ahead else None
            _, order, slot, starts, hslot, hstarts, pslot, _ = decode_plan_pcie(
                self.table, base, ids.view(-1), tiers.n_expert, share, hit=self.hit, staged=staged,
                out=self._plan_out)
            # the PCIe entries on a forked stream beside the resident tiles: their copies wait on the host's
            # memory, the resident tiles on HBM; both write disjoint rows of gpu_rows, and the join below
            # orders them before the combine. Entry k's expert lands in staging slot k. (The misses copied
            # ahead, in slots K + c, have a graph of their own: _ahead_rows.)
            table, part_bytes, slots = self._stage[layer]
            self._fork.wait_stream(main)
            with torch.cuda.stream(self._fork):
                if share:
                    stage_experts(hstarts, hslot, table, self._staging_of(layer), part_bytes,
                                  programs=share_programs())
                    expert_ffn_gpu(x, self.tok, pslot, slots, mode="decode", out=self.gpu_rows,
                                   variant=tiers.kernel_variant, plan=(order, pslot, hstarts), act=act,
                                   ident=self._ident)
        else:
            _, order, slot, starts = decode_plan(self.table, base, ids.view(-1), tiers.n_expert, hit=self.hit)
        if tiers.cache.n_slots:
            expert_ffn_gpu(x, self.tok, slot, view, mode="decode", out=self.gpu_rows,
                           variant=tiers.kernel_variant, plan=(order, slot, starts), act=act,
                           ident=self._ident)
        if device_misses:
            main.wait_stream(self._fork)

    def _layer_graph(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                     beside: Callable[[], None] | None) -> None:
        """What a layer's graph holds: the routing handed to the worker (kernels/publish: ids and x's codes
        into the page-locked buffers, the codes for the device's rows too, then routed := base + layer),
        `beside` on a forked stream, the device's rows (resident tiles, PCIe share), the join."""
        tiers, main = self.tiers, torch.cuda.current_stream(self.tiers.device)
        staged = None
        if self.ahead:  # the worker reads each layer's list: -1s where the layer copied none
            staged = self._ahead_of(layer)[1] if layer in self._stage else self._no_ahead
        publish(ids.view(-1), x, self._ids_pin, self._ids_all, self._codes_pin, self.routed.tensor,
                self._base_dev, layer, staged, self._staged_pin if staged is not None else None, self._codes)
        if beside is not None:
            self._beside.wait_stream(main)
            with torch.cuda.stream(self._beside):
                beside()
        # every layer plans once any layer has device rows: the plan rewrites `hit`, which the combine reads,
        # so a layer left out would keep the previous layer's (with no cache and no share, hit stays 0)
        if tiers.cache.n_slots or self._stage:
            self._resident_rows(layer, x, ids)
        if beside is not None:
            main.wait_stream(self._beside)

    def capture_all(self, xs: list[torch.Tensor], ids: list[torch.Tensor] | None = None,
                    besides: list[Callable[[], None] | None] | None = None,
                    predicts: list[Callable[[], torch.Tensor]] | None = None, graphs: bool = True) -> bool:
        """Capture every layer's graph (_layer_graph) over the decode graphs' static xs[layer] [1, E] and
        ids[layer] [1, K], after a warm-up on a side stream. besides[layer]: work only the next layer reads
        (the shared expert), taken into the layer's graph beside its rows: returns True (the caller must
        then not run it). predicts[layer]: the layer's routing predicted from its input, [1, K] (needed
        with copies ahead: `ahead`; the caller then calls ahead_begin(layer) once that input is ready).
        graphs=False: the warm-up only, for the caller's token graphs (token_layer, token_ahead)."""
        if ids is None:
            raise ValueError("the pipelined decode captures over the routing's ids buffers too")
        if self.ahead and predicts is None:
            raise ValueError("copies ahead of the routing need each layer's prediction (predicts)")
        self._predicts = predicts
        besides = besides or [None] * self.tiers.n_layers
        dev = self.tiers.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            # the warm-up runs for real: over expert 0, not the ids buffers' contents (uninitialised
            # memory, whose values would index the residency table out of bounds)
            for layer in range(self.tiers.n_layers):
                self._layer_graph(layer, xs[layer], torch.zeros_like(ids[layer]), besides[layer])
        side.synchronize()
        self.routed.set(0)  # the warm-up raised it to n_layers - 1: back below the first token's base
        torch.cuda.current_stream(dev).wait_stream(side)
        if not graphs:  # the token graphs' own kernels warmed up too: the flag wait (released at once)
            self._base_dev.fill_(int(self.rows_flag.host[0]))
            wait_flag(self.rows_flag.tensor, self._base_dev, 0)
            torch.cuda.current_stream(dev).synchronize()
        pool = torch.cuda.graph_pool_handle()
        for layer in range(self.tiers.n_layers) if graphs else ():
            g = torch.cuda.CUDAGraph()
            with capture_graph(g, pool):
                self._layer_graph(layer, xs[layer], ids[layer], besides[layer])
            self._graphs[layer] = g
        if self.ahead:
            self._capture_ahead(xs, predicts, graphs)
        return True

    # -- the enqueued part ------------------------------------------------------------------------------
    def step(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
             beside: Callable[[], None] | None = None) -> None:
        """Enqueue layer `layer`'s rows for one token: x [1, E], ids [1, K] (no host sync): its graph, then
        (with a worker) the wait for the worker's rows. beside: work only the next layer reads that
        capture_all did not take, enqueued after the graph."""
        t0 = time.perf_counter()
        tiers = self.tiers
        if layer == 0:
            self._begin_token(token_graph=False)
        # the layer's graph (its ids also land in _ids_all[layer]: the resident token's window counts); an
        # all-resident token's combine reads no CPU row (hit = 1 for every entry). Its plan and publish read
        # the layer's staged list: the pick must have run (long before: beside the mixer)
        if layer in self._pick_graphs:
            if layer not in self._ahead_begun:  # its staged list would be another layer's
                raise RuntimeError(f"layer {layer}: the copies ahead were not enqueued (ahead_begin)")
            torch.cuda.current_stream(tiers.device).wait_event(self._events[layer][1])
        self._graphs[layer].replay()
        self._ahead_rows(layer)
        if beside is not None:
            beside()
        if not self._resident_token:
            self.rows_flag.wait((self._token_base + layer) & 0xFFFFFFFF)
            self._rows_landed(layer, tiles=layer in self._tile_graphs)
        elif layer == tiers.n_layers - 1:
            self._resident_ids()
        self._host += time.perf_counter() - t0
        if layer == tiers.n_layers - 1:
            self._tokens[-1].host = self._host

    def _rows_landed(self, layer: int, tiles: bool) -> None:
        """After the wait for the worker's rows: the wait for the ahead tiles' rows (tiles), which the combine
        reads too, and the worker's rows copied up unless the combine reads them where the worker wrote them
        (zero_copy)."""
        if tiles:
            torch.cuda.current_stream(self.tiers.device).wait_event(self._events[layer][4])
        if not self.zero_copy:
            self.cpu_rows.copy_(self._rows_pin, non_blocking=True)
            self.inv.copy_(self._inv_pin, non_blocking=True)

    def _begin_token(self, token_graph: bool) -> None:
        """A token's host part before its first layer: the window boundary, then (unless every expert is
        resident) a flag base and the worker. token_graph: the token's graphs wait for rows_flag inside
        (wait_flag), so a resident token gets a base too, its waits released at once."""
        tiers = self.tiers
        self._host = 0.0
        # window boundary: residency may change here, never inside the token; in the token graphs its
        # accounting, round planning and swap copies wait for token_end (after the launch: off the gap)
        tiers.start_forward(1, defer=token_graph)
        # the captured graphs read this very tensor: refreshed in place, never replaced
        if tiers.residency.device_table(tiers.device) is not self.table:
            raise RuntimeError("the device residency table moved under the resident-rows graphs")
        self._resident_token = tiers.all_resident  # every entry a hit: the device alone
        if len(self._tokens) >= 2:  # the alternating snapshots (residency, ids) serve two tokens
            raise RuntimeError("the pipelined decode joins a token before it launches a third")
        token = _LaunchedToken(decode=not tiers.in_prompt)  # a one-token prompt's, joined maybe after it
        if self._resident_token:
            self._tokens.append(token)
            if not token_graph:
                return
        base, self._base = self._base, (self._base + tiers.n_layers) & 0xFFFFFFFF
        self._token_base = base
        self._base_dev.fill_(base)  # the graphs' publish kernels raise routed to base + layer
        if self._resident_token:  # no worker: every layer's wait passes
            self.rows_flag.set((base + tiers.n_layers - 1) & 0xFFFFFFFF)
            return
        if not self._tokens:
            self.worker.buf["stop"][0] = 0
        res = self._res_snaps[self._n_tokens % 2]
        np.copyto(res, tiers.residency.res)  # this token's residency, as the device table's refresh has it
        self._n_tokens += 1
        token.job = tiers.cpu_thread.submit(self._run_worker, base, res)
        self._tokens.append(token)

    @property
    def resident_token(self) -> bool:
        """Whether token_begin's token has every expert resident (it may run resident_form's graphs)."""
        return self._resident_token

    def _resident_ids(self) -> None:
        """After an all-resident token's last layer: its ids [L, K] copied out of the row the next token's
        publish overwrites (through the device, in stream order) into a page-locked copy of its own, and
        the event finish() waits for before it reads them."""
        i = self._n_resident % 2
        self._n_resident += 1
        self._ids_dev.copy_(self._ids_all, non_blocking=True)
        self._ids_snaps[i].copy_(self._ids_dev, non_blocking=True)
        self._ids_done[i].record()
        self._tokens[-1].ids, self._tokens[-1].done = self._ids_snaps[i], self._ids_done[i]

    def _run_worker(self, base: int, res: np.ndarray) -> tuple[int, TokenOutputs]:
        """The worker's job for one token: its rows, then copies of its outputs (the next job overwrites
        the worker's own arrays, maybe before this token is joined)."""
        stopped = self.worker.run(base, res)
        return stopped, self.worker.outputs()

    # -- the token graphs: a run of layers captured as one graph by the decode graphs ------------------------
    def token_begin(self) -> None:
        """Before the token's graphs are launched (host: the window boundary, the base, the worker)."""
        self._token_t0 = time.perf_counter()
        if self._finished_at is not None:
            self.gap_parts[1] += self._token_t0 - self._stamps[0]
        self._begin_token(token_graph=True)
        if self._token_done is not None:
            before = torch.cuda.Event(enable_timing=True)
            before.record()
            self._idle_pairs.append((self._token_done, before))
            self._token_done = None
        self._stamps[1] = time.perf_counter()
        if self._finished_at is not None:
            self.gap_parts[2] += self._stamps[1] - self._token_t0

    def token_ahead(self, layer: int) -> None:
        """Capturable: layer's copies ahead once its input is in its buffer (as ahead_begin, in the caller's
        graph: pick and copy on the ahead stream, forked there and joined by token_layer's waits)."""
        if layer not in self._stage or not self.ahead:
            return
        self._enqueue_ahead(layer, lambda: self._pick_ahead(layer, self._predicts[layer]),
                            lambda: self._copy_ahead(layer))

    def token_layer(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                    beside: Callable[[], None] | None) -> None:
        """Capturable: everything step(layer) enqueues, in the caller's graph: the pick's join, the layer's
        rows (_layer_graph, beside on a fork), the ahead tiles, the wait for the worker's rows as a kernel
        (kernels/flag_wait: base + layer, base from the device), the tiles' join, the copies up."""
        if self.resident_form:  # a resident token: no worker, no copies ahead; the layer's rows alone
            self._layer_graph(layer, x, ids, beside)
            return
        staged = bool(self.ahead) and layer in self._stage
        main = torch.cuda.current_stream(self.tiers.device)
        if staged:  # the plan and publish read the staged list
            main.wait_event(self._events[layer][1])
        self._layer_graph(layer, x, ids, beside)
        if staged:
            self._enqueue_tiles(layer, lambda: self._ahead_tiles(layer, x))
        wait_flag(self.rows_flag.tensor, self._base_dev, layer)
        self._rows_landed(layer, tiles=staged)
        if staged:  # the copies' stream joined here as well (a capture ends with every fork joined to its
            # stream; the tiles already waited for the copies)
            main.wait_event(self._events[layer][2])

    def token_end(self) -> None:
        """After the token's graphs are launched: the resident token's done event; the gap since the last
        token's end; the window boundary's deferred part (beside the token's device work); the host's time."""
        if self._resident_token:
            self._resident_ids()
        now = time.perf_counter()
        if self._finished_at is not None:
            self.tiers.metrics.counts.gap_seconds += now - self._finished_at
            self.gap_parts[3] += now - self._stamps[1]
            self._finished_at = None
        self._token_done = torch.cuda.Event(enable_timing=True)
        self._token_done.record()
        while self._idle_pairs and self._idle_pairs[0][1].query():  # the pairs the device has passed
            end, before = self._idle_pairs.popleft()
            self.device_idle += end.elapsed_time(before) * 1e-3
        self.tiers.after_launch()
        self._host += time.perf_counter() - self._token_t0
        self._tokens[-1].host = self._host

    def finish(self) -> None:
        """Join the oldest launched token: its worker, or (all resident) its ids' copy; count each layer's
        entries (window accounting, metrics: the host's enqueue time, the worker's own CPU-row time, and
        the wait here for the token's last layer)."""
        tiers, k = self.tiers, self.k
        counts = tiers.metrics.counts
        if not self._tokens:
            return
        token = self._tokens.popleft()
        t = time.perf_counter()
        if token.job is None:  # all resident: the device alone
            if token.done is None:
                raise RuntimeError("an all-resident token was joined before its last layer was enqueued")
            token.done.synchronize()  # its ids' copies landed
            self._finished_at = time.perf_counter()
            if token.decode:
                counts.wait_seconds += self._finished_at - t
            ids = token.ids.numpy()
            for layer in range(tiers.n_layers):
                host = token.host if layer == 0 else 0.0
                tiers.count_entries(layer, ids[layer].copy(), 1, k, 0, token.decode, host)
            self._stamps[0] = time.perf_counter()
            self.gap_parts[0] += self._stamps[0] - self._finished_at
            return
        try:
            stopped, out = token.job.result()
        except BaseException:  # the worker failed mid-token: release the device's waits, or it never ends
            self._release_waits()
            raise
        self._finished_at = time.perf_counter()
        if token.decode:  # a prompt token's wait, copies ahead and warm reads are not the decode's
            counts.wait_seconds += self._finished_at - t
        if stopped != -1:
            raise RuntimeError(f"the decode worker stopped at layer {stopped}")
        tiers.count_cpu_seconds(self.worker.busy_seconds(out.busy), token.decode)
        if self.on_worker_outputs is not None:
            self.on_worker_outputs(out)
        for layer in range(tiers.n_layers):
            m, p = int(out.n_miss[layer]), int(out.n_pcie[layer])
            host = token.host if layer == 0 else 0.0
            tiers.count_entries(layer, out.seen_ids[layer], 1, k - m - p, m, token.decode, host, pcie=p)
        if self.ahead and token.decode:
            counts.ahead_entries += int(out.n_ahead[:, 0].sum())
            counts.ahead_copies += int(out.n_ahead[:, 1].sum())
        if self.warm and token.decode:
            counts.warm_entries += int(out.n_warm[:, 0].sum())
            counts.warm_hits += int(out.n_warm[:, 1].sum())
        self._stamps[0] = time.perf_counter()
        self.gap_parts[0] += self._stamps[0] - self._finished_at

    def _release_waits(self) -> None:
        """Raise the rows flag to the token's last layer: every device wait of the token passes."""
        self.rows_flag.set((self._base - 1) & 0xFFFFFFFF)

    def abort(self) -> None:
        """After a failure mid-token: end the worker's wait and release the device's waits."""
        self._ahead_begun.clear()
        jobs = [token.job for token in self._tokens if token.job is not None]
        self._tokens.clear()
        if self._resident_token:  # no worker, no flags
            self._resident_token = False
            return
        self.worker.stop()
        self._release_waits()
        for job in jobs:  # a queued job starts with the stop raised and ends at its first wait
            job.result()
        self.worker.buf["stop"][0] = 0


@dataclass
class _LaunchedToken:
    """A launched token until finish() joins it: its worker's job (a future of (stopped, TokenOutputs)), or
    for an all-resident token its ids' page-locked copy [L, K] and the event behind that copy; the host's
    enqueue time (seconds); decode: launched outside a prompt (TieredExperts.prompt_forwards), so its entries
    count as a decode token's when it is joined, even after the prompt ended."""

    job: Future | None = None
    ids: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    host: float = 0.0
    decode: bool = True


def _staging_plan(parts, layout, staging: torch.Tensor) -> tuple[torch.Tensor, int, ExpertLayer]:
    """A page-locked layer's (stage table on the device, its largest part, the staging slots as that layer's
    ExpertLayer: uint8 [K, rows, row_bytes] views in the slot cache's blob layout)."""
    table = stage_table(parts, [off for _, _, off in layout.parts], staging.shape[1])
    return torch.from_numpy(table).to(staging.device), int(table[:, 2].max()), blob_views(staging, layout)


def token_graph_and_ahead(partial: bool, token_env: str, prefetch: int | None) -> tuple[bool, int]:
    """(token graphs on, experts a layer copies ahead) for a cache that holds some experts only (partial)
    or all, STRATA_TOKEN_GRAPH's value ("" unset, "0", "1") and the config's decode_prefetch (None: the
    default). Token graphs by default (session 24 on the H200, every expert resident, 8K: 236.4 / 237.0
    tok/s chained against 199.1-213.9 for the per-layer graphs chained and 188.6-207.4 unchained, 200.0 for
    the token graphs unchained: the host's ~100 launches a token no longer bound the chain); copies ahead
    only where experts can miss, by default TOKEN_GRAPH_PREFETCH in the token graphs and none elsewhere
    (there each copy costs host launches)."""
    token = token_env != "0"
    if prefetch is None:
        prefetch = TOKEN_GRAPH_PREFETCH if token else 0
    return token, prefetch if partial else 0


def pipeline_supported(tiers) -> bool:
    """Quantized expert layers of one width in every trunk layer (the worker's kernels), each C-contiguous:
    the worker keeps read-only C views of every layer for the run, which of a strided one (a fused gate_up
    the host store had no memory to split) would be a copy of the whole layer."""
    layers = [tiers.store.layer(layer) for layer in range(tiers.n_layers)]
    widths = {lay.n_embd for lay in layers}
    return (bool(layers) and not any(lay.is_float for lay in layers) and len(widths) == 1
            and all(lay.c_contiguous for lay in layers))

