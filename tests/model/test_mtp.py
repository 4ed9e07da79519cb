"""MTP (nextn) head: shapes, determinism, incremental == one call, a slow independent re-implementation."""

import dataclasses
import math

import pytest
import torch

from strata_ray.model.forward import Model
from tests.model import hf_reference as ref


@pytest.fixture(scope="module")
def model():
    hf_model = ref.tiny_qwen3next(seed=1)
    hp = dataclasses.replace(ref.hparams_of(hf_model), n_nextn=1)
    weights = ref.gguf_weights(hf_model)
    weights.update(ref.mtp_weights(hp))
    return Model(hp, weights)


def _slow_mtp(model: Model, hidden: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
    """Token by token, every quantity recomputed from scratch: complex-number rotary, per-head loops, dense
    expert mixture through a sparse gate vector."""
    hp, w = model.hp, model.weights
    p, eps = f"blk.{hp.n_layer}", hp.rms_eps
    H, Hkv, D, R = hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_rot

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean() + eps)

    def rotate(vec, pos):  # NEOX: dims (i, i + R/2) form the complex number for frequency i
        half = R // 2
        z = torch.complex(vec[:half], vec[half:R])
        freq = hp.rope_freq_base ** (-torch.arange(half, dtype=torch.float64) * 2 / R)
        z = z * torch.polar(torch.ones(half, dtype=torch.float64), pos * freq).to(torch.complex64)
        return torch.cat([z.real, z.imag, vec[R:]])

    def silu(x):
        return x / (1 + torch.exp(-x))

    def layer_input(t):
        e = rms(w["token_embd.weight"][next_ids[t]], w[f"{p}.nextn.enorm.weight"])
        h = rms(hidden[t], w[f"{p}.nextn.hnorm.weight"])
        return w[f"{p}.nextn.eh_proj.weight"] @ torch.cat([e, h])

    keys, values, out = [], [], []
    for t in range(len(next_ids)):
        u = layer_input(t)
        x = rms(u, w[f"{p}.attn_norm.weight"])
        qg = (w[f"{p}.attn_q.weight"] @ x).view(H, 2 * D)
        kt = (w[f"{p}.attn_k.weight"] @ x).view(Hkv, D)
        keys.append(torch.stack([rotate(rms(kt[j], w[f"{p}.attn_k_norm.weight"]), t) for j in range(Hkv)]))
        values.append((w[f"{p}.attn_v.weight"] @ x).view(Hkv, D))
        heads = []
        for h in range(H):
            q = rotate(rms(qg[h, :D], w[f"{p}.attn_q_norm.weight"]), t)
            j = h // (H // Hkv)
            scores = torch.stack([q @ keys[s][j] for s in range(t + 1)]) / math.sqrt(D)
            att = torch.exp(scores - scores.max())
            att = att / att.sum()
            o = sum(att[s] * values[s][j] for s in range(t + 1))
            heads.append(o / (1 + torch.exp(-qg[h, D:])))
        u = u + w[f"{p}.attn_output.weight"] @ torch.cat(heads)

        x = rms(u, w[f"{p}.post_attention_norm.weight"])
        probs = torch.softmax(w[f"{p}.ffn_gate_inp.weight"] @ x, -1)
        chosen = probs.argsort(descending=True)[: hp.n_expert_used]
        gate_vec = torch.zeros(hp.n_expert)
        gate_vec[chosen] = probs[chosen] / probs[chosen].sum()
        moe = sum(gate_vec[e] * (w[f"{p}.ffn_down_exps.weight"][e] @ (
            silu(w[f"{p}.ffn_gate_exps.weight"][e] @ x) * (w[f"{p}.ffn_up_exps.weight"][e] @ x)))
            for e in range(hp.n_expert))
        shared = w[f"{p}.ffn_down_shexp.weight"] @ (
            silu(w[f"{p}.ffn_gate_shexp.weight"] @ x) * (w[f"{p}.ffn_up_shexp.weight"] @ x))
        shared = shared / (1 + torch.exp(-(w[f"{p}.ffn_gate_inp_shexp.weight"] @ x)))
        u = u + moe + shared
        out.append(w["output.weight"] @ rms(u, w[f"{p}.nextn.shared_head_norm.weight"]))
    return torch.stack(out)


def _trunk(model, n=24, seed=0):
    ids = torch.randint(0, ref.VOCAB, (n + 1,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.inference_mode():
        _, hidden = model.forward(ids[:-1], model.new_state(), return_hidden=True)
    return ids, hidden


def test_mtp_matches_slow_reimplementation(model):
    ids, hidden = _trunk(model, n=16)
    with torch.inference_mode():
        got = model.mtp_logits(hidden, ids[1:], model.new_state())
        expected = _slow_mtp(model, hidden, ids[1:])
    assert got.shape == (16, ref.VOCAB)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_mtp_deterministic_and_incremental(model):
    ids, hidden = _trunk(model, seed=1)
    with torch.inference_mode():
        a = model.mtp_logits(hidden, ids[1:], model.new_state())
        b = model.mtp_logits(hidden, ids[1:], model.new_state())
        state = model.new_state()
        parts = [model.mtp_logits(hidden[:10], ids[1:11], state)]
        parts += [model.mtp_logits(hidden[t : t + 1], ids[t + 1 : t + 2], state) for t in range(10, 24)]
    assert torch.equal(a, b)
    assert state.mtp_pos == 24 and state.pos == 0  # the MTP cache is its own
    torch.testing.assert_close(torch.cat(parts), a, atol=2e-5, rtol=1e-5)


def test_mtp_rejects_mismatched_lengths(model):
    _, hidden = _trunk(model)
    with pytest.raises(ValueError, match="hidden states"):
        model.mtp_logits(hidden, [1, 2], model.new_state())
