import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from strata_ray.model.quants import dequantize
from strata_ray.model.synth_blocks import RandomBlocks


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K])
def test_blocks_decode_to_target_std(t):
    b = RandomBlocks(0).blocks(np.random.default_rng(1), 64, 1024, t, 0.03).copy()
    y = dequantize(b, t, (64, 1024))
    assert np.array_equal(y, gguf.quants.dequantize(b, t).reshape(y.shape))  # valid blocks
    assert np.isfinite(y).all()
    assert abs(y.std() / 0.03 - 1) < 0.05
    assert abs(y.mean()) < 0.1 * 0.03
    # scales vary per block (kernels must read every block's own scale)
    assert len(np.unique(y.reshape(-1, 32).std(-1).round(4))) > 50


def test_q8_0_never_holds_minus_128():
    b = RandomBlocks(0).blocks(np.random.default_rng(0), 256, 256, T.Q8_0, 1.0)
    qs = b.reshape(-1, 34)[:, 2:].view(np.int8)
    assert qs.min() == -127 and qs.max() == 127


def test_deterministic_and_distinct():
    def make(seed, rng_seed):
        return RandomBlocks(seed).blocks(np.random.default_rng(rng_seed), 8, 256, T.Q4_K, 0.1).copy()

    assert np.array_equal(make(0, 1), make(0, 1))
    assert not np.array_equal(make(0, 1), make(0, 2))
    assert not np.array_equal(make(0, 1), make(1, 1))
    rb, rng = RandomBlocks(0), np.random.default_rng(3)
    first = rb.blocks(rng, 8, 256, T.Q4_K, 0.1).copy()
    assert not np.array_equal(first, rb.blocks(rng, 8, 256, T.Q4_K, 0.1))  # successive chunks differ
