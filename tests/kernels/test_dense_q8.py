"""Dense Q8_0 weights and their linear (strata_ray/kernels/dense_q8.py).

CPU tests run in CI. GPU tests: python -m pytest -m gpu tests/kernels/test_dense_q8.py.
Triton-interpreter tests (the GEMV's indexing, masks and sums on the CPU): on CPU machines with triton
(tests/kernels/triton_interpret.py; STRATA_TRITON_INTERPRET=1 forces it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gguf_quants

from strata_ray.kernels.dense_q8 import (
    GEMV_MAX_TOKENS,
    Q8Weight,
    fuse_rows,
    gemv_tiles,
    q8_gemv,
    q8_linear,
    q8_linear_reference,
    q8_linear_rows,
)
from strata_ray.model import quants
from tests.kernels.triton_interpret import interpret

Q8_0 = GGMLQuantizationType.Q8_0
EPS32 = float(np.finfo(np.float32).eps)
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _raw(rng: np.random.Generator, n: int, k: int, scale: float = 1.0) -> np.ndarray:
    """GGUF Q8_0 bytes uint8 [n, k/32*34] of a random float matrix, from gguf-py's own quantizer."""
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    return gguf_quants.quantize(w, Q8_0)


def _weight(n: int, k: int, device="cpu", seed: int = 0) -> tuple[Q8Weight, np.ndarray]:
    raw = _raw(np.random.default_rng(seed + 1000 * n + k), n, k)
    return Q8Weight.from_blocks(raw, n, k, device), raw


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy().view(np.int32)


def _assert_close_to_exact(got: torch.Tensor, x: torch.Tensor, w: Q8Weight, ulps: float = 16.0) -> None:
    """|got - exact| <= ulps * eps32 * sum_k |w_nk x_k| (+ tiny), exact = the float64 dot of the same
    dequantized weights. Measured worst under the interpreter: 0.3 (GEMV) and 0.6 (CPU F.linear)."""
    deq = w.dequantize().double()
    exact = F.linear(x.double(), deq)
    bound = ulps * EPS32 * F.linear(x.double().abs(), deq.abs()) + 1e-30
    err = (got.double() - exact).abs()
    assert not torch.isnan(got).any()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max err {err.max().item():.3e}, worst err/bound {worst:.2f}"


