"""numba expert FFN: bit-exact with the numpy spec, close to the float reference, batch invariant."""

from __future__ import annotations

import numpy as np
import pytest

from strata_ray.kernels.block_dots import HALF_ROWS, ROWS
from strata_ray.kernels.contract import Q4_0, Q8_0, ExpertLayer, KernelError
from strata_ray.kernels.cpu_pool import CpuPool
from strata_ray.kernels.expert_cpu import (
    expert_ffn_cpu,
    expert_ffn_cpu_token,
    group_arrays,
    group_entries,
    token_form_fits,
    token_layer,
)
from strata_ray.kernels.reference import expert_ffn_ref
from strata_ray.kernels.spec import expert_ffn_spec
from tests.kernels.layers import FLOAT_SETS, N_EMBD, TYPE_SETS, entries, layer_for


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _bits_equal(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.int32), np.asarray(b, np.float32).view(np.int32))


@pytest.mark.parametrize("name", [*TYPE_SETS, *FLOAT_SETS])
@pytest.mark.parametrize("n_entries,n_expert", [(1, 1), (1, 37), (33, 37), (222, 37), (33, 1), (222, 1)])
def test_matches_spec_and_reference(name, n_entries, n_expert, rng):
    layer = layer_for(name)
    x = rng.standard_normal((50, N_EMBD)).astype(np.float32)
    tok, exp = entries(rng, 50, n_entries, n_expert)
    rows = expert_ffn_cpu(x, tok, exp, layer)
    assert rows.shape == (n_entries, N_EMBD) and rows.dtype == np.float32
    assert _bits_equal(rows, expert_ffn_spec(x, tok, exp, layer))
    # Stated tolerances: vs float math the int8 activations cost ~1% of the row norm; with the
    # activations rounded the same way only fp32 ordering (and rare requantization flips) remain.
    ref = expert_ffn_ref(x, tok, exp, layer)
    assert _rel(rows, ref) < (2e-6 if name in FLOAT_SETS else 0.03)
    assert _rel(rows, expert_ffn_ref(x, tok, exp, layer, quantize_acts=True)) < 2e-3


@pytest.mark.parametrize("name", [*TYPE_SETS, *FLOAT_SETS])
def test_batch_invariance(name, rng):
    """An expert's rows are identical alone or with others, for 1 token or 200 (the float path too: its
    promise is determinism on one device, which this is)."""
    layer = layer_for(name)
    x = rng.standard_normal((200, N_EMBD)).astype(np.float32)
    tok, exp = entries(rng, 200, 0, 37, k=4)
    many = expert_ffn_cpu(x, tok, exp, layer)
    for m in rng.choice(len(tok), 40, replace=False):
        alone = expert_ffn_cpu(x[tok[m]:tok[m] + 1], np.zeros(1, np.int32), exp[m:m + 1], layer)
        assert _bits_equal(alone[0], many[m])
    # Same expert for every token, one thread vs the pool: same bits.
    e = np.full(200, exp[0], np.int32)
    with CpuPool(1) as one:
        assert _bits_equal(expert_ffn_cpu(x, np.arange(200, dtype=np.int32), e, layer, pool=one),
                           expert_ffn_cpu(x, np.arange(200, dtype=np.int32), e, layer))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_numba_threads_and_python_pool_give_the_same_bits(name, rng):
    """The numba parallel driver, the Python-thread pool and one thread split the (expert, tile) space
    differently (3 and 5 shares here); the rows may not change."""
    layer = layer_for(name)
    x = rng.standard_normal((33, N_EMBD)).astype(np.float32)
    tok, exp = entries(rng, 33, 0, 37, k=3)
    with CpuPool(1) as one:
        want = expert_ffn_cpu(x, tok, exp, layer, pool=one)
    for n in (3, 5):
        for numba_parallel in (True, False):
            with CpuPool(n, numba_parallel=numba_parallel) as pool:
                assert _bits_equal(expert_ffn_cpu(x, tok, exp, layer, pool=pool), want), (n, numba_parallel)


