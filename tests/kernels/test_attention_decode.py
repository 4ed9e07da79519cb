"""Split-K attention of a few queries over the KV cache (strata_ray/kernels/attention_decode.py).

The kernels run on the GPU (python -m pytest -m gpu tests/kernels/test_attention_decode.py) and under the
Triton interpreter (opt-in):
    STRATA_TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_attention_decode.py
"""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.attention_decode import SPLIT, attention_decode
from strata_ray.model import ops
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()


def _qkv(T, S, H, Hkv, D, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    k, v = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    return q.to(device), k.to(device), v.to(device)


def _reference(q, k, v, off, scale):
    with torch.no_grad():  # plain torch on the CPU: never the kernel under test
        return ops.attention(q.cpu(), k.cpu(), v.cpu(), off, scale)


def _cases(device, H, Hkv, D, shapes):
    scale = D**-0.5
    for T, S in shapes:
        q, k, v = _qkv(T, S, H, Hkv, D, device, seed=T * 1000 + S)
        off = S - T
        got = attention_decode(q, k, v, off, scale)
        assert got.shape == (T, H, D) and torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu(), _reference(q, k, v, off, scale), rtol=1e-4, atol=2e-5)
        for t in {0, T - 1}:  # a token alone, over the keys it sees, gives its row of the batch
            alone = attention_decode(q[t : t + 1], k[: off + t + 1], v[: off + t + 1], off + t, scale)
            assert torch.equal(alone, got[t : t + 1]), (T, S, t)


def test_bad_shapes():
    q, k, v = _qkv(1, 4, 4, 3, 32, "cpu")
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention_decode(q, k, v, 3, 1.0)
    q, k, v = _qkv(2, 4, 4, 2, 32, "cpu")
    with pytest.raises(ValueError, match="S >= offset"):
        attention_decode(q, k, v, 3, 1.0)




@interpret
def test_interpreted_matches_reference():
    pytest.importorskip("triton")
    # up to 18 splits: the combine's second chunk of 16
    shapes = [(1, 1), (1, 33), (3, 222), (2, SPLIT + 1), (5, 2 * SPLIT + 40), (2, 17 * SPLIT + 9)]
    _cases("cpu", 4, 2, 32, shapes)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_matches_reference_80b_heads():
    """The 80b-a3b's heads (16 query heads over 2 kv heads of 256), 1 to 16 tokens, up to 8K keys."""
    _cases("cuda", 16, 2, 256, [(1, 1), (1, 33), (16, 222), (3, 1000), (1, 8192), (16, 8200)])