# ---- Q8Weight (CPU, CI) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(1, 32), (33, 96), (100, 2048)])
def test_from_blocks_dequantizes_like_gguf_bit_for_bit(n, k):
    w, raw = _weight(n, k)
    assert w.shape == torch.Size([n, k]) and w.device == torch.device("cpu")
    assert w.qs.dtype == torch.int8 and w.d.dtype == torch.float16 and tuple(w.d.shape) == (n, k // 32)
    assert w.nbytes == n * k + 2 * n * (k // 32) == raw.nbytes // 34 * 34
    want = gguf_quants.dequantize(raw, Q8_0)
    assert np.array_equal(_bits(w.dequantize()), want.view(np.int32))
    assert np.array_equal(_bits(w.dequantize()), quants.dequantize(raw, Q8_0, (n, k)).view(np.int32))
    # flat numpy bytes and a uint8 tensor give the same weight
    for src in (raw.reshape(-1), torch.from_numpy(raw)):
        other = Q8Weight.from_blocks(src, n, k)
        assert torch.equal(other.qs, w.qs) and np.array_equal(_bits(other.d.float()), _bits(w.d.float()))


def test_from_blocks_reads_a_gguf_file_map(tmp_path):
    """A Q8_0 tensor written by gguf-py's GGUFWriter, read back through a read-only memmap."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((48, 320)).astype(np.float32)
    path = tmp_path / "q8.gguf"
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_tensor("blk.0.attn_q.weight", gguf_quants.quantize(x, Q8_0), raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = GGUFReader(str(path)).tensors[0]
    w = Q8Weight.from_blocks(np.asarray(t.data), 48, 320)
    want = gguf_quants.dequantize(np.asarray(t.data), Q8_0)
    assert np.array_equal(_bits(w.dequantize()), want.view(np.int32))


def test_rows_equal_dequantized_rows():
    w, _ = _weight(33, 96)
    deq = w.dequantize()
    idx = torch.tensor([0, 32, 5, 5, 17])
    assert np.array_equal(_bits(w.rows(idx)), _bits(deq[idx]))
    assert np.array_equal(_bits(w.rows([3, 1])), _bits(deq[[3, 1]]))
    grid = torch.tensor([[1, 2], [30, 0]])  # any index shape -> [*idx.shape, K]
    assert w.rows(grid).shape == (2, 2, 96)
    assert np.array_equal(_bits(w.rows(grid)), _bits(deq[grid]))


def test_to_and_repr():
    w, _ = _weight(4, 64)
    m = w.to("meta")
    assert m.device.type == "meta" and m.shape == w.shape and m.nbytes == w.nbytes
    assert "Q8Weight([4, 64]" in repr(w)


def test_weight_errors_are_one_line():
    qs = torch.zeros(4, 64, dtype=torch.int8)
    d = torch.zeros(4, 2, dtype=torch.float16)
    cases = [
        (lambda: Q8Weight(qs.float(), d), "qs must be int8"),
        (lambda: Q8Weight(torch.zeros(4, 48, dtype=torch.int8), d), "K a positive multiple of 32"),
        (lambda: Q8Weight(qs, torch.zeros(4, 3, dtype=torch.float16)), r"d must be float16 \[4, 2\]"),
        (lambda: Q8Weight(qs, d.float()), "d must be float16"),
        (lambda: Q8Weight(qs, d.to("meta")), "qs on cpu but d on meta"),
        (lambda: Q8Weight.from_blocks(np.zeros(67, np.uint8), 2, 32), "needs 68 uint8 bytes, got 67"),
        (lambda: Q8Weight.from_blocks(np.zeros(68, np.int8), 2, 32), "needs 68 uint8 bytes"),
        (lambda: Q8Weight.from_blocks(np.zeros(68, np.uint8), 2, 33), "K a multiple of 32 > 0"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            fn()
        assert "\n" not in str(e.value)


# ---- q8_linear on the CPU: today's bits (CI) ---------------------------------------------------------------


@pytest.mark.parametrize("k", [32, 96, 2048])
@pytest.mark.parametrize("n", [1, 33, 100])
def test_cpu_linear_is_f_linear_of_dequantized_bits(n, k):
    w, _ = _weight(n, k)
    deq = w.dequantize()
    rng = np.random.default_rng(n + k)
    for t in (1, 33, 222):
        x = torch.from_numpy(rng.standard_normal((t, k)).astype(np.float32))
        assert np.array_equal(_bits(q8_linear(x, w)), _bits(F.linear(x, deq))), (n, k, t)
    x3 = torch.from_numpy(rng.standard_normal((2, 3, k)).astype(np.float32))  # leading dims kept
    y3 = q8_linear(x3, w)
    assert y3.shape == (2, 3, n) and np.array_equal(_bits(y3), _bits(F.linear(x3, deq)))
    assert np.array_equal(_bits(q8_linear_reference(x3, w)), _bits(y3))


def test_fused_rows_are_views_of_one_matrix_and_the_same_linear_on_cpu():
    parts = [_weight(n, 96)[0] for n in (33, 7, 2)]
    views = fuse_rows(parts)
    whole, _ = views[0].fused
    assert whole.shape == (42, 96) and [v.fused[1] for v in views] == [0, 33, 40]
    for v, p in zip(views, parts, strict=True):
        assert torch.equal(v.qs, p.qs) and torch.equal(v.d, p.d)
        assert v.qs.data_ptr() == whole.qs[v.fused[1]].data_ptr()  # a view: stored once
    x = torch.randn(3, 96)
    got = q8_linear_rows(x, views)
    assert all(torch.equal(a, q8_linear(x, p)) for a, p in zip(got, parts, strict=True))
    # not the whole fused matrix in order: each matrix on its own (the same values)
    assert all(torch.equal(a, q8_linear(x, p)) for a, p in zip(q8_linear_rows(x, views[1:]), parts[1:],
                                                                  strict=True))
    with pytest.raises(ValueError, match="share their width"):
        fuse_rows([parts[0], _weight(4, 64)[0]])


def test_linear_errors_are_one_line():
    w, _ = _weight(8, 64)
    cases = [
        (torch.zeros(2, 64, dtype=torch.float64), "needs float32 x, got torch.float64"),
        (torch.zeros(2, 64, dtype=torch.float16), "needs float32 x"),
        (torch.zeros(2, 32), r"x \[2, 32\] does not end in K=64"),
        (torch.zeros(()), "does not end in K=64"),
        (torch.zeros(2, 64, device="meta"), "x on meta but weight on cpu"),
    ]
    for x, msg in cases:
        for fn in (q8_linear, q8_linear_reference):
            with pytest.raises(ValueError, match=msg) as e:
                fn(x, w)
            assert "\n" not in str(e.value)


def test_tiles_depend_on_the_shape_only():
    for n, k in [(1, 32), (33, 96), (2048, 4096), (8192, 2048), (151936, 2048), (5000, 2880)]:
        bn, bk, warps = gemv_tiles(n, k)
        assert bn & (bn - 1) == 0 and bk & (bk - 1) == 0 and 32 <= bk <= 1024 and warps >= 1
        assert 2 <= bn <= 16 and bk <= max(32, 1 << (k - 1).bit_length())
    # the sweep's winners on the H200 (session 7)
    assert gemv_tiles(8192, 2048) == (8, 512, 4) and gemv_tiles(151936, 2048) == (16, 256, 4)
    assert gemv_tiles(2048, 4096) == (2, 1024, 4)


def test_module_imports_and_runs_on_cpu_without_triton():
    """CI has no triton: importing the module and the CPU path must not touch it."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from strata_ray.kernels.dense_q8 import Q8Weight, q8_linear\n"
            "w = Q8Weight(torch.ones(3, 32, dtype=torch.int8), torch.ones(3, 1, dtype=torch.float16))\n"
            "assert q8_linear(torch.ones(2, 32), w).tolist() == [[32.0] * 3] * 2\n")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# ---- the Triton GEMV under the CPU interpreter (opt-in) ----------------------------------------------------



def _need_triton():
    pytest.importorskip("triton")


@interpret
@pytest.mark.parametrize("n,k,t", [(1, 32, 1), (33, 96, 3), (100, 2048, 2), (300, 1280, 5), (7, 4096, 16)])
def test_interpreted_gemv_matches_exact(n, k, t):
    """(1280: a full 1024 chunk then a ragged one; 96: one ragged 128 chunk; 33/100/300/7 rows: a
    clamped last row block.)"""
    _need_triton()
    w, _ = _weight(n, k)
    x = torch.from_numpy(np.random.default_rng(t).standard_normal((t, k)).astype(np.float32))
    out = torch.full((t, n), float("nan"))  # poisoned: every element must be written
    got = q8_gemv(x, w, out=out)
    assert got.data_ptr() == out.data_ptr()
    _assert_close_to_exact(got, x, w)
    for i in range(t):  # each token's row alone gives its row of the batch
        assert np.array_equal(_bits(q8_gemv(x[i:i + 1], w)), _bits(got[i:i + 1])), i


@interpret
def test_interpreted_gemv_other_tiles():
    _need_triton()
    w, _ = _weight(70, 2048)
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((2, 2048)).astype(np.float32))
    for tiles in [(1, 32, 4), (2, 256, 1), (8, 1024, 8), (16, 512, 4), (32, 128, 2), (16, 256, 4)]:
        _assert_close_to_exact(q8_gemv(x, w, tiles=tiles), x, w)


