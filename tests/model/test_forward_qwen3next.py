"""The reference forward of qwen3next against transformers' Qwen3NextForCausalLM on a tiny random model."""

import pytest
import torch

from strata_ray.model.forward import Model
from strata_ray.model.hparams import ModelFormatError
from tests.model import hf_reference as ref


@pytest.fixture(scope="module")
def tiny():
    hf_model = ref.tiny_qwen3next(seed=0)
    hp = ref.hparams_of(hf_model)
    assert hp.recurrent == (True, True, True, False)  # full attention at layer 3
    return hf_model, Model(hp, ref.gguf_weights(hf_model))


_prompt = ref.random_prompt


def test_logits_match_transformers_at_every_position(tiny):
    hf_model, model = tiny
    ids = _prompt(64)
    expected = ref.hf_logits(hf_model, ids)
    with torch.inference_mode():
        got = model.forward(ids, model.new_state())
    assert got.shape == (64, ref.VOCAB)
    assert (got - expected).abs().max() < 1e-4


def test_greedy_tokens_match_transformers(tiny):
    hf_model, model = tiny
    ids = _prompt(64, seed=2)
    expected = ref.hf_greedy(hf_model, ids, 32)
    got = ref.model_greedy(model, ids, 32)
    assert got == expected
    assert len(set(got)) > 3  # a degenerate model repeating one token would prove little


def test_prompt_in_chunks_then_decode_equals_one_pass(tiny):
    _, model = tiny
    ids = _prompt(150, seed=3)
    with torch.inference_mode():
        full = model.forward(ids, model.new_state())
        state = model.new_state()
        parts = [model.forward(ids[:64], state), model.forward(ids[64:128], state)]
        parts += [model.forward([t], state) for t in ids[128:]]
    assert state.pos == 150
    torch.testing.assert_close(torch.cat(parts), full, atol=2e-5, rtol=1e-5)


def test_forward_of_no_tokens_changes_nothing(tiny):
    _, model = tiny
    ids = _prompt(5, seed=6)
    with torch.inference_mode():
        state = model.new_state()
        model.forward(ids[:3], state)
        empty = model.forward([], state)
        rest = model.forward(ids[3:], state)
        full = model.forward(ids, model.new_state())
    assert empty.shape == (0, ref.VOCAB) and state.pos == 5
    torch.testing.assert_close(rest, full[3:], atol=2e-5, rtol=1e-5)


def test_state_clone_rolls_back(tiny):
    _, model = tiny
    ids = _prompt(70, seed=4)
    with torch.inference_mode():
        state = model.new_state()
        model.forward(ids, state)
        snapshot = state.clone()
        first = model.forward([5, 6], state)
        model.forward([7], state)
        again = model.forward([5, 6], snapshot)
    assert torch.equal(first, again)
    assert snapshot.pos == 72 and state.pos == 73


def test_return_hidden_is_post_norm_input_of_lm_head(tiny):
    _, model = tiny
    with torch.inference_mode():
        logits, hidden = model.forward(_prompt(10), model.new_state(), return_hidden=True)
    assert hidden.shape == (10, ref.HIDDEN)
    torch.testing.assert_close(hidden @ model.weights["output.weight"].T, logits)


def test_forward_is_differentiable(tiny):
    hf_model, _ = tiny
    weights = {k: v.clone().requires_grad_(True) for k, v in ref.gguf_weights(hf_model).items()}
    model = Model(ref.hparams_of(hf_model), weights)
    ids = torch.tensor(_prompt(80, seed=5))
    logits = model.forward(ids[:-1], model.new_state())
    torch.nn.functional.cross_entropy(logits, ids[1:]).backward()
    for name in ("blk.0.ssm_a", "blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.2.ffn_gate_exps.weight",
                 "blk.1.ffn_gate_inp.weight", "blk.1.ffn_gate_inp_shexp.weight", "token_embd.weight"):
        grad = weights[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_mtp_refused_without_nextn_layer(tiny):
    _, model = tiny
    with pytest.raises(ModelFormatError, match="no MTP"):
        model.mtp_logits(torch.zeros(1, ref.HIDDEN), [1], model.new_state())


def test_last_only_gives_the_last_rows_and_the_same_state(tiny):
    _, model = tiny
    ids = _prompt(70, seed=11)
    with torch.inference_mode():
        s_all, s_last = model.new_state(), model.new_state()
        full, hidden = model.forward(ids, s_all, return_hidden=True)
        last, last_hidden = model.forward(ids, s_last, return_hidden=True, last_only=True)
        assert last.shape == (1, ref.VOCAB) and last_hidden.shape == (1, hidden.shape[1])
        torch.testing.assert_close(last, full[-1:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last_hidden, hidden[-1:], atol=1e-6, rtol=1e-6)
        # the caches and recurrent states are those of the full forward: the next token agrees bit for bit
        assert torch.equal(model.forward([5], s_last), model.forward([5], s_all))


def _one_weight_grads(hf_model, device: str) -> dict[str, torch.Tensor | None]:
    """Each weight's gradient from a 3-token window (a verify window's size, where the fused forms run) in
    which it alone is tracked by autograd: the input of the layers before it is not, so a fused form there
    must see the weight itself to keep the torch ops that carry its gradient. Layers 1 and 2 are GDN layers as
    layer 0 is: their weights are left out (CI time)."""
    base = {k: v.to(device) for k, v in ref.gguf_weights(hf_model).items()}
    hp = ref.hparams_of(hf_model)
    ids = torch.tensor(_prompt(3, seed=13), device=device)
    grads = {}
    for name in [n for n in base if not n.startswith(("blk.1.", "blk.2."))]:
        weights = dict(base)
        weights[name] = base[name].clone().requires_grad_(True)
        model = Model(hp, weights)
        loss = model.forward(ids, model.new_state()).square().sum()
        grads[name] = torch.autograd.grad(loss, weights[name])[0] if loss.requires_grad else None
    return grads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_weight_tracked_alone_gets_the_torch_forms_gradient(tiny, monkeypatch, device):
    hf_model, _ = tiny
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")  # the torch ops only: the reference gradients
    want = _one_weight_grads(hf_model, device)
    monkeypatch.delenv("STRATA_FUSED_DECODE")
    got = _one_weight_grads(hf_model, device)
    assert all(g is not None for g in want.values())
    dropped = [name for name, g in got.items() if g is None]  # a fused form dropped them
    assert not dropped
    assert not [name for name, g in want.items() if (got[name] - g).abs().max() > 1e-3 * g.abs().max() + 1e-6]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_norm_weights_of_another_dtype_keep_the_torch_ops(tiny, monkeypatch, device):
    """bf16 norm weights: the fused forms take float32 only, so a decode window keeps the torch ops for them
    rather than raise (the logits of STRATA_FUSED_DECODE=0 up to the other fused forms' rounding)."""
    hf_model, _ = tiny
    weights = {k: v.to(device=device, dtype=torch.bfloat16 if k.endswith("norm.weight") else v.dtype)
               for k, v in ref.gguf_weights(hf_model).items()}
    model = Model(ref.hparams_of(hf_model), weights)
    ids = torch.tensor(_prompt(3, seed=17), device=device)
    with torch.inference_mode():
        got = model.forward(ids, model.new_state())
        monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
        want = model.forward(ids, model.new_state())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
