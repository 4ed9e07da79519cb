"""Fixtures of the expert kernel tests (their shared layers: tests/kernels/layers.py)."""

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
