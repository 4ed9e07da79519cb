"""Fixtures of the expert kernel tests (their shared layers: tests/kernels/layers.py)."""

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def refusing_nvrtc(monkeypatch):
    """refuse(module): that CUDA C module's `_kernel` builder raises as an NVRTC that rejects the source
    would (first line of the message, then more), with kernels/nvrtc's record of failed builds emptied;
    returns the list of the keys it was asked to build."""
    import strata_ray.kernels.nvrtc as nvrtc

    monkeypatch.setattr(nvrtc, "_FAILED", set())
    tries: list[tuple] = []

    def refuse(module):
        def builder(*key):
            tries.append(key)
            raise RuntimeError("nvrtc: error: invalid value for --gpu-architecture\nmore")

        monkeypatch.setattr(module, "_kernel", builder)
        return tries

    return refuse
