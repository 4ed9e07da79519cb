"""kernels/nvrtc.py: the build-or-fallback record and the stream handle protocol (CPU); the CUDA C kernels'
own tests build and launch through it on the GPU (test_dense_q8_cuda.py, test_expert_rows_cuda.py)."""

from __future__ import annotations

import pytest

import strata_ray.kernels.nvrtc as nvrtc


def test_build_or_none_warns_once_a_key_and_keeps_other_keys_apart(monkeypatch, caplog):
    monkeypatch.setattr(nvrtc, "_FAILED", set())
    calls = []

    def fails():
        calls.append("a")
        raise OSError("libnvrtc.so.12: cannot open shared object file")

    with caplog.at_level("WARNING", logger=nvrtc.__name__):
        assert nvrtc.build_or_none(("k", 1), fails, "thing", "its twin runs") is None
        assert nvrtc.build_or_none(("k", 1), fails, "thing", "its twin runs") is None
        assert nvrtc.build_or_none(("k", 2), lambda: "built", "thing", "its twin runs") == "built"
    assert calls == ["a"]
    assert [r.getMessage() for r in caplog.records] == [
        "the CUDA C thing could not be built (OSError: libnvrtc.so.12: cannot open shared object file); its "
        "twin runs"]


def test_a_builder_that_works_is_not_recorded(monkeypatch):
    monkeypatch.setattr(nvrtc, "_FAILED", set())
    assert nvrtc.build_or_none("key", lambda: 7, "thing", "-") == 7
    assert nvrtc._FAILED == set()


def test_stream_ref_speaks_the_cuda_stream_protocol():
    assert nvrtc._StreamRef(0x1234).__cuda_stream__() == (0, 0x1234)


def test_has_cupy_matches_the_import():
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert not nvrtc.has_cupy()
    else:
        assert nvrtc.has_cupy()


def test_launch_needs_cuda():
    if nvrtc.has_cupy():
        pytest.skip("cupy installed: the kernels' GPU tests launch through it")
    with pytest.raises(ImportError):
        nvrtc.launch(None, (1,), 32, (), 0)
