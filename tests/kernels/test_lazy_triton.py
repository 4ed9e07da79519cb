"""kernels/lazy_triton: bodies jitted on first use, with Triton's FP-fusion default kept where unset."""

from __future__ import annotations

import pytest

from strata_ray.kernels.lazy_triton import jit_bodies

tl = None  # bound by jit_bodies


def _copy_body(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, tl.load(X + i))


@pytest.fixture
def no_triton_fusion_env(monkeypatch):
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    return monkeypatch


def test_the_bodies_get_triton_language_and_jit(no_triton_fusion_env):
    pytest.importorskip("triton")
    import triton
    import triton.language

    (kernel,) = jit_bodies(_copy_body)
    assert kernel.fn is _copy_body  # a JITFunction (an InterpretedFunction under TRITON_INTERPRET)
    assert _copy_body.__globals__["tl"] is triton.language


def test_fp_fusion_stays_on_by_default_unless_the_user_chose(no_triton_fusion_env):
    """Triton 3.10 turns FMA contraction off by default: the kernels that do not say keep 3.9's (on)."""
    pytest.importorskip("triton")
    import os

    jit_bodies(_copy_body)
    assert os.environ["TRITON_DEFAULT_FP_FUSION"] == "1"
    no_triton_fusion_env.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    jit_bodies(_copy_body)
    assert os.environ["TRITON_DEFAULT_FP_FUSION"] == "0"
