"""The CPU twins of fused_small (strata_ray/kernels/fused_small_cpu.py) against their torch references at
awkward sizes: the RMSNorm rows (batch invariance, the add's exact sum, the out buffers), the shared
expert's activation and the attention's q / k head norms and rotary embedding; the MoE combine (bit for bit);
which calls take them."""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.fused_small import shared_act_reference
from strata_ray.kernels.fused_small_cpu import (
    add_rms_norm_cpu,
    combine_cpu_serves,
    combine_rows_cpu,
    cpu_norm_serves,
    norm_rope_cpu,
    norm_rope_cpu_serves,
    rms_norm_cpu,
    shared_act_cpu,
    shared_act_cpu_serves,
)
from strata_ray.kernels.norm_rope import norm_rope_reference
from strata_ray.model import ops
from strata_ray.model.attention import attention_inputs
from strata_ray.model.moe import combine_rows, shared_expert
from tests.kernels.test_norm_rope import _inputs as _attention_inputs

EPS = 1e-6


def _inputs(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    return x, w


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", [(1, 256), (33, 7), (222, 2049), (1, 4, 32), (33, 3, 24), (5, 2, 3, 9)])
def test_rows_equal_the_reference_to_rounding(shape):
    x, w = _inputs(shape, seed=sum(shape))
    got = rms_norm_cpu(x, w, EPS)
    assert got.shape == x.shape and got.dtype == torch.float32
    _close(got, ops.rms_norm_reference(x, w, EPS))


def test_a_row_does_not_depend_on_the_others():
    x, w = _inputs((33, 300), seed=1)
    whole = rms_norm_cpu(x, w, EPS)
    for t in (0, 1, 32):
        assert torch.equal(rms_norm_cpu(x[t : t + 1], w, EPS), whole[t : t + 1])
    s, normed = add_rms_norm_cpu(x, x.flip(0), w, EPS)
    for t in (0, 17):
        s1, n1 = add_rms_norm_cpu(x[t : t + 1], x.flip(0)[t : t + 1], w, EPS)
        assert torch.equal(s1, s[t : t + 1]) and torch.equal(n1, normed[t : t + 1])


@pytest.mark.parametrize("T", [1, 33, 222])
def test_the_add_is_torchs_sum_and_the_norm_its_twins(T):
    h, w = _inputs((T, 130), seed=T)
    d = torch.randn(T, 130, generator=torch.Generator().manual_seed(T + 1))
    s, normed = add_rms_norm_cpu(h, d, w, EPS)
    assert torch.equal(s, h + d)
    assert torch.equal(normed, rms_norm_cpu(h + d, w, EPS))
    _close(normed, ops.rms_norm_reference(h + d, w, EPS))


def test_out_buffers_get_the_same_bits():
    x, w = _inputs((3, 64), seed=5)
    want = rms_norm_cpu(x, w, EPS)
    out = torch.full_like(x, float("nan"))
    assert rms_norm_cpu(x, w, EPS, out=out) is out and torch.equal(out, want)
    inplace = x.clone()
    assert torch.equal(rms_norm_cpu(inplace, w, EPS, out=inplace), want)  # out may be x itself
    d = torch.randn(3, 64)
    bufs = (torch.full_like(x, float("nan")), torch.full_like(x, float("nan")))
    got = add_rms_norm_cpu(x, d, w, EPS, out=bufs)
    assert got[0] is bufs[0] and got[1] is bufs[1]
    want_s, want_n = add_rms_norm_cpu(x, d, w, EPS)
    assert torch.equal(bufs[0], want_s) and torch.equal(bufs[1], want_n)


def test_strided_inputs_are_read_as_their_values():
    """The attention's q heads are a strided view of the projection ([T, H, 2D] -> [..., :D])."""
    qg, w = _inputs((2, 4, 48), seed=9)
    q = qg[..., :24]
    assert not q.is_contiguous()
    assert torch.equal(rms_norm_cpu(q, w[:24], EPS), rms_norm_cpu(q.contiguous(), w[:24], EPS))
    assert torch.equal(qg[..., :24], q)  # the input untouched


def test_which_calls_take_it(monkeypatch):
    x, w = torch.zeros(1, 8), torch.ones(8)
    assert cpu_norm_serves(x, w, 1) and cpu_norm_serves(torch.zeros(16, 8), w, 16)
    assert not cpu_norm_serves(torch.zeros(17, 8), w, 17)  # a prompt chunk: the reference
    assert not cpu_norm_serves(x.double(), w.double(), 1)
    assert not cpu_norm_serves(x, torch.ones(4), 1)  # weights of another length
    assert not cpu_norm_serves(x, torch.ones(1, 8), 1)
    assert not cpu_norm_serves(torch.zeros(1, 0), torch.ones(0), 1)
    assert not cpu_norm_serves(torch.zeros(1, 8, requires_grad=True), w, 1)  # training: autograd's ops
    assert not cpu_norm_serves(x, torch.ones(8, requires_grad=True), 1)
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert not cpu_norm_serves(x, w, 1)


def test_ops_take_it_for_decode_windows_only(monkeypatch):
    x, w = _inputs((16, 96), seed=3)
    d = torch.randn(16, 96)
    with torch.inference_mode():
        assert torch.equal(ops.rms_norm(x, w, EPS), rms_norm_cpu(x, w, EPS))
        assert torch.equal(ops.add_rms_norm(x, d, w, EPS)[1], add_rms_norm_cpu(x, d, w, EPS)[1])
        x17 = torch.cat((x, x[:1]))
        assert torch.equal(ops.rms_norm(x17, w, EPS), ops.rms_norm_reference(x17, w, EPS))
        monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
        assert torch.equal(ops.rms_norm(x, w, EPS), ops.rms_norm_reference(x, w, EPS))
    # with autograd the reference's ops, whose gradient flows
    xg = x.clone().requires_grad_()
    monkeypatch.delenv("STRATA_FUSED_DECODE")
    ops.rms_norm(xg, w, EPS).sum().backward()
    assert xg.grad is not None


@pytest.mark.parametrize("N", [1, 5, 33, 222])
def test_shared_act_equals_the_reference_to_rounding(N):
    g = torch.Generator().manual_seed(N)
    gu = torch.randn(N, 2 * 97, generator=g) * 4  # gate and up as row-strided views of one product
    x, w_gate = torch.randn(N, 130, generator=g), torch.randn(130, generator=g) * 0.1
    gate, up = gu[:, :97], gu[:, 97:]
    got = shared_act_cpu(gate, up, x, w_gate)
    assert got.shape == (N, 97) and got.is_contiguous()
    _close(got, shared_act_reference(gate, up, x, w_gate))
    assert torch.equal(got, shared_act_cpu(gate.contiguous(), up.contiguous(), x, w_gate.reshape(1, -1)))
    assert torch.equal(got[-1:], shared_act_cpu(gate[-1:], up[-1:], x[-1:], w_gate))  # batch invariant


def test_shared_act_refuses_shapes_that_do_not_match():
    with pytest.raises(ValueError, match="shared_act_cpu"):
        shared_act_cpu(torch.zeros(1, 8), torch.zeros(1, 9), torch.zeros(1, 4), torch.zeros(4))
    with pytest.raises(ValueError, match="shared_act_cpu"):
        shared_act_cpu(torch.zeros(1, 8), torch.zeros(1, 8), torch.zeros(1, 4), torch.zeros(5))


def test_the_shared_expert_takes_it_for_decode_windows(monkeypatch):
    g = torch.Generator().manual_seed(2)
    E, F = 48, 40
    w = {"blk.0.ffn_gate_inp_shexp.weight": torch.randn(E, generator=g) * 0.1,
         "blk.0.ffn_gate_shexp.weight": torch.randn(F, E, generator=g) * 0.2,
         "blk.0.ffn_up_shexp.weight": torch.randn(F, E, generator=g) * 0.2,
         "blk.0.ffn_down_shexp.weight": torch.randn(E, F, generator=g) * 0.2}
    x = torch.randn(17, E, generator=g)
    assert shared_act_cpu_serves(x, w["blk.0.ffn_gate_inp_shexp.weight"], 16)
    assert not shared_act_cpu_serves(x, w["blk.0.ffn_gate_inp_shexp.weight"], 17)
    assert not shared_act_cpu_serves(x.double(), w["blk.0.ffn_gate_inp_shexp.weight"].double(), 1)
    with torch.inference_mode():
        w_gate, w_up, w_down = (w[f"blk.0.ffn_{n}_shexp.weight"] for n in ("gate", "up", "down"))
        w_gi = w["blk.0.ffn_gate_inp_shexp.weight"]

        def reference(rows):  # the torch form, which scales the output (not h) by the gate
            gate = torch.sigmoid(ops.linear(rows, w_gi.reshape(1, -1)))
            return ops.swiglu(rows, w_gate, w_up, w_down) * gate

        act = shared_act_cpu(ops.linear(x[:16], w_gate), ops.linear(x[:16], w_up), x[:16], w_gi)
        assert torch.equal(shared_expert(w, 0, x[:16]), ops.linear(act, w_down))
        _close(shared_expert(w, 0, x[:16]), reference(x[:16]))
        assert torch.equal(shared_expert(w, 0, x), reference(x))  # a prompt chunk
        monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
        assert torch.equal(shared_expert(w, 0, x[:16]), reference(x[:16]))


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(("H", "Hkv", "D", "n_rot"), [(4, 2, 32, 16), (3, 1, 24, 8), (2, 2, 128, 128)])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_norm_rope_equals_the_reference_to_rounding(T, H, Hkv, D, n_rot, gated):
    """qg and k as views of one [T, q | k | v] projection (strided tokens); heads of 24 values too (the
    Triton form takes powers of two only)."""
    qg, k, wq, wk = _attention_inputs(T, H, Hkv, D, gated, "cpu", seed=T + D)
    cos, sin = ops.rope_tables(torch.arange(1000, 1000 + T), n_rot, 1e7)
    q, kk, gate = norm_rope_cpu(qg, k, wq, wk, EPS, cos, sin)
    rq, rk, rgate = norm_rope_reference(qg, k, wq, wk, EPS, cos, sin)
    assert q.shape == (T, H, D) and kk.shape == (T, Hkv, D)
    _close(q, rq)
    _close(kk, rk)
    assert (gate is None) == (not gated) and (gate is None or torch.equal(gate, rgate))
    # each head's norm is rms_norm_cpu's, bit for bit; the rotation the reference's ops on those values
    normed = rms_norm_cpu(k, wk, EPS)
    assert torch.equal(kk, ops.apply_rope(normed, cos, sin))
    last = norm_rope_cpu(qg[-1:], k[-1:], wq, wk, EPS, cos[-1:], sin[-1:])  # batch invariant
    assert torch.equal(last[0], q[-1:]) and torch.equal(last[1], kk[-1:])


def test_norm_rope_refuses_what_it_cannot_rotate():
    qg, k, wq, wk = _attention_inputs(1, 2, 1, 24, False, "cpu")
    for n_rot in (7, 26):  # an odd rotary count; more than the head holds
        tables = torch.ones(1, 1, n_rot), torch.zeros(1, 1, n_rot)
        with pytest.raises(ValueError, match="even n_rot <= D"):
            norm_rope_cpu(qg, k, wq, wk, EPS, *tables)


def _attention_layer(g: torch.Generator):
    """A qwen3moe attention layer's hparams and weights: 4 heads of 32 over 2 kv heads, width 40."""
    from strata_ray.model.hparams import HParams

    hp = HParams(arch="qwen3moe", n_vocab=8, n_embd=40, n_layer=1, n_nextn=0, n_head=4, n_head_kv=2,
                 head_dim=32, n_expert=2, n_expert_used=1, n_ff_exp=8, n_ff_shexp=0, rms_eps=EPS,
                 rope_freq_base=1e6, n_rot=32, context_length=64)
    w = {f"blk.0.attn_{n}.weight": torch.randn(heads * 32, 40, generator=g)
         for n, heads in (("q", 4), ("k", 2), ("v", 2))}
    w |= {f"blk.0.attn_{n}_norm.weight": 1 + 0.1 * torch.randn(32, generator=g) for n in ("q", "k")}
    return hp, w


def test_attention_inputs_take_it_for_decode_windows(monkeypatch):
    g = torch.Generator().manual_seed(4)
    hp, w = _attention_layer(g)
    norms = w["blk.0.attn_q_norm.weight"], w["blk.0.attn_k_norm.weight"]
    x = torch.randn(17, 40, generator=g)
    assert norm_rope_cpu_serves(x, 16) and not norm_rope_cpu_serves(x, 17)
    with torch.inference_mode():
        pos = torch.arange(3, 19)
        q, k, v, gate = attention_inputs(hp, w, 0, x[:16], pos)
        cos, sin = ops.rope_tables(pos, 32, 1e6)
        proj = [ops.linear(x[:16], w[f"blk.0.attn_{n}.weight"]) for n in "qk"]
        want = norm_rope_cpu(proj[0].view(16, 4, 32), proj[1].view(16, 2, 32), *norms, EPS, cos, sin)
        assert torch.equal(q, want[0]) and torch.equal(k, want[1]) and gate is None
        monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
        ref = norm_rope_reference(proj[0].view(16, 4, 32), proj[1].view(16, 2, 32), *norms, EPS, cos, sin)
        q0, k0, _, _ = attention_inputs(hp, w, 0, x[:16], pos)
        assert torch.equal(q0, ref[0]) and torch.equal(k0, ref[1])


def test_tracked_weights_keep_the_torch_forms_whose_gradients_flow():
    """An untracked input with tracked projection or norm weights (fine-tuning them): the torch forms."""
    g = torch.Generator().manual_seed(6)
    for tracked in ("blk.0.attn_q.weight", "blk.0.attn_k_norm.weight"):
        hp, w = _attention_layer(g)
        w[tracked].requires_grad_()
        q, k, _, _ = attention_inputs(hp, w, 0, torch.randn(1, 40, generator=g), torch.arange(1))
        (q.sum() + k.sum()).backward()
        assert w[tracked].grad is not None and w[tracked].grad.abs().sum() > 0, tracked


def _torch_combine(rows, weights):  # moe.combine_rows' torch form: one multiply and one add per k, in k order
    out = rows[:, 0] * weights[:, :1]
    for k in range(1, rows.shape[1]):
        out = out + rows[:, k] * weights[:, k : k + 1]
    return out


@pytest.mark.parametrize("N,K,E", [(1, 1, 33), (1, 8, 1024), (2, 10, 222), (16, 3, 7), (33, 8, 64)])
def test_combine_gives_the_torch_forms_bits(N, K, E):
    g = torch.Generator().manual_seed(N * 1000 + K)
    rows = torch.randn(N, K, E, generator=g) * 4
    weights = torch.rand(N, K, generator=g)
    want = _torch_combine(rows, weights)
    assert torch.equal(combine_rows_cpu(rows, weights), want)
    assert torch.equal(combine_rows(rows, weights), want)  # N > 16: the numpy form, the same bits again
    assert torch.equal(combine_rows_cpu(rows[:1], weights[:1]), want[:1])  # a token alone: batch invariant


def test_which_combines_take_it(monkeypatch):
    rows, weights = torch.ones(2, 3, 8), torch.ones(2, 3)
    assert combine_cpu_serves(rows, weights)
    assert not combine_cpu_serves(torch.ones(17, 3, 8), torch.ones(17, 3))  # a prompt chunk: numpy's form
    assert not combine_cpu_serves(rows.transpose(0, 1), weights.T)  # strided
    assert not combine_cpu_serves(rows.double(), weights.double())
    assert not combine_cpu_serves(rows, weights.clone().requires_grad_(True))
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert not combine_cpu_serves(rows, weights)