@interpret
def test_interpreted_gemv_errors():
    _need_triton()
    w, _ = _weight(8, 64)
    with pytest.raises(ValueError, match=r"out must be contiguous float32 \[2, 8\]"):
        q8_gemv(torch.zeros(2, 64), w, out=torch.zeros(2, 9))
    with pytest.raises(ValueError, match="contiguous"):
        q8_gemv(torch.zeros(64, 2).t(), w)
    assert q8_gemv(torch.zeros(0, 64), w).shape == (0, 8)


# ---- GPU ---------------------------------------------------------------------------------------------------


@pytest.fixture(params=["cuda", "triton"])
def gemv_form(request, monkeypatch):
    """Both decode GEMVs: the CUDA C kernel (dense_q8_cuda, where cupy is installed) and the Triton one."""
    if request.param == "cuda":
        pytest.importorskip("cupy")
    monkeypatch.setenv("STRATA_DENSE_CUDA", "1" if request.param == "cuda" else "0")
    return request.param


@pytest.fixture
def exact_fp32_matmul():
    """cuBLAS in plain fp32 (TF32 off) for the prompt-path comparisons."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [96, 2048])
@pytest.mark.parametrize("n", [1, 33, 8192])
def test_gpu_gemv_matches_exact(n, k, gemv_form):
    w, _ = _weight(n, k, "cuda")
    rng = np.random.default_rng(n * k)
    for t in (1, 3, 16):
        x = torch.from_numpy(rng.standard_normal((t, k)).astype(np.float32)).cuda()
        out = torch.full((t, n), float("nan"), device="cuda")  # poisoned
        got = q8_gemv(x, w, out=out)
        assert got.data_ptr() == out.data_ptr()
        _assert_close_to_exact(got, x, w)
        assert np.array_equal(_bits(q8_linear(x, w)), _bits(got))  # q8_linear takes this path


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(33, 96), (8192, 2048), (2048, 4096), (1000, 1280)])
def test_gpu_gemv_is_batch_invariant(n, k, gemv_form):
    """A token's row is bit-identical whether it runs alone, in a batch of 5 or in one of 16."""
    w, _ = _weight(n, k, "cuda")
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((16, k)).astype(np.float32)).cuda()
    y16 = q8_linear(x, w)
    for t in range(16):
        assert np.array_equal(_bits(q8_linear(x[t:t + 1], w)), _bits(y16[t:t + 1])), t
        assert np.array_equal(_bits(q8_linear(x[t], w)), _bits(y16[t])), t  # a 1-D x
    assert np.array_equal(_bits(q8_linear(x[3:8], w)), _bits(y16[3:8]))
    assert np.array_equal(_bits(q8_linear(x.view(2, 8, k), w)), _bits(y16.view(2, 8, n)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 5, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1, 33])
