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


def test_kernel_params_counts_each_kernels_signature():
    """The parameters of each CUDA C kernel as its launch passes them (launch_mma_rows: 9 pointers, 4
    strides, out, R, M; launch_cuda_rows the same and one_row; the dense GEMV: 6 pointers and 3 counts), and
    the signatures the parser declines."""
    from strata_ray.kernels import dense_q8_cuda, expert_mma_cuda, expert_rows_cuda

    assert nvrtc.kernel_params(expert_rows_cuda._SOURCE, "expert_rows") == 17
    assert nvrtc.kernel_params(expert_mma_cuda._SOURCE, "expert_mma") == 16
    assert nvrtc.kernel_params(dense_q8_cuda._SOURCE, "q8_gemv") == 9
    one = 'extern "C" __global__ void __launch_bounds__(4 * 32) k(const int* __restrict__ a, float f(int)) {}'
    assert nvrtc.kernel_params(one, "k") == 2  # a parenthesis inside the list is no comma
    assert nvrtc.kernel_params('extern "C" __global__ void k(void) {}', "k") == 0
    assert nvrtc.kernel_params('extern "C" __global__ void k( ) {}', "k") == 0
    directive = 'extern "C" __global__ void k(int a,\n#if X\n int b\n#endif\n) {}'
    assert nvrtc.kernel_params(directive, "k") is None
    assert nvrtc.kernel_params('extern "C" __global__ void kk(int a) {}', "k") is None  # not its name


def test_a_launch_with_the_wrong_argument_count_is_one_line(monkeypatch):
    """A kernel built here whose launch passes another count of arguments: a KernelError naming both counts,
    before anything reaches the driver (cupy would read past the arguments: a segfault, session 46)."""
    kernel = object()  # what build returned (a cupy Function on a GPU machine); only its identity counts
    monkeypatch.setitem(nvrtc._ARITY, id(kernel), (kernel, "expert_rows", 16))
    with pytest.raises(nvrtc.KernelError, match="expert_rows takes 16 arguments, the launch passes 15"):
        nvrtc.launch(kernel, (1,), 32, (0,) * 15, 0)


_FILL = nvrtc.PDL_HOOKS + r"""
extern "C" __global__ void fill(float* out, int n, float v) {
    pdl_wait();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = v;
}
"""


@pytest.mark.gpu
def test_a_launch_at_fault_raises_and_leaves_pdl_on(monkeypatch):
    """A launch the driver refuses for its own shape (2048 threads a block) raises through cupy's launch
    as well, so PDL stays on for the kernels after it; the next good launch runs."""
    import numpy as np
    import torch

    from strata_ray.kernels.pdl import pdl_on_device

    if not (torch.cuda.is_available() and nvrtc.has_cupy()):
        pytest.skip("needs a CUDA GPU and cupy")
    monkeypatch.delenv("STRATA_PDL", raising=False)
    monkeypatch.setattr(nvrtc, "_FAILED", set())
    if not (pdl_on_device(0) and nvrtc._driver() is not None):
        pytest.skip("needs PDL: sm_90 and cuda.bindings")
    kernel = nvrtc.build(_FILL, "fill", (), 0)
    out = torch.zeros(64, device="cuda")
    args = (nvrtc.ptr(out), np.int32(64), np.float32(3.0))
    with pytest.raises(Exception):  # noqa: B017 (cuLaunchKernelEx's and cupy's: CUDA_ERROR_INVALID_VALUE)
        nvrtc.launch(kernel, (1,), 2048, args, 0, pdl=True)
    assert "pdl" not in nvrtc._FAILED
    nvrtc.launch(kernel, (1,), 64, args, 0, pdl=True)
    torch.cuda.synchronize()
    assert bool((out == 3.0).all())


@pytest.mark.gpu
def test_a_pdl_failure_where_cupy_launches_turns_pdl_off(monkeypatch, caplog):
    """cuLaunchKernelEx failing where cupy's launch of the same kernel runs: PDL's fault (a driver or
    cuda.bindings without it), so the kernels launch without it from then on, said once."""
    import numpy as np
    import torch

    if not (torch.cuda.is_available() and nvrtc.has_cupy()):
        pytest.skip("needs a CUDA GPU and cupy")
    monkeypatch.delenv("STRATA_PDL", raising=False)
    monkeypatch.setattr(nvrtc, "_FAILED", set())
    monkeypatch.setattr(nvrtc, "pdl_on_device", lambda device: True)
    monkeypatch.setattr(nvrtc, "_launch_pdl", lambda *a: RuntimeError("cuLaunchKernelEx: not supported"))
    kernel = nvrtc.build(_FILL, "fill", (), 0)
    out = torch.zeros(64, device="cuda")
    with caplog.at_level("WARNING", logger=nvrtc.__name__):
        nvrtc.launch(kernel, (1,), 64, (nvrtc.ptr(out), np.int32(64), np.float32(2.0)), 0, pdl=True)
    torch.cuda.synchronize()
    assert bool((out == 2.0).all()) and "pdl" in nvrtc._FAILED
    assert "launch without PDL" in caplog.text
