"""Gated DeltaNet: chunked == recurrent, absolute chunk alignment, conv state, and the HF torch fallbacks."""

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from strata_ray.model import ops
from strata_ray.model.gdn import delta_rule

H, DK, DV = 4, 16, 8


def _inputs(T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = ops.l2_norm(torch.randn(T, H, DK, generator=gen)) * DK**-0.5
    k = ops.l2_norm(torch.randn(T, H, DK, generator=gen))
    v = torch.randn(T, H, DV, generator=gen)
    g = -torch.rand(T, H, generator=gen) * 0.3  # slow decay keeps long-range terms significant
    beta = torch.rand(T, H, generator=gen)
    S0 = torch.randn(H, DK, DV, generator=gen) * 0.5
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("T", [1, 33, 64, 222])
def test_chunked_equals_recurrent(T):
    q, k, v, g, beta, S0 = _inputs(T)
    o_r, S_r = ops.gdn_recurrent(q, k, v, g, beta, S0)
    o_c, S_c = ops.gdn_chunked(q, k, v, g, beta, S0)
    assert o_c.shape == (T, H, DV) and S_c.shape == (H, DK, DV)
    torch.testing.assert_close(o_c, o_r, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S_c, S_r, atol=2e-5, rtol=1e-4)


def test_chunk_groups_do_not_change_the_bits(monkeypatch):
    """The CPU's group size (GDN_GROUP_CPU) is a speed knob: 16, 4 and 1 chunks a group give the same bits,
    at 33 (one partial chunk), 222 and 1100 tokens (groups of 16 padded with identity chunks)."""
    for T in (33, 222, 1100):
        args = _inputs(T, seed=T)
        got = []
        for group in (16, 4, 1):
            monkeypatch.setattr(ops, "GDN_GROUP_CPU", group)
            got.append(ops.gdn_chunked(*args))
        for o, S in got[1:]:
            assert torch.equal(o, got[0][0]) and torch.equal(S, got[0][1]), T


def test_matches_transformers_chunk_and_recurrent_fallbacks():
    T = 100
    q, k, v, g, beta, S0 = _inputs(T, seed=3)
    raw_q = q * 7.0  # HF normalises inside (use_qk_l2norm_in_kernel) and scales q by dk^-0.5 itself
    raw_k = k * 3.0
    args = (raw_q[None], raw_k[None], v[None])
    kw = dict(g=g[None], beta=beta[None], initial_state=S0[None], output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    o_hf, S_hf = hf.torch_chunk_gated_delta_rule(*args, **kw)
    o, S = ops.gdn_chunked(q, k, v, g, beta, S0)
    torch.testing.assert_close(o, o_hf[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_hf[0], atol=2e-5, rtol=1e-4)
    o_hr, _ = hf.torch_recurrent_gated_delta_rule(*args, **kw)
    torch.testing.assert_close(ops.gdn_recurrent(q, k, v, g, beta, S0)[0], o_hr[0], atol=2e-5, rtol=1e-4)


def test_delta_rule_split_at_64_grid_is_bit_identical():
    """Calls split on multiples of 64 (then single tokens) give exactly the bits of one call."""
    T = 222
    q, k, v, g, beta, S0 = _inputs(T, seed=5)
    o_full, S_full = delta_rule(q, k, v, g, beta, S0, pos0=0)
    outs, S = [], S0
    for start, end in [(0, 128), (128, 192), *((t, t + 1) for t in range(192, T))]:
        o, S = delta_rule(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], S, start)
        outs.append(o)
    assert torch.equal(torch.cat(outs), o_full)
    assert torch.equal(S, S_full)


def test_delta_rule_unaligned_start_matches_recurrent():
    q, k, v, g, beta, S0 = _inputs(150, seed=7)
    o_ref, S_ref = ops.gdn_recurrent(q, k, v, g, beta, S0)
    o, S = delta_rule(q, k, v, g, beta, S0, pos0=37)  # 27 recurrent, 64 chunked, 59 recurrent
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=2e-5, rtol=1e-4)


def test_causal_conv1d_state_carries_over():
    gen = torch.Generator().manual_seed(1)
    C, K, T = 6, 4, 20
    x, w = torch.randn(T, C, generator=gen), torch.randn(C, K, generator=gen)
    state0 = torch.zeros(K - 1, C)
    y_full, st_full = ops.causal_conv1d(x, w, state0)
    ref = hf.causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T  # zero-padded HF convolution
    torch.testing.assert_close(y_full, ref)
    y1, st = ops.causal_conv1d(x[:7], w, state0)
    ys = [y1]
    for t in range(7, T):
        y, st = ops.causal_conv1d(x[t : t + 1], w, st)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys), y_full)
    assert torch.equal(st, st_full) and torch.equal(st_full, x[-(K - 1):])


def test_causal_conv1d_of_no_tokens_keeps_the_state():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(0, 6, generator=gen), torch.randn(6, 4, generator=gen)
    state = torch.randn(3, 6, generator=gen)
    y, st = ops.causal_conv1d(x, w, state)
    assert y.shape == (0, 6) and torch.equal(st, state)


def test_gdn_is_differentiable():
    q, k, v, g, beta, S0 = _inputs(70, seed=2)
    v.requires_grad_(True)
    g.requires_grad_(True)
    o, S = delta_rule(q, k, v, g, beta, S0, pos0=0)
    (o.square().sum() + S.sum()).backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0
    assert g.grad is not None and torch.isfinite(g.grad).all()
