"""ops: the decode (one-token) forms have the same bits as the general forms they shortcut (on CUDA too,
where the GPU machine runs these tests); the numba forms of CPU decode windows agree with them to rounding."""

import pytest
import torch

from strata_ray.kernels.attention_decode_cpu import one_query_cpu_serves
from strata_ray.model import ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _randn(*shape, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _masked_attention(q, k, v, q_offset, scale):
    """The general path for any T: repeat_interleave'd kv heads and an explicit causal mask."""
    T, H, _ = q.shape
    S, Hkv, _ = k.shape
    kh = k.repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
    vh = v.repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), kh.transpose(1, 2)) * scale
    q_pos = torch.arange(q_offset, q_offset + T, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(S, device=q.device)[None, :] > q_pos, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(0, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("H", "Hkv", "D"), [(4, 2, 32), (16, 2, 256), (8, 8, 16)])
@pytest.mark.parametrize("S", [1, 7, 64, 129, 1500])
def test_decode_attention_is_bitwise_the_masked_form(H, Hkv, D, S, device, monkeypatch):
    """The torch forms of a decode step's attention have the masked form's bits; the numba core of a CPU
    decode window (kernels/attention_decode_cpu) agrees with it to rounding."""
    q = _randn(1, H, D, seed=1, device=device)
    k, v = _randn(S, Hkv, D, seed=2, device=device), _randn(S, Hkv, D, seed=3, device=device)
    expected = _masked_attention(q, k, v, S - 1, D**-0.5)
    if device == "cpu" and one_query_cpu_serves(q, k, v):
        torch.testing.assert_close(ops.attention(q, k, v, S - 1, D**-0.5), expected, rtol=1e-4, atol=1e-5)
        monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert torch.equal(ops.attention(q, k, v, S - 1, D**-0.5), expected)  # the decode step, any device
    if device == "cpu":  # on an H200, cuBLAS gave other bits for Hkv batches than for H (S = 7, 129, 1500)
        out = ops.attention_one_query(q, k, v, D**-0.5)
        assert out.shape == (1, H, D)
        assert torch.equal(out, expected)


def test_attention_with_a_mask_still_masks():
    q, k, v = _randn(3, 4, 8, seed=1), _randn(5, 2, 8, seed=2), _randn(5, 2, 8, seed=3)
    out = ops.attention(q, k, v, 2, 8**-0.5)  # queries at 2, 3, 4 over keys 0..4
    assert torch.equal(out, _masked_attention(q, k, v, 2, 8**-0.5))
    first = ops.attention(q[:1], k[:3], v[:3], 2, 8**-0.5)  # the first query alone sees keys 0..2
    torch.testing.assert_close(out[:1], first)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("T", "q_offset", "max_scores"), [(33, 0, 4 * 33 * 10), (222, 17, 4 * 239 * 7),
                                                         (40, 5, 1)])
def test_attention_in_query_blocks_matches_one_block(device, T, q_offset, max_scores):
    """Past max_scores the queries run in blocks over the keys each can see: the causal result is kept."""
    H, Hkv, D = 4, 2, 16
    q = _randn(T, H, D, seed=6, device=device)
    S = q_offset + T
    k, v = _randn(S, Hkv, D, seed=7, device=device), _randn(S, Hkv, D, seed=8, device=device)
    whole = ops.attention(q, k, v, q_offset, D**-0.5)
    blocked = ops.attention(q, k, v, q_offset, D**-0.5, max_scores=max_scores)
    assert blocked.shape == whole.shape == (T, H, D)
    torch.testing.assert_close(blocked, whole, atol=2e-6, rtol=1e-5)
    again = ops.attention(q, k, v, q_offset, D**-0.5, max_scores=max_scores)
    assert torch.equal(blocked, again)  # deterministic


@pytest.mark.parametrize("device", DEVICES)
def test_state_read_is_the_einsum(device):
    S, x = _randn(4, 32, 16, seed=4, device=device), _randn(4, 32, seed=5, device=device)
    got = ops.state_read(S, x.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(got, torch.einsum("hkv,hk->hv", S, x))


def _einsum_recurrent(q, k, v, g, beta, S):
    outs = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        u = (v[t] - torch.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
        S = S + k[t][:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outs), S


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 2, 5])
def test_gdn_recurrent_is_bitwise_the_einsum_loop(T, device):
    H, dk, dv = 4, 32, 16
    q, k, v = (_randn(T, H, d, seed=i, device=device) for i, d in enumerate((dk, dk, dv)))
    g, beta = -_randn(T, H, seed=9, device=device).abs(), _randn(T, H, seed=10, device=device).sigmoid()
    S0 = _randn(H, dk, dv, seed=11, device=device)
    o, S = ops.gdn_recurrent(q, k, v, g, beta, S0)
    o_ref, S_ref = _einsum_recurrent(q, k, v, g, beta, S0)
    assert o.shape == (T, H, dv)
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)


def test_rope_tables_are_shared_without_changing_bits():
    x, pos = _randn(3, 4, 32, seed=12), torch.tensor([5, 6, 700])
    n_rot, base = 16, 10000.0
    inv_freq = 1.0 / (base ** (torch.arange(0, n_rot, 2, dtype=torch.float32) / n_rot))
    emb = torch.cat((pos.float()[:, None] * inv_freq,) * 2, dim=-1)[:, None, :]
    x_rot = x[..., :n_rot]
    rotated = torch.cat((-x_rot[..., n_rot // 2 :], x_rot[..., : n_rot // 2]), dim=-1)
    expected = torch.cat((x_rot * emb.cos() + rotated * emb.sin(), x[..., n_rot:]), dim=-1)
    assert torch.equal(ops.rope_neox(x, pos, n_rot, base), expected)
    assert torch.equal(ops.apply_rope(x, *ops.rope_tables(pos, n_rot, base)), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 33])  # on CUDA: the fused launch (decode), then the torch ops (a prompt)
def test_add_rms_norm_is_the_add_then_the_norm(device, T):
    h, d = _randn(2, T, 256, seed=T, device=device)
    w = 1 + 0.1 * _randn(256, seed=1, device=device)
    s, x = ops.add_rms_norm(h, d, w, 1e-6)
    assert torch.equal(s, h + d) and torch.equal(x, ops.rms_norm(h + d, w, 1e-6))
    out = (torch.full_like(h, float("nan")), torch.full_like(h, float("nan")))
    got = ops.add_rms_norm(h, d, w, 1e-6, out=out)
    assert got[0] is out[0] and got[1] is out[1] and torch.equal(out[0], s) and torch.equal(out[1], x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 33])
def test_linear_into_out_has_the_linears_bits(device, T):
    """A Q8_0 matrix (on CUDA its GEMV writes `out` itself for T <= 16) and a float one (copied there)."""
    from strata_ray.kernels.dense_q8 import Q8Weight

    g = torch.Generator().manual_seed(T)
    w = Q8Weight(torch.randint(-127, 128, (96, 64), generator=g, dtype=torch.int8).to(device),
                 (torch.rand(96, 2, generator=g) / 64).half().to(device))
    x = _randn(T, 64, seed=T, device=device)
    for weight in (w, w.dequantize()):
        out = torch.full((T, 96), float("nan"), device=device)
        assert ops.linear(x, weight, out=out) is out and torch.equal(out, ops.linear(x, weight))
    with pytest.raises(ValueError, match="linear out must be contiguous float32"):
        ops.linear(x, w, out=torch.zeros(T, 95, device=device))
