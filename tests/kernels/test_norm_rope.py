"""q / k head norms and rotary embedding in one launch (strata_ray/kernels/norm_rope.py) against the torch
composition, at awkward token counts, for qwen3next's gated query rows and partial rotary, and qwen3moe's
plain rows. Under the Triton interpreter on CPU runs, compiled with -m gpu."""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.norm_rope import norm_rope_fused, norm_rope_reference, norm_rope_supported
from strata_ray.model import ops
from tests.kernels.triton_interpret import interpret

HAS_CUDA = torch.cuda.is_available()


def _inputs(T, H, Hkv, D, gated, device, seed=0):
    """qg, k as views of one [T, q | k | v] projection row (strided tokens), norm weights, rope tables."""
    g = torch.Generator().manual_seed(seed)
    qd = (2 if gated else 1) * H * D
    proj = torch.randn(T, qd + 2 * Hkv * D, generator=g).to(device)  # [T, q(+gate) | k | v]
    qg = proj[:, :qd].view(T, H, -1)
    k = proj[:, qd : qd + Hkv * D].view(T, Hkv, D)
    wq, wk = (1 + 0.1 * torch.randn(2, D, generator=g)).to(device)  # head norm weights [D] each
    return qg, k, wq, wk


def _cases(device, H, Hkv, D, n_rot, token_counts):
    for gated in (True, False):
        for T in token_counts:
            qg, k, wq, wk = _inputs(T, H, Hkv, D, gated, device, seed=T)
            pos = torch.arange(1000, 1000 + T, device=device)
            cos, sin = ops.rope_tables(pos, n_rot, 1e7)
            q, kk, gate = norm_rope_fused(qg, k, wq, wk, 1e-6, cos, sin)
            host = (x.cpu() for x in (qg, k, wq, wk))
            rq, rk, rgate = norm_rope_reference(*host, 1e-6, cos.cpu(), sin.cpu())
            torch.testing.assert_close(q.cpu(), rq, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(kk.cpu(), rk, rtol=1e-5, atol=1e-5)
            assert (gate is None) == (not gated) and (gate is None or torch.equal(gate.cpu(), rgate))
            # the rotation's bits: the kernel's own normed values (n_rot = 0 rotates nothing) rotated by the
            # torch ops give the kernel's rotated values exactly
            plain = norm_rope_fused(qg, k, wq, wk, 1e-6, torch.ones_like(cos), torch.zeros_like(sin))[0]
            assert torch.equal(q, ops.apply_rope(plain, cos, sin))
            t = T - 1  # a token alone gives its row of the batch, bit for bit
            alone = norm_rope_fused(qg[t:], k[t:], wq, wk, 1e-6, cos[t:], sin[t:])
            assert torch.equal(alone[0], q[t:]) and torch.equal(alone[1], kk[t:])


def test_supported_shapes_and_refusals():
    assert norm_rope_supported(256, 64) and norm_rope_supported(128, 128)
    assert not norm_rope_supported(96, 64) and not norm_rope_supported(256, 63)
    assert not norm_rope_supported(8, 8)
    qg, k, wq, wk = _inputs(2, 4, 2, 32, True, "cpu")
    cos, sin = ops.rope_tables(torch.arange(2), 16, 1e4)
    with pytest.raises(ValueError, match="norm_rope"):
        norm_rope_fused(qg, k, wq[:16], wk, 1e-6, cos, sin)
    with pytest.raises(ValueError, match="contiguous"):
        norm_rope_fused(qg, k.transpose(1, 2).contiguous().transpose(1, 2), wq, wk, 1e-6, cos, sin)


@interpret
def test_interpreted_matches_the_torch_ops():
    pytest.importorskip("triton")
    _cases("cpu", 4, 2, 32, 16, (1, 3, 16))  # partial rotary, as qwen3next
    _cases("cpu", 4, 2, 32, 32, (1, 5))  # every value rotated, as qwen3moe


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_matches_the_torch_ops_80b_heads():
    _cases("cuda", 16, 2, 256, 64, (1, 3, 16))
    _cases("cuda", 32, 4, 128, 128, (1, 7))
