"""CpuTokenRows: a decode token's CPU rows over every layer in one numba call, driven here by a thread that
plays the device's part (writes ids and x's codes, raises `routed`, waits for `rows_flag`) with the same
buffers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from strata_ray.kernels.block_dots import HALF_ROWS, ROWS
from strata_ray.kernels.contract import KernelError, readonly_blocks
from strata_ray.kernels.cpu_token_rows import PHASES, CpuTokenRows, cycles_per_second
from strata_ray.kernels.decode_plan import decode_plan_pcie_reference
from strata_ray.kernels.expert_cpu import expert_ffn_cpu
from strata_ray.kernels.expert_cpu_token import COUNTER, DYNAMIC, GATHER, reached
from tests.kernels.layers import N_EMBD, layer_for

N_EXPERT = 37
LAYERS = ["Q4_0", "Q8_0", "Q4_K+Q6_K"]


def _wait(flag: np.ndarray, value: int, timeout: float = 60.0) -> None:
    t = time.monotonic()
    while not reached(flag, value):
        if time.monotonic() - t > timeout:
            raise TimeoutError(f"flag {int(flag[0])} never reached {value}")
        time.sleep(0)


def _serve(worker: CpuTokenRows, base: int, play) -> int:
    """worker.run(base) on a thread while `play()` acts as the device; the worker is stopped and joined
    whatever happens (a worker left waiting would spin on a core for the rest of the session)."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", worker.run(base)), daemon=True)
    thread.start()
    try:
        play()
        thread.join(60)
    finally:
        worker.stop()
        thread.join(60)
    assert not thread.is_alive()
    return result["rc"]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile the worker's kernels before any timed wait (minutes on a busy 2-core CI machine): one token
    whose flags are already raised, so no layer waits."""
    layers = [layer_for(name, N_EXPERT) for name in LAYERS]
    for single, team in ((0, False), (1 << 40, False), (0, True)):  # parallel, one-thread and team paths
        res = np.full(len(layers) * N_EXPERT, -1, np.int32)
        worker = CpuTokenRows(layers, res, 2, 2, single_thread_bytes=single, team=team)
        worker.buf["ids"][:] = [0, 1]
        worker.buf["routed"][0] = len(layers)
        assert worker.run(1) == -1


def _cpu_entries(worker: CpuTokenRows, layer: int, ids: np.ndarray, staged=None) -> np.ndarray:
    """The entries of a layer's routing ids [K] the worker computes: those the device plan leaves to the CPU
    (decode_plan_pcie_reference: the misses copied ahead, then the pcie_entries of the others of the lowest
    expert ids, are the GPU's)."""
    table = torch.from_numpy(worker.res.copy())
    st = None if staged is None else torch.tensor(staged, dtype=torch.int32)
    hit = decode_plan_pcie_reference(table, layer * worker.n_expert, torch.from_numpy(ids), worker.n_expert,
                                     int(worker.shares[layer]), staged=st)[0]
    return np.flatnonzero(hit.numpy() == 0)


def _wait_counted(worker: CpuTokenRows, layer: int, pred: np.ndarray, staged) -> None:
    """Warming team: wait (10 s, as _wait: TimeoutError) for member 0 to count the predicted CPU entries,
    so it takes the prediction before the routing however late the OS runs it (a fixed sleep lost that race
    on a loaded 2-core CI machine); a prediction with no CPU entry, or an id out of range, counts 0: a short
    sleep then. A cold team never looks, so nothing to wait for."""
    if not worker.warm:
        return
    want = 0 if pred.max() >= worker.n_expert else _cpu_entries(worker, layer, pred, staged).size
    if not want:
        time.sleep(0.002)
    t = time.monotonic()
    while want and worker.n_warm[layer, 0] == 0:
        if time.monotonic() - t > 10:  # as _wait: a team that never took the prediction fails here, by name
            raise TimeoutError(f"layer {layer}: the team never counted its {want} predicted CPU entries")
        time.sleep(0.0002)


def _play_device(worker: CpuTokenRows, base: int, ids: np.ndarray, xs: np.ndarray, staged=None,
                 preds: np.ndarray | None = None) -> list[np.ndarray]:
    """Per layer: (with preds [L, K]: write the predicted routing and the experts copied ahead, raise
    `predicted`, wait for the team to take it; a row of -1s: no prediction that layer) write the routing
    (and the experts copied ahead), raise `routed`, wait for the rows; returns each layer's [K, E] rows in
    entry order (the device's entries' rows are zeros)."""
    b, k = worker.buf, worker.k
    out = []
    for layer in range(worker.n_layers):
        if preds is not None and preds[layer, 0] >= 0:
            b["pred_ids"][:] = preds[layer]
            if staged is not None:
                b["pred_staged"][:] = staged[layer]
            b["predicted"][0] = (base + layer) & 0xFFFFFFFF
            _wait_counted(worker, layer, preds[layer], None if staged is None else staged[layer])
        b["ids"][:] = ids[layer]
        worker.put_x(xs[layer])
        if staged is not None:
            b["staged"][:] = staged[layer]
        v = (base + layer) & 0xFFFFFFFF
        b["routed"][0] = v
        _wait(b["rows_flag"], v)
        rows = np.zeros((k, worker.n_embd), np.float32)
        for j in _cpu_entries(worker, layer, ids[layer], None if staged is None else staged[layer]):
            rows[j] = b["rows"][b["inv"][j]]
        out.append(rows)
    return out


@pytest.mark.parametrize("k,parallel,team,shares,ahead,form,prefetch,units", [
    (1, True, False, 0, 0, GATHER, True, HALF_ROWS),
    (5, True, False, 0, 0, GATHER, True, HALF_ROWS),
    (5, False, False, 0, 0, GATHER, True, HALF_ROWS),
    (1, True, True, 0, 0, GATHER, True, HALF_ROWS),
    (5, True, True, 0, 0, GATHER, True, HALF_ROWS),
    (5, True, True, (600, 0, 1000), 0, GATHER, True, HALF_ROWS),
    (5, False, False, (400, 1000, 1), 0, GATHER, True, HALF_ROWS),
    (1, True, False, (600, 0, 600), 0, GATHER, True, HALF_ROWS),
    (5, True, True, (400, 0, 600), 2, GATHER, True, HALF_ROWS),
    (5, False, False, 0, 3, GATHER, True, HALF_ROWS),
    (1, True, True, (1000, 400, 0), 1, GATHER, True, HALF_ROWS),
    (1, True, True, 0, 0, COUNTER, True, HALF_ROWS),
    (5, True, True, (400, 0, 600), 2, COUNTER, True, HALF_ROWS),
    (1, True, True, 0, 0, DYNAMIC, True, HALF_ROWS),
    (5, True, True, (400, 0, 600), 2, DYNAMIC, True, HALF_ROWS),
    (5, True, True, (400, 0, 600), 2, GATHER, False, HALF_ROWS),
    (1, True, True, 0, 0, COUNTER, False, HALF_ROWS),
    (5, True, True, (400, 0, 600), 2, GATHER, False, ROWS),
    (1, True, True, 0, 0, DYNAMIC, False, ROWS),
])
def test_rows_are_expert_ffn_cpu_rows_layer_after_layer(k, parallel, team, shares, ahead, form, prefetch,
                                                        units, rng):
    """team: one parallel region for the token (token_rows_team), its members meeting at barriers of any
    form (a shared counter; gathered arrival lines with fixed shares or units taken from a counter).
    shares: each layer's permille of misses left to the GPU (read over PCIe): the worker skips the first
    ones. ahead: experts the device copied ahead a layer (some routed misses, some not routed, some
    resident, some -1): the worker skips the misses among them first. prefetch: the members' down units
    prefetched after their gate/up shares, or not (the same rows). units: the rows of a member's gate/up unit
    (half tiles, or whole ones: the same rows). The team's phase stamps add up to each layer's busy cycles."""
    layers = [layer_for(name, N_EXPERT) for name in LAYERS]
    res = np.full(len(layers) * N_EXPERT, -1, np.int32)
    res[rng.choice(res.size, res.size // 3, replace=False)] = 0  # a third resident (the slot number: any)
    ids = np.stack([np.sort(rng.choice(N_EXPERT, k, replace=False)) for _ in layers])  # [L, K]
    ids[1] = np.flatnonzero(res[N_EXPERT : 2 * N_EXPERT] >= 0)[:k]  # layer 1: every entry resident
    xs = rng.standard_normal((len(layers), 1, N_EMBD)).astype(np.float32)
    staged = None
    if ahead:
        staged = rng.choice(N_EXPERT, (len(layers), ahead)).astype(np.int64)  # [L, C] any experts ...
        for layer in range(len(layers)):
            staged[layer, 0] = ids[layer, -1]  # ... one of them routed
        staged[0, -1] = -1  # an empty slot
    worker = CpuTokenRows(layers, res, k, n_threads=2, single_thread_bytes=0 if parallel else 1 << 40,
                          team=team, n_staged=max(1, ahead), form=form, prefetch=prefetch, unit_rows=units)
    assert worker.team == team
    worker.shares[:] = shares
    base = 0xFFFFFFFE  # the 32-bit flag values wrap inside the token
    worker.buf["routed"][0] = worker.buf["rows_flag"][0] = base - 1  # the previous token's last value
    got = []
    t = time.perf_counter()
    assert _serve(worker, base, lambda: got.extend(_play_device(worker, base, ids, xs, staged))) == -1
    wall = time.perf_counter() - t
    if cycles_per_second() > 0:  # x86: the layers' own time is counted, and is less than the call's
        assert (worker.busy > 0).all()
        assert 0 < worker.busy_seconds() < wall
        phases = worker.phase_cycles()  # [L, len(PHASES)]
        assert phases.shape == (len(layers), len(PHASES))
        if team:
            assert (phases >= 0).all() and np.array_equal(phases.sum(axis=1), worker.busy)
            assert np.array_equal(worker.stamps[:, -1], worker.n_miss)
        else:
            assert not phases.any()
    for layer, lay in enumerate(layers):
        all_miss = np.flatnonzero(res[layer * N_EXPERT + ids[layer]] < 0)
        miss = _cpu_entries(worker, layer, ids[layer], None if staged is None else staged[layer])
        assert worker.n_miss[layer] == miss.size
        assert worker.n_pcie[layer] == all_miss.size - miss.size
        if staged is not None:
            routed_ahead = [e for e in ids[layer, all_miss] if e in staged[layer]]
            assert worker.n_ahead[layer].tolist() == [len(routed_ahead), int((staged[layer] >= 0).sum())]
        else:
            assert not worker.n_ahead[layer].any()
        assert (worker.seen_ids[layer] == ids[layer]).all()
        if miss.size:
            want = expert_ffn_cpu(xs[layer], np.zeros(miss.size, np.int64), ids[layer, miss], lay)
            assert np.array_equal(got[layer][miss].view(np.uint32), want.view(np.uint32)), layer


def test_a_residency_snapshot_plans_the_token_and_outputs_are_copies(rng):
    """run(base, res): the token's misses are those of the snapshot given, not of the constructor's table
    (the chained decode's boundaries change that one while a token runs); outputs() are copies that the
    next call cannot touch; a snapshot of another shape is refused with one line."""
    layers = [layer_for(name, N_EXPERT) for name in LAYERS]
    k = 5
    live = np.full(len(layers) * N_EXPERT, -1, np.int32)  # the constructor's table: every expert a miss
    snap = live.copy()
    snap[rng.choice(snap.size, snap.size // 2, replace=False)] = 0  # the token's: half resident
    ids = np.stack([np.sort(rng.choice(N_EXPERT, k, replace=False)) for _ in layers])  # [L, K]
    worker = CpuTokenRows(layers, live, k, n_threads=2)
    b, base = worker.buf, 5
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", worker.run(base, snap)), daemon=True)
    thread.start()
    try:
        for layer in range(len(layers)):
            b["ids"][:] = ids[layer]
            worker.put_x(rng.standard_normal((1, N_EMBD)).astype(np.float32))
            b["routed"][0] = base + layer
            _wait(b["rows_flag"], base + layer)
        thread.join(60)
    finally:
        worker.stop()
        thread.join(60)
    assert result["rc"] == -1
    want = [int((snap[layer * N_EXPERT + ids[layer]] < 0).sum()) for layer in range(len(layers))]
    assert worker.n_miss.tolist() == want and 0 < sum(want) < k * len(layers)
    out = worker.outputs()
    worker.n_miss[:] = 99
    worker.seen_ids[:] = -7
    assert out.n_miss.tolist() == want and (out.seen_ids == ids).all()
    with pytest.raises(KernelError, match="res must be C-contiguous int32"):
        worker.run(base, snap[:-1])


@pytest.mark.parametrize("predict,form", [("routed", GATHER), ("wrong", GATHER), ("some", GATHER),
                                          ("routed", COUNTER), ("routed", DYNAMIC)])
def test_warming_ahead_keeps_the_rows_and_counts_the_prediction(predict, form, rng):
    """warm: the team reads each layer's predicted CPU rows ahead. Whatever the prediction (the routing
    itself, another one with an id out of range in one layer, none in some layers), the rows, entries and
    ids are the cold team's; n_warm counts the predicted CPU entries and those the routing kept."""
    layers = [layer_for(name, N_EXPERT) for name in LAYERS]
    res = np.full(len(layers) * N_EXPERT, -1, np.int32)
    res[rng.choice(res.size, res.size // 3, replace=False)] = 0
    k, ahead = 5, 2
    ids = np.stack([rng.choice(N_EXPERT, k, replace=False) for _ in layers])  # [L, K] rank order
    xs = rng.standard_normal((len(layers), 1, N_EMBD)).astype(np.float32)
    staged = rng.choice(N_EXPERT, (len(layers), ahead)).astype(np.int64)
    staged[:, 0] = ids[:, 0]
    preds = ids.copy()
    if predict == "wrong":
        preds = np.stack([rng.choice(N_EXPERT, k, replace=False) for _ in layers])
        preds[2, 0] = ids[2, 1]
        preds[1, 3] = N_EXPERT  # out of range: that layer warms nothing
    elif predict == "some":
        preds[1] = -1  # no prediction for layer 1: its wait is the routing's alone
    runs = []
    for warm in (False, True):
        worker = CpuTokenRows(layers, res, k, n_threads=2, n_staged=ahead, warm=warm, form=form)
        assert worker.team and worker.warm == warm
        worker.shares[:] = (400, 0, 600)
        base = 0xFFFFFFFE
        for flag in ("routed", "rows_flag", "predicted"):
            worker.buf[flag][0] = base - 1
        got = []
        assert _serve(worker, base, lambda w=worker, got=got, base=base: got.extend(
            _play_device(w, base, ids, xs, staged, preds))) == -1
        runs.append((got, worker))
    (cold, w0), (warmed, w1) = runs
    for layer in range(len(layers)):
        assert np.array_equal(cold[layer].view(np.uint32), warmed[layer].view(np.uint32)), layer
        for name in ("n_miss", "n_pcie", "n_ahead", "seen_ids"):
            assert np.array_equal(getattr(w0, name)[layer], getattr(w1, name)[layer]), name
        cpu = set(ids[layer, _cpu_entries(w1, layer, ids[layer], staged[layer])].tolist())
        if preds[layer, 0] < 0 or preds[layer].max() >= N_EXPERT:
            assert w1.n_warm[layer].tolist() == [0, 0]
        else:
            pred_cpu = set(preds[layer, _cpu_entries(w1, layer, preds[layer], staged[layer])].tolist())
            assert w1.n_warm[layer].tolist() == [len(pred_cpu), len(pred_cpu & cpu)]
    assert not w0.n_warm.any()
    if predict == "routed":
        assert (w1.n_warm[:, 0] == w1.n_warm[:, 1]).all() and (w1.n_warm[:, 1] == w1.n_miss).all()


def test_warm_share_reads_what_the_rows_shares_will(rng):
    """The members' warm_share reads together cover each predicted expert's gate, up and down rows, one byte
    in 64 of each row, once (the sums add up to the plain twin's), split as the rows' shares split them;
    a routing already there stops it at once."""
    from strata_ray.kernels.contract import readonly_blocks
    from strata_ray.kernels.expert_cpu_token import warm_share

    lay = layer_for("Q4_0", N_EXPERT)
    g_exp = np.array([2, 9, 30], np.int64)
    routed = np.zeros(1, np.uint32)

    def plain(w):
        return int(w[g_exp][:, :, ::64].astype(np.int64).sum())

    want = plain(lay.gate) + plain(lay.up) + plain(lay.down)
    # the worker's argument types (read-only weights, a uint32 flag value): no compile of another signature
    gate, up, down = (readonly_blocks(w) for w in (lay.gate, lay.up, lay.down))
    one = np.uint32(1)
    for unit_rows in (HALF_ROWS, ROWS):
        for n_team in (1, 2, 5, 64):
            got = [warm_share(gate, up, down, g_exp, t, n_team, routed, one, unit_rows)
                   for t in range(n_team)]
            assert sum(got) == want, (unit_rows, n_team)
    routed[0] = 1
    assert warm_share(gate, up, down, g_exp, 0, 2, routed, one, HALF_ROWS) == 0


@pytest.mark.parametrize("n_threads", [1, 2])
def test_stop_ends_a_wait_and_says_where(n_threads, rng):
    """1 thread: token_rows; 2: the team, whose other member waits for the planner and leaves with it."""
    layers = [layer_for("Q4_0", N_EXPERT)] * 2
    worker = CpuTokenRows(layers, np.full(2 * N_EXPERT, -1, np.int32), 2, n_threads=n_threads)
    assert worker.team == (n_threads == 2)
    b = worker.buf
    b["rows_flag"][0] = 6

    def layer_0_only():  # layer 1's routing never comes
        b["ids"][:] = [3, 4]
        worker.put_x(rng.standard_normal((1, N_EMBD)).astype(np.float32))
        b["routed"][0] = 7
        _wait(b["rows_flag"], 7)
        worker.stop()  # the worker now waits for layer 1: this ends that wait

    assert _serve(worker, 7, layer_0_only) == 1


def test_stop_ends_the_wait_for_a_prediction(rng):
    """A warming team waits for a layer's prediction or its routing: a stop there ends the token too."""
    layers = [layer_for("Q4_0", N_EXPERT)] * 2
    worker = CpuTokenRows(layers, np.full(2 * N_EXPERT, -1, np.int32), 2, n_threads=2, warm=True)
    assert worker.warm
    # nothing ever comes for layer 0: stopped after 50 ms (not after _serve's 60 s wait for the worker)
    assert _serve(worker, 7, lambda: (time.sleep(0.05), worker.stop())) == 0


def test_bad_layers_and_buffers_are_one_line_errors():
    lay = layer_for("Q4_0", N_EXPERT)
    res = np.full(N_EXPERT, -1, np.int32)
    with pytest.raises(KernelError, match="quantized expert layers only"):
        CpuTokenRows([layer_for("F16", N_EXPERT)], res, 2, 1)
    with pytest.raises(KernelError, match="res must be int32"):
        CpuTokenRows([lay], res[:-1], 2, 1)
    with pytest.raises(KernelError, match="buffer rows must be"):
        CpuTokenRows([lay], res, 2, 1, buffers={"rows": np.zeros((3, N_EMBD), np.float32)})
    with pytest.raises(KernelError, match="a gate/up unit is 8 or 16 weight rows, not 12"):
        CpuTokenRows([lay], res, 2, 1, unit_rows=12)


@pytest.mark.parametrize("m,n_down", [(1, 1), (1, 15), (3, 14), (2, 5)])
def test_the_down_prefetch_covers_each_members_down_units(m, n_down):
    """The units a member prefetches once its gate/up share is done (prefetch_down_share) are the bytes
    down_share reads for it: the members' ranges tile the m experts' down matrices exactly, and the hints
    change nothing (the bytes, and the rows, elsewhere)."""
    from strata_ray.kernels.expert_cpu_kernels import _share
    from strata_ray.kernels.expert_cpu_token import down_tile_bytes, prefetch_down_share

    down = readonly_blocks(layer_for("Q4_0", N_EXPERT).down)  # uint8 [X, n_embd, RB], as the worker holds it
    g_exp = np.sort(np.random.default_rng(m).choice(N_EXPERT, m, replace=False)).astype(np.int64)
    tiles = down.shape[1] // 32
    seen = np.zeros(down.size, np.int64)
    for t in range(n_down):
        k0, k1 = _share(m * tiles, t, n_down)
        for k in range(k0, k1):
            start, stop = down_tile_bytes(down, g_exp, k)
            seen[start:stop] += 1
        prefetch_down_share(down, g_exp, np.int64(t), np.int64(n_down))
    per_expert = down[0].size
    want = np.zeros(down.size, np.int64)
    for e in g_exp:
        want[e * per_expert:(e + 1) * per_expert] = 1
    assert np.array_equal(seen, want)


def test_the_cycle_rate_holds_in_a_fresh_process():
    # the first cycles() call of a process loads it from numba's cache (tens of ms): timed inside the span it
    # made the rate ~3e4 a second and the decode's CPU-pool time 10^5 too long (session 38, H100 host)
    code = ("import platform; from strata_ray.kernels.cpu_token_rows import cycles_per_second; "
            "print(platform.machine(), cycles_per_second())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    machine, rate = r.stdout.split()
    if machine in ("x86_64", "AMD64"):
        assert 1e8 < float(rate) < 1e11, r.stdout
    else:
        assert float(rate) == 0.0