def test_started_is_set_before_the_kernels_and_changes_no_bits(rng):
    """`started` (for a caller on another thread) is set by the time the call returns, also for no entries
    and for float layers; the rows are those of a call without it."""
    import threading

    x = rng.standard_normal((5, N_EMBD)).astype(np.float32)
    tok, exp = entries(rng, 5, 0, 7, k=2)
    for layer, t, e in ((layer_for("Q4_0"), tok, exp), (layer_for("Q4_0"), tok[:0], exp[:0]),
                        (layer_for("F16"), tok, exp)):
        started = threading.Event()
        with CpuPool(1) as one:
            got = expert_ffn_cpu(x, t, e, layer, pool=one, started=started)
            assert started.is_set()
            assert _bits_equal(got, expert_ffn_cpu(x, t, e, layer, pool=one))


@pytest.mark.parametrize("n_threads,numba_parallel,name", [(2, True, "Q4_0"), (2, False, "Q4_0"),
                                                           (1, True, "Q4_0"), (2, True, "F16")])
def test_out_and_done_flag(n_threads, numba_parallel, name, rng):
    """`out` receives the rows (a caller's pinned buffer) and `done` raises its flag once they are there:
    from inside the parallel kernel, or from Python on the other paths. The bits do not change."""
    layer = layer_for(name)
    x = rng.standard_normal((1, N_EMBD)).astype(np.float32)
    tok, exp = entries(rng, 1, 0, 37, k=5)
    with CpuPool(n_threads, numba_parallel=numba_parallel) as pool:
        want = expert_ffn_cpu(x, tok, exp, layer, pool=pool)
        buf = np.full((8, N_EMBD), np.nan, np.float32)  # [K, E], the first M rows used
        flag = np.zeros(1, np.uint32)
        got = expert_ffn_cpu(x, tok, exp, layer, pool=pool, out=buf[:5], done=(flag, 0xFFFFFFFE))
    assert got.base is buf or got is buf[:5] or np.shares_memory(got, buf)
    assert _bits_equal(buf[:5], want) and np.isnan(buf[5:]).all()
    assert flag[0] == 0xFFFFFFFE
    with pytest.raises(KernelError, match="out must be"):
        expert_ffn_cpu(x, tok, exp, layer, pool=pool, out=buf[:4])


def test_reads_memory_mapped_bytes_in_place(tmp_path, rng):
    layer = layer_for("Q8_0")
    path = tmp_path / "experts.bin"
    parts = [layer.gate, layer.up, layer.down]
    np.concatenate([p.reshape(-1) for p in parts]).tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    views, off = [], 0
    for p in parts:
        views.append(mm[off:off + p.size].reshape(p.shape))
        off += p.size
    mapped = ExpertLayer(*views, Q8_0, Q8_0, Q8_0)
    x = rng.standard_normal((4, N_EMBD)).astype(np.float32)
    tok, exp = entries(rng, 4, 0, 37, k=3)
    assert _bits_equal(expert_ffn_cpu(x, tok, exp, mapped), expert_ffn_cpu(x, tok, exp, layer))


def test_group_entries():
    groups = group_entries(np.array([3, 1, 3, 0, 1]))
    assert [(e, list(ent)) for e, ent in groups] == [(0, [3]), (1, [1, 4]), (3, [0, 2])]


@pytest.mark.parametrize("exp", [[3, 1, 3, 0, 1], [7], [2, 2, 2],
                                 list(np.random.default_rng(3).integers(0, 9, 222))])
def test_group_arrays_are_group_entries_flattened(exp):
    exp = np.array(exp, np.int64)
    ents, g_start, g_exp = group_arrays(exp)
    groups = group_entries(exp)
    assert g_exp.tolist() == [e for e, _ in groups]
    assert ents.tolist() == [int(i) for _, ent in groups for i in ent]
    assert g_start.tolist() == np.cumsum([0] + [len(ent) for _, ent in groups]).tolist()
    assert ents.dtype == g_start.dtype == g_exp.dtype == np.int64


