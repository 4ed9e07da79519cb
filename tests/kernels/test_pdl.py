"""kernels/pdl: when the decode chain's Triton kernels take programmatic dependent launch, and (on a GPU) that
a chain of them captured in a CUDA graph with it gives the bits of the same launches without it."""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.pdl import pdl_args, pdl_on, pdl_value

HAS_CUDA = torch.cuda.is_available()


def test_off_for_cpu_tensors_and_the_switch(monkeypatch):
    monkeypatch.delenv("STRATA_PDL", raising=False)
    t = torch.zeros(4)
    assert not pdl_on(t) and pdl_args(t) == {"PDL": False}
    assert pdl_value("1") and not pdl_value("0")
    for bad in ("on", "", "2"):
        with pytest.raises(ValueError, match="0 or 1"):
            pdl_value(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_switch_and_device_decide_on_cuda(monkeypatch):
    t = torch.zeros(4, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    monkeypatch.delenv("STRATA_PDL", raising=False)
    if hopper:  # the GPU machine's H100 / H200 (and a Triton with launch_pdl: 3.6 there)
        assert pdl_on(t) and pdl_args(t) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("STRATA_PDL", "0")
    assert not pdl_on(t) and pdl_args(t) == {"PDL": False}
    monkeypatch.setenv("STRATA_PDL", "yes")
    with pytest.raises(ValueError, match=r"STRATA_PDL: invalid value 'yes' \(allowed: 0 or 1\)"):
        pdl_on(t)


def _chain(h, d, w_norm, w_router, w_q8, hit, inv, rows, cpu_rows, wts, k):
    """A decode layer's tail in the converted kernels, each reading the one before: the combine, the norm,
    a Q8_0 GEMV (CUDA C, where cupy builds it: the nvrtc launcher's PDL), the residual add + norm, the
    router's logits and top-k."""
    from strata_ray.kernels.dense_q8_cuda import launch_cuda_gemv
    from strata_ray.kernels.fused_small import add_rms_norm_fused, combine_fused, rms_norm_fused
    from strata_ray.kernels.router import route_topk, router_logits

    h_in = combine_fused(h, rows, wts, None, gather=(cpu_rows, hit, inv))  # [1, E]
    x = rms_norm_fused(h_in, w_norm, 1e-6)
    y = torch.zeros_like(x)
    launch_cuda_gemv(x, w_q8.qs, w_q8.d, y)  # [1, E] (left zeros where the CUDA C GEMV cannot run)
    s, xn = add_rms_norm_fused(h_in, y + d, w_norm, 1e-6)  # d: a stand-in for the mixer's output
    ids, weights = route_topk(router_logits(xn, w_router), k)
    return y, s, xn, ids, weights


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("e", [256, 2048])
def test_graphed_chain_with_pdl_gives_the_bits_without(monkeypatch, e):
    """Captured once with PDL (where the GPU has it), replayed over new inputs: every output equals the same
    launches made one by one without PDL, bit for bit (a kernel that read before its wait would not)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    K, X = 10, 512

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    from strata_ray.kernels.dense_q8 import Q8Weight

    w_norm, w_router = rand(e).abs(), rand(X, e) / e**0.5
    w_q8 = Q8Weight(torch.randint(-127, 128, (e, e), device="cuda", generator=g, dtype=torch.int8),
                    (rand(e, e // 32) / (30 * e**0.5)).half())
    static = [rand(1, e), rand(1, e), rand(1, K, e), rand(3, e), rand(1, K).softmax(-1)]
    hit = torch.tensor([[1, 0] * (K // 2)], dtype=torch.int32, device="cuda")
    inv = torch.tensor([[0, 1, 0, 2, 0, 0, 0, 1, 0, 2]], dtype=torch.int32, device="cuda")

    def run():
        h, d, rows, cpu_rows, wts = static
        return _chain(h, d, w_norm, w_router, w_q8, hit, inv, rows, cpu_rows, wts, K)

    monkeypatch.delenv("STRATA_PDL", raising=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile and warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(4):
        for t in static:
            t.copy_(torch.randn(t.shape, device="cuda", generator=g) if t is not static[4]
                    else torch.randn(t.shape, device="cuda", generator=g).softmax(-1))
        graph.replay()
        monkeypatch.setenv("STRATA_PDL", "0")
        want = run()
        monkeypatch.delenv("STRATA_PDL")
        torch.cuda.synchronize()
        for got, ref in zip(outs, want, strict=True):
            assert torch.equal(got, ref)
    if torch.cuda.get_device_capability()[0] >= 9:  # the GPU machine: PDL really ran, the CUDA C GEMV too
        from strata_ray.kernels import nvrtc

        assert pdl_on(static[0]) and nvrtc._driver() is not None and "pdl" not in nvrtc._FAILED
        if nvrtc.has_cupy():
            assert outs[0].abs().sum() > 0  # the GEMV launched (left zeros where it could not)


# each converted body and the parameters it may load before its wait: model weights only (kernels/pdl.py)
_WEIGHTS_BEFORE_WAIT = {
    ("fused_small", "_rms_norm_body"): {"W"},
    ("fused_small", "_combine_body"): set(),
    ("fused_small", "_shared_act_body"): {"WG"},
    ("gdn_step", "_conv_body"): set(),
    ("gdn_step", "_delta_body"): {"A", "DT_BIAS", "NORM_W"},
    ("gdn_step", "_gated_norm_body"): {"NORM_W"},
    ("router", "_logits_body"): {"W"},
    ("router", "_topk_body"): set(),
    ("publish", "_publish_body"): set(),
    ("flag_wait", "_wait_body"): set(),
    ("decode_plan", "_plan_body"): set(),
    ("expert_words", "_swiglu_quant_kernel"): set(),
    ("norm_rope", "_norm_rope_body"): set(),
    ("attention_decode", "_attn_partial_body"): set(),
    ("attention_decode", "_attn_combine_body"): set(),
    ("attention_decode", "_kv_append_body"): set(),
}


def _calls(node) -> list:
    """Every call node under node."""
    import ast

    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _root(expr) -> str:
    """The parameter a pointer expression starts from: `W + rows * K + cols` -> W."""
    import ast

    while not isinstance(expr, ast.Name):
        expr = expr.left if isinstance(expr, ast.BinOp) else expr.value
    return expr.id


@pytest.mark.parametrize("module,body", sorted(_WEIGHTS_BEFORE_WAIT), ids=lambda v: v)
def test_bodies_keep_the_rule(module, body):
    """Each converted body takes PDL, triggers its dependents and waits once in its top-level statements (not
    in a loop), and before the wait stores nothing and loads only its weights (the source as written: a new
    body or load that breaks the rule fails here, without a GPU)."""
    import ast
    import importlib
    import inspect
    import textwrap

    if module == "expert_words":  # imports triton at its top (a GPU module)
        pytest.importorskip("triton")
    fn = getattr(importlib.import_module(f"strata_ray.kernels.{module}"), body)
    fn = getattr(fn, "fn", fn)  # a triton.jit-decorated body (expert_words) -> its function
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert "PDL" in [a.arg for a in tree.args.args]
    name = ast.unparse
    waits = [(i, c) for i, stmt in enumerate(tree.body) for c in _calls(stmt)
             if name(c.func) == "tl.extra.cuda.gdc_wait"]
    assert len(waits) == 1 and isinstance(tree.body[waits[0][0]], ast.If), f"{body}: one wait, in `if PDL:`"
    wait = waits[0][1]
    triggers = [c for c in _calls(tree) if name(c.func) == "tl.extra.cuda.gdc_launch_dependents"]
    assert len(triggers) == 1 and triggers[0].lineno < wait.lineno, f"{body}: trigger once, before the wait"
    for c in _calls(tree):
        if c.lineno > wait.lineno:
            continue
        assert not name(c.func).startswith(("tl.store", "tl.atomic", "tl.inline_asm")), \
            f"{body}: {name(c.func)} before the wait"
        if name(c.func) == "tl.load":
            assert _root(c.args[0]) in _WEIGHTS_BEFORE_WAIT[(module, body)], \
                f"{body} loads {name(c.args[0])} before its wait: not one of its weights"


@pytest.mark.skipif(HAS_CUDA, reason="the GPU machine compiles and runs the PDL branches for real")
def test_pdl_branches_compile_for_sm90():
    """Every converted Triton kernel, launched through its wrapper with PDL forced on, compiles for an H100
    and holds griddepcontrol (tests/kernels/pdl_compile_probe.py, a process without the interpreter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "tests/kernels/pdl_compile_probe.py"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "19 launches, 0 failed" in out.stdout


@pytest.mark.parametrize("module,kernel", [("dense_q8_cuda", "q8_gemv"), ("expert_rows_cuda", "expert_rows")])
def test_cuda_c_kernels_wait_before_their_inputs(module, kernel):
    """The CUDA C kernels launched with pdl=True: the hooks pasted in, the trigger, then the wait before the
    first read of an activation or plan input (X; TILE_START) and before any store."""
    import importlib

    src = importlib.import_module(f"strata_ray.kernels.{module}")._SOURCE
    assert "void pdl_wait()" in src and "griddepcontrol.wait" in src
    body = src[src.index(f" {kernel}(") :]
    body = body[body.index("{") :]
    first_input = {"q8_gemv": "X + ", "expert_rows": "TILE_START["}[kernel]
    assert body.index("pdl_trigger();") < body.index("pdl_wait();") < body.index(first_input)
    head = body[: body.index("pdl_wait();")]
    assert "OUT[" not in head and "OUT +" not in head