def test_gpu_fused_rows_are_one_gemv_over_the_whole(t, gemv_form):
    """Views of one fused matrix: a decode call is the GEMV over the whole matrix, split (one launch, its
    rows batch invariant); a prompt call is each matrix's own cuBLAS path."""
    parts = [_weight(n, 2048, "cuda", seed=n)[0] for n in (8192, 4096, 64)]  # the GDN's qkv | z | ba
    views = fuse_rows(parts)
    x = torch.from_numpy(np.random.default_rng(t).standard_normal((t, 2048)).astype(np.float32)).cuda()
    got = q8_linear_rows(x, views)
    if t <= GEMV_MAX_TOKENS:
        whole = q8_linear(x, views[0].fused[0])
        assert np.array_equal(_bits(torch.cat(got, dim=-1)), _bits(whole))
        one = q8_linear_rows(x[-1:], views)  # the last token alone: its row of the batch
        assert all(np.array_equal(_bits(a), _bits(b[-1:])) for a, b in zip(one, got, strict=True))
    else:
        assert all(np.array_equal(_bits(a), _bits(q8_linear(x, p))) for a, p in zip(got, parts, strict=True))
    for a, p in zip(got, parts, strict=True):
        _assert_close_to_exact(a, x, p)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [GEMV_MAX_TOKENS + 1, 222])
def test_gpu_prompt_path_is_cublas_of_dequantized(t, exact_fp32_matmul):
    w, _ = _weight(8192, 2048, "cuda")
    x = torch.from_numpy(np.random.default_rng(t).standard_normal((t, 2048)).astype(np.float32)).cuda()
    got = q8_linear(x, w)
    assert np.array_equal(_bits(got), _bits(F.linear(x, w.dequantize())))
    _assert_close_to_exact(got, x, w)


@pytest.mark.gpu
@gpu
def test_gpu_prompt_path_dequantizes_a_big_weight_in_row_chunks(monkeypatch, exact_fp32_matmul):
    """Past DEQUANT_CHUNK_BYTES the float32 copy is made a few rows at a time (a ragged last chunk here):
    every output column is still cuBLAS over its dequantized rows."""
    import strata_ray.kernels.dense_q8 as dq

    monkeypatch.setattr(dq, "DEQUANT_CHUNK_BYTES", 4 * 2048 * 300)  # 300 rows a chunk of 1000
    w, _ = _weight(1000, 2048, "cuda")
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((40, 2048)).astype(np.float32)).cuda()
    got = dq.q8_linear(x, w)
    for r0 in range(0, 1000, 300):
        part = F.linear(x, w.dequantize()[r0 : r0 + 300])
        assert np.array_equal(_bits(got[:, r0 : r0 + 300]), _bits(part)), r0
    _assert_close_to_exact(got, x, w)


@pytest.mark.gpu
@gpu
def test_gpu_weight_matches_cpu_weight():
    w, raw = _weight(100, 2048, "cuda")
    assert w.device.type == "cuda"
    assert np.array_equal(_bits(w.dequantize()), gguf_quants.dequantize(raw, Q8_0).view(np.int32))
    idx = torch.tensor([99, 0, 7], device="cuda")
    assert np.array_equal(_bits(w.rows(idx)), _bits(w.dequantize()[idx]))
    cpu = w.to("cpu")
    assert cpu.device.type == "cpu" and torch.equal(cpu.qs, w.qs.cpu())
    w2 = Q8Weight.from_blocks(torch.from_numpy(raw).cuda(), 100, 2048, "cuda")  # split on the device
    assert torch.equal(w2.qs, w.qs) and torch.equal(w2.d, w.d)
    with pytest.raises(ValueError, match="x on cpu but weight on cuda"):
        q8_linear(torch.zeros(1, 2048), w)


@pytest.mark.gpu
@gpu
def test_gpu_gemv_replays_in_a_cuda_graph(gemv_form):
    """No host sync, no data-dependent allocation: capturable once compiled."""
    w, _ = _weight(2048, 4096, "cuda")
    x = torch.zeros(4, 4096, device="cuda")
    eager = q8_linear(x, w)  # compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = q8_linear(x, w)
    x.copy_(torch.from_numpy(np.random.default_rng(1).standard_normal((4, 4096)).astype(np.float32)))
    graph.replay()
    torch.cuda.synchronize()
    assert np.array_equal(_bits(y), _bits(q8_linear(x, w)))
    assert not torch.equal(y, eager)