def test_errors_are_one_line(rng):
    layer = layer_for("Q8_0")
    x = np.zeros((2, N_EMBD), np.float32)
    with pytest.raises(KernelError, match="out of range"):
        expert_ffn_cpu(x, np.array([0], np.int32), np.array([99], np.int32), layer)
    with pytest.raises(KernelError, match=r"x must be \[N, 256\]"):
        expert_ffn_cpu(x[:, :64], np.array([0], np.int32), np.array([0], np.int32), layer)
    bad = ExpertLayer(layer.gate, layer.up, layer.down, Q8_0, Q8_0, 99)
    with pytest.raises(KernelError, match="type 99"):
        expert_ffn_cpu(x, np.array([0], np.int32), np.array([0], np.int32), bad)
    assert expert_ffn_cpu(x, np.zeros(0, np.int32), np.zeros(0, np.int32), layer).shape == (0, N_EMBD)


@pytest.mark.parametrize("name", list(TYPE_SETS))
@pytest.mark.parametrize("n_tokens", [1, 33])
def test_team_gate_up_units_give_gate_up_shares_h(name, n_tokens, rng):
    """gate_up_rows_share (the CPU team's gate/up) in half-tile and whole-tile units over 1, 15 and 64
    members writes every value of h, and h is gate_up_share's to the bit: only the split moves."""
    from strata_ray.kernels.act_quant import quantize_act_sums
    from strata_ray.kernels.contract import readonly_blocks
    from strata_ray.kernels.expert_cpu_kernels import gate_up_rows_share, gate_up_share

    layer = layer_for(name)
    x = rng.standard_normal((n_tokens, N_EMBD)).astype(np.float32)
    tok, exp = entries(rng, n_tokens, 0, 37, k=3)
    tok, exp = tok.astype(np.int64), exp.astype(np.int64)
    xq, xd, xs = quantize_act_sums(x)
    ents, g_start, g_exp = group_arrays(exp)
    gate, up = readonly_blocks(layer.gate), readonly_blocks(layer.up)
    gtype, utype = int(layer.gate_type), int(layer.up_type)
    m, n_ff = len(tok), layer.n_ff
    want = np.full((m, n_ff), np.nan, np.float32)
    hq, hd, hs = np.empty((m, n_ff), np.int8), np.empty((m, n_ff // 32), np.float32), np.empty(
        (m, n_ff // 32), np.int32)
    gate_up_share(gate, gtype, up, utype, xq, xd, xs, tok, ents, g_start, g_exp, 0, 1, want, hq, hd, hs)
    for unit_rows in (HALF_ROWS, ROWS):
        for n_team in (1, 15, 64):
            h = np.full((m, n_ff), np.nan, np.float32)
            for t in range(n_team):
                gate_up_rows_share(gate, gtype, up, utype, xq, xd, xs, tok, ents, g_start, g_exp, t, n_team,
                                   unit_rows, h)
            assert _bits_equal(h, want), (unit_rows, n_team)


# Widths off the 256 of the shared layers: Q8_0 / Q4_0 rows of 3 and 5 blocks (a tail past the 8-block
# chunks), K-quant rows of 2 and 3 super-blocks.
AWKWARD = {"Q8_0": (96, 160), "Q4_0": (160, 96), "Q8_0+Q4_0": (224, 288), "Q4_K": (512, 768),
           "Q6_K": (768, 512), "Q4_K+Q6_K": (512, 256)}


@pytest.mark.parametrize("name", list(AWKWARD))
@pytest.mark.parametrize("n_entries,n_expert", [(1, 1), (1, 37), (33, 37), (222, 1)])
def test_awkward_widths_match_the_spec_in_every_driver(name, n_entries, n_expert, rng):
    from strata_ray.kernels.random_weights import random_layer

    n_embd, n_ff = AWKWARD[name]
    types = TYPE_SETS[name]
    layer = random_layer(np.random.default_rng(n_embd + n_ff), 37, n_embd, n_ff, types,
                         from_floats=types[0] in (Q8_0, Q4_0))
    x = rng.standard_normal((50, n_embd)).astype(np.float32)
    tok, exp = entries(rng, 50, n_entries, n_expert)
    want = expert_ffn_spec(x, tok, exp, layer)
    for pool in (CpuPool(1), CpuPool(3, numba_parallel=True), CpuPool(2, numba_parallel=False)):
        with pool:
            assert _bits_equal(expert_ffn_cpu(x, tok, exp, layer, pool=pool), want), pool.n_threads


@pytest.mark.parametrize("name", list(TYPE_SETS))
def test_a_nan_in_x_gives_nan_rows_for_its_token_only(name, rng):
    """A NaN (or an infinity) in a token's x poisons its blocks (contract step 1): every row of that token
    is NaN on every driver, as in the spec; the other tokens' rows keep their bits."""
    layer = layer_for(name)
    x = rng.standard_normal((4, N_EMBD)).astype(np.float32)
    tok, exp = entries(rng, 4, 0, 37, k=3)
    clean = expert_ffn_spec(x, tok, exp, layer)
    x[1, 100], x[2, 5] = np.nan, -np.inf
    want = expert_ffn_spec(x, tok, exp, layer)
    bad = np.isin(tok, [1, 2])
    assert np.isnan(want[bad]).all() and _bits_equal(want[~bad], clean[~bad])
    for pool in (CpuPool(1), CpuPool(2, numba_parallel=True)):
        with pool:
            assert _bits_equal(expert_ffn_cpu(x, tok, exp, layer, pool=pool), want)


@pytest.mark.parametrize("name", list(AWKWARD))
@pytest.mark.parametrize("ids", [[5], [3, 30], [36, 0, 17, 9, 21, 2, 11, 28], [4, 4, 19]])
def test_the_token_form_gives_expert_ffn_cpus_bits(name, ids, rng):
    """expert_ffn_cpu_token (a decode step's one token on the calling thread, each entry a group of its own)
    gives expert_ffn_cpu's rows to the bit, in entry order, at awkward widths and 1, 2 and 8 experts; a
    repeated expert (never from a top-k, but allowed) too."""
    from strata_ray.kernels.random_weights import random_layer

    n_embd, n_ff = AWKWARD[name]
    types = TYPE_SETS[name]
    layer = random_layer(np.random.default_rng(n_embd + n_ff), 37, n_embd, n_ff, types,
                         from_floats=types[0] in (Q8_0, Q4_0))
    x = rng.standard_normal((1, n_embd)).astype(np.float32)
    exp = np.array(ids, np.int64)
    rows = expert_ffn_cpu_token(x, exp, token_layer(layer))
    assert rows.shape == (len(ids), n_embd) and rows.dtype == np.float32
    with CpuPool(1) as one:
        assert _bits_equal(rows, expert_ffn_cpu(x, np.zeros(len(ids), np.int64), exp, layer, pool=one))
    assert _bits_equal(rows, expert_ffn_spec(x, np.zeros(len(ids), np.int64), exp, layer))


def test_the_token_form_refuses_in_one_line(rng):
    layer = layer_for("Q8_0")
    one = token_layer(layer)
    x = np.zeros((1, N_EMBD), np.float32)
    bad_ids = (np.array([37]), np.array([-1]), np.array([], np.int64), np.array([[1, 2]]), np.array([np.nan]))
    for exp in bad_ids:  # a NaN id casts to INT64_MIN (numpy warns: silenced), then is refused
        with pytest.raises(KernelError, match=r"ids \[K\] in \[0, 37\)"), np.errstate(invalid="ignore"):
            expert_ffn_cpu_token(x, exp, one)
    with pytest.raises(KernelError, match=r"one token \[1, 256\]"):
        expert_ffn_cpu_token(np.zeros((2, N_EMBD), np.float32), np.array([0], np.int64), one)
    with pytest.raises(KernelError, match="quantized experts only"):
        token_layer(layer_for("F16"))
    bad = ExpertLayer(layer.gate, layer.up, layer.down, Q8_0, Q8_0, 99)
    with pytest.raises(KernelError, match="type 99"):
        token_layer(bad)
    # a fused gate_up's halves are strided views: their read-only copy would hold the whole layer
    fused = np.concatenate([layer.gate, layer.up], axis=1)  # [X, 2 n_ff, RB]
    n_ff = layer.gate.shape[1]
    halves = ExpertLayer(fused[:, :n_ff], fused[:, n_ff:], layer.down, Q8_0, Q8_0, Q8_0)
    assert token_form_fits(layer) and not token_form_fits(halves) and not token_form_fits(layer_for("F16"))
    with pytest.raises(KernelError, match="contiguous expert matrices only"):
        token_layer(halves)


def test_the_token_form_compiles_nothing_new():
    """expert_ffn_cpu_token calls the kernels with expert_ffn_cpu's argument types: in a fresh process, after
    expert_ffn_cpu on a one-thread pool, it adds no numba signature (another would be a cold compile of
    minutes on a new machine). Read-only or strided expert ids are copied to those types too."""
    import subprocess
    import sys

    code = """
import numpy as np
from strata_ray.kernels.contract import Q4_0
from strata_ray.kernels.cpu_pool import CpuPool
from strata_ray.kernels.expert_cpu import expert_ffn_cpu, expert_ffn_cpu_token, token_layer
from strata_ray.kernels.expert_cpu_kernels import down_share, gate_up_share
from strata_ray.kernels.random_weights import random_layer
lay = random_layer(np.random.default_rng(0), 8, 256, 256, (Q4_0,) * 3, from_floats=True)
x = np.ones((1, 256), np.float32)
with CpuPool(1) as one:
    expert_ffn_cpu(x, np.zeros(2, np.int64), np.array([1, 3]), lay, pool=one)
before = (len(gate_up_share.signatures), len(down_share.signatures))
ids = np.array([[1, 3, 5, 7]])[0, ::2]
ids.flags.writeable = False
expert_ffn_cpu_token(x, ids, token_layer(lay))
print(before, (len(gate_up_share.signatures), len(down_share.signatures)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = out.stdout.strip().rsplit(") (", 1)
    assert before + ")" == "(" + after and before == "(1, 1", out.stdout


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K+Q6_K"])
def test_a_strided_layer_reads_only_its_routed_experts_with_the_same_bits(name, rng, monkeypatch):
    """A layer whose matrices are strided views (a fused gate_up's halves, the CPU slot tier's views of its
    store) gives the contiguous layer's bits in every driver, and only the routed experts are made C blocks:
    not the whole layer at every call."""
    import strata_ray.kernels.expert_cpu as expert_cpu

    layer = layer_for(name)
    fused = np.concatenate([layer.gate, layer.up], axis=1)  # [X, 2 n_ff, RB]
    n_ff = layer.gate.shape[1]
    halves = ExpertLayer(fused[:, :n_ff], fused[:, n_ff:], layer.down, *TYPE_SETS[name])
    x = rng.standard_normal((5, N_EMBD)).astype(np.float32)
    tok, exp = entries(rng, 5, 0, 37, k=3)
    exp[:3] = exp[3:6]  # repeats across tokens
    blocks = []
    readonly = expert_cpu.readonly_blocks
    monkeypatch.setattr(expert_cpu, "readonly_blocks", lambda w: blocks.append(w.shape[0]) or readonly(w))
    for pool in (CpuPool(1), CpuPool(2, numba_parallel=True), CpuPool(2, numba_parallel=False)):
        with pool:
            blocks.clear()
            assert _bits_equal(expert_ffn_cpu(x, tok, exp, halves, pool=pool),
                               expert_ffn_cpu(x, tok, exp, layer, pool=pool)), pool.n_threads
            assert blocks == [len(np.unique(exp))] * 3 + [37] * 3  # the strided call's, then the whole's
