"""DecodeRows: the tiered backend's one-token step with fixed shapes, for the decode graphs.

TieredExperts.__call__ serves any token count and returns the combined rows; a one-token decode step
through it costs ~15 Python-issued launches and copies per layer. Here a step has fixed shapes
(K entries of one token), so the GPU part can be captured once per layer:

    eager:  ids and x to the host (one sync) -> classify the K entries by the residency table -> the
            tile plan of the resident ones (host) -> one pinned upload of the plan, the hit mask and
            the misses' positions -> replay layer l's graph [quantize x | gate+up | down] (rows of
            resident experts) -> the CPU pool computes the M missed entries meanwhile, into a pinned
            [M, E] buffer -> one upload of those M rows
    graph:  rows() = where(hit, gpu rows, cpu rows[inv]) [K, E] (inv: each entry's row among the M),
            captured into the decode graph that combines them (DecodeGraphs), in k order as
            combine_rows does everywhere.

With `decode_cpu_thread` (STRATA_DECODE_CPU_THREAD=1) on CUDA, the CPU pool's part does not hold the host
up: a helper thread computes it into the pinned buffer, and the parallel kernel itself raises a host flag
(kernels/stream_flags.py) after its last row, so no Python runs between the rows and the device's go;
the host enqueues "wait for the flag", the rows' upload and the next layer's graph at once, so those
launches overlap the CPU pool's work. The next layer's routing sync (which waits for the device, which
waits for the flag) orders everything after it; `finish()` joins the last layer's job before the token's
logits are used. It gives the same bits. On the H200 it stays slower than the host thread (session 5:
19-20 tok/s against 21-24 at 8K, with the flag raised by the kernel, the `started` handoff and every pool
call on the tiers' one CPU thread): the two threads hand each layer to each other under the GIL (the
executor's wake-up, `started`, the return), ~0.3 ms a layer of host time. (A graph replay costs the host
~5 us, not the ~0.1-0.2 ms profiler traces showed, so there was less to overlap than it seemed.)

The kernels, the plan's tile size and the combine are those of TieredExperts.__call__, so the rows and
the output have the same bits. Window accounting, adaptive rounds and metrics go through the same
TieredExperts methods.

`capture=False` (any device; the CPU tests) runs the same step with the cache tier's kernel called
directly instead of a graph.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.kernels.fused_small import gather_rows
from strata_ray.kernels.stream_flags import host_flag
from strata_ray.kernels.tile_plan import plan_tiles_host
from strata_ray.model.graph_capture import capture_graph

# With the helper thread two Python threads share each layer's step, and CPython passes the GIL to a waiting
# thread only when the holder blocks or after the switch interval (5 ms by default): on the H200 the helper's
# few lines of Python before and after its numba call waited behind the host's launches, and a token took
# 60 ms instead of 55 (CPU pool 35 ms instead of 22). 50 us bounds that wait (it costs nothing
# uncontended); alone it did not help (call 4 of session 4), hence also the `started` handoff in step().
SWITCH_INTERVAL = 5e-5


class DecodeRows:
    """One token's K routed rows per layer for the decode graphs: `step(layer, x, ids)` (eager), then
    `rows()` (captured into the next graph segment). Buffers are shared by all layers: a layer's rows are
    consumed by the next segment before the next step overwrites them (stream order)."""

    def __init__(self, tiers, n_embd: int, k: int, capture: bool):
        self.tiers, self.k, self.capture = tiers, k, capture
        self.cuda = tiers.cache.is_cuda
        if capture and not self.cuda:
            raise ValueError("captured decode rows need the slot cache on a CUDA device")
        dev = tiers.device
        self.gpu_rows = torch.zeros((k, n_embd), dtype=torch.float32, device=dev)  # [K, E] resident rows
        self.cpu_rows = torch.zeros((k, n_embd), dtype=torch.float32, device=dev)  # [M <= K, E] the misses'
        # [order K | sorted_slot K | tile_start K | hit K | inv K] int32: what the graph reads, one upload
        # per layer (inv: a missed entry's row in cpu_rows, 0 for hits)
        self.plan = torch.full((5 * k,), -1, dtype=torch.int32, device=dev)
        self.plan[4 * k :] = 0
        self.tok = torch.zeros(k, dtype=torch.int32, device=dev)  # every entry is token 0
        pin = self.cuda
        self._plan_pin = torch.empty(5 * k, dtype=torch.int32, pin_memory=pin)
        self._rows_pin = torch.zeros((k, n_embd), dtype=torch.float32, pin_memory=pin)
        self._zero_tok = np.zeros(k, np.int64)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # decode_cpu_thread on CUDA: the CPU pool's rows come from a helper thread behind a host flag (None:
        # off, or the driver cannot wait on host memory; the rows are then computed before anything after
        # them is enqueued)
        self._flag = host_flag(dev) if self.cuda and tiers.decode_cpu_thread else None
        if self._flag is not None and sys.getswitchinterval() > SWITCH_INTERVAL:
            sys.setswitchinterval(SWITCH_INTERVAL)
        self._job: Future | None = None  # the last layer's CPU rows, not joined yet
        self._started = threading.Event()  # the helper's kernels have begun (its Python part is done)

    # -- the captured part ------------------------------------------------------------------------------
    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gpu rows [K, E], cpu rows [K, E], hit int32 [K], inv int32 [K]): the combine reads entry k's row
        from gpu rows where hit, else cpu rows[inv[k]] (kernels/fused_small.gather_rows)."""
        k = self.k
        return self.gpu_rows, self.cpu_rows, self.plan[3 * k : 4 * k], self.plan[4 * k :]

    def rows(self) -> torch.Tensor:
        """[K, E]: each entry's row from the tier that computed it (captured into the combine's graph)."""
        gpu, cpu, hit, inv = self.parts()
        return gather_rows(gpu[None], cpu, hit[None], inv[None])[0]

    def _resident_rows(self, layer: int, x: torch.Tensor) -> None:
        """The slot cache's kernel over the uploaded plan: rows of the resident entries into gpu_rows."""
        from strata_ray.kernels.expert_gpu import expert_ffn_gpu

        k, tiers = self.k, self.tiers
        plan = (self.plan[:k], self.plan[k : 2 * k], self.plan[2 * k : 3 * k])
        expert_ffn_gpu(x, self.tok, self.plan[k : 2 * k], tiers.cache.layer_view(layer), mode="decode",
                       out=self.gpu_rows, variant=tiers.kernel_variant, plan=plan)

    def capture_all(self, xs: list[torch.Tensor], ids: list[torch.Tensor] | None = None,
                    besides=None, predicts=None, graphs: bool = True) -> bool:
        """Capture every layer's resident-rows graph over xs[layer] [1, E] (the decode graphs' static MoE
        inputs), after a warm-up with no tiles (tile_start -1: the kernels compile and return at once).
        besides: not taken (False: step() runs them, between the device's rows and the CPU's); predicts:
        unused (no copies ahead here); graphs: always captured (this backend has no token graphs)."""
        if not self.capture or self.tiers.cache.n_slots == 0:
            return False
        self.plan.fill_(-1)
        dev = self.tiers.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for layer in range(self.tiers.n_layers):
                self._resident_rows(layer, xs[layer])
        torch.cuda.current_stream(dev).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for layer in range(self.tiers.n_layers):
            g = torch.cuda.CUDAGraph()
            with capture_graph(g, pool):
                self._resident_rows(layer, xs[layer])
            self._graphs[layer] = g
        return False

    # -- the eager part ---------------------------------------------------------------------------------
    def _upload_plan(self, slot: np.ndarray, hit: np.ndarray, inv: np.ndarray, bt: int) -> None:
        """Plan of the resident entries over all K positions (misses: slot -1, in no tile), the mask and
        the misses' rows."""
        k = self.k
        full = np.where(hit, slot, -1)
        order, sorted_slot, starts = plan_tiles_host(full, bt)
        starts = starts[sorted_slot[starts] >= 0]  # tiles of resident entries only
        p = self._plan_pin.numpy()
        p[:k], p[k : 2 * k] = order, sorted_slot
        p[2 * k : 3 * k] = -1
        p[2 * k : 2 * k + starts.size] = starts
        p[3 * k : 4 * k] = hit
        p[4 * k :] = inv
        self.plan.copy_(self._plan_pin, non_blocking=self.cuda)

    def _cpu_rows(self, x_h: np.ndarray, exp: np.ndarray, layer: int, value: int) -> float:
        """Helper thread: the CPU pool's rows of the missed entries into the pinned rows buffer, then the
        flag, raised by the kernel (again here: on failure the device must not wait forever; the error is
        raised at the join)."""
        try:
            t = time.perf_counter()
            m = exp.size
            expert_ffn_cpu(x_h, self._zero_tok[:m], exp, self.tiers.store.layer(layer),
                           pool=self.tiers.pool_for(exp), started=self._started,
                           out=self._rows_pin.numpy()[:m], done=(self._flag.host, value))
            return time.perf_counter() - t
        finally:
            self._started.set()  # also when the call failed before its kernels
            self._flag.set(value)

    def finish(self) -> None:
        """Join the last layer's CPU job: its time goes to the metrics, its error (if any) is raised."""
        job, self._job = self._job, None
        if job is not None:
            self.tiers.count_cpu_seconds(job.result())

    def step(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
             beside: Callable[[], None] | None = None) -> None:
        """Layer `layer`'s rows for one token: x [1, E] normed MoE input, ids [1, K] -> rows() ready.
        beside: device work of the layer that only the next layer reads (the shared expert), enqueued after
        the resident rows so that it runs while the CPU computes the misses."""
        tiers = self.tiers
        if layer == 0:
            tiers.start_forward(1)
        ids_h, x_h = tiers.to_host(ids, x, with_x=True)  # [K], [1, E]: one sync
        self.finish()  # the previous layer's job ended before this sync returned (the device waited for it)
        t0 = time.perf_counter()
        slot = tiers.residency.layer_slots(layer)[ids_h]  # [K] slot or -1
        hit = slot >= 0
        miss = np.flatnonzero(~hit)
        n_hit, m = self.k - miss.size, miss.size
        inv = np.zeros(self.k, np.int32)
        inv[miss] = np.arange(m, dtype=np.int32)
        value = None
        if miss.size and self._flag is not None:  # start the CPU pool first: everything below overlaps it
            value = self._flag.arm()
            # x_h stays valid: the next copy into its staging buffer is queued after the wait below
            self._started.clear()
            # the tiers' CPU thread: every pool call from one thread keeps libgomp's spin (TieredExperts)
            self._job = tiers.cpu_thread.submit(self._cpu_rows, x_h, ids_h[miss], layer, value)
            # let the helper's Python (~0.05 ms) run alone: interleaved with the launches below, both
            # crawled (H200: CPU pool 32 ms a token instead of 22, host 18 ms instead of 8); its kernels then
            # run without the GIL while this thread launches
            self._started.wait()
        view = tiers.cache.layer_view(layer)
        if self.cuda:
            from strata_ray.kernels.expert_gpu import tile_entries  # Triton: CUDA machines only

            self._upload_plan(slot, hit, inv, tile_entries(1, "decode", tiers.kernel_variant, view))
            if n_hit and self.capture:
                self._graphs[layer].replay()
            elif n_hit:  # the same kernels, launched directly
                self._resident_rows(layer, x)
        else:  # the CPU slot tier (tests): the cache's kernel over its slots
            self.plan[3 * self.k :] = torch.from_numpy(np.concatenate([hit.astype(np.int32), inv]))
            if n_hit:
                hits = np.flatnonzero(hit)
                slots = slot[hits]
                rows = expert_ffn_cpu(x_h, self._zero_tok[:n_hit], slots, view, pool=tiers.pool_for(slots))
                self.gpu_rows[torch.from_numpy(hits)] = torch.from_numpy(rows)
        if beside is not None:
            beside()
        host = time.perf_counter() - t0
        if value is not None:  # the device waits for the helper's flag, then uploads its rows
            t1 = time.perf_counter()
            self._flag.wait(value)
            self.cpu_rows[:m].copy_(self._rows_pin[:m], non_blocking=True)
            host += time.perf_counter() - t1
        elif miss.size:
            t1 = time.perf_counter()
            exp = ids_h[miss]
            rows = expert_ffn_cpu(x_h, self._zero_tok[:m], exp, tiers.store.layer(layer),
                                  pool=tiers.pool_for(exp), out=self._rows_pin.numpy()[:m])
            t2 = time.perf_counter()
            tiers.count_cpu_seconds(t2 - t1)
            if self.cuda:
                self.cpu_rows[:m].copy_(self._rows_pin[:m], non_blocking=True)
            else:
                self.cpu_rows[:m] = torch.from_numpy(rows)
            host += time.perf_counter() - t2
        tiers.count_entries(layer, ids_h, 1, n_hit, m, True, host)
