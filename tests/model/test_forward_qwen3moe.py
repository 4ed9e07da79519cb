"""The reference forward of qwen3moe against transformers' Qwen3MoeForCausalLM on a tiny random model."""

import pytest
import torch

from strata_ray.model.forward import Model
from strata_ray.model.moe import FloatExperts
from tests.model import hf_reference as ref


@pytest.fixture(scope="module")
def tiny():
    hf_model = ref.tiny_qwen3moe(seed=0)
    return hf_model, Model(ref.hparams_of(hf_model), ref.gguf_weights(hf_model))


_prompt = ref.random_prompt


def test_logits_match_transformers_at_every_position(tiny):
    hf_model, model = tiny
    ids = _prompt(64)
    expected = ref.hf_logits(hf_model, ids)
    with torch.inference_mode():
        got = model.forward(ids, model.new_state())
    assert (got - expected).abs().max() < 1e-4


def test_greedy_tokens_match_transformers(tiny):
    hf_model, model = tiny
    ids = _prompt(64, seed=2)
    expected = ref.hf_greedy(hf_model, ids, 32)
    got = ref.model_greedy(model, ids, 32)
    assert got == expected
    assert len(set(got)) > 3


def test_prompt_in_chunks_then_decode_equals_one_pass(tiny):
    _, model = tiny
    ids = _prompt(100, seed=3)
    with torch.inference_mode():
        full = model.forward(ids, model.new_state())
        state = model.new_state()
        parts = [model.forward(ids[:64], state)] + [model.forward([t], state) for t in ids[64:]]
    torch.testing.assert_close(torch.cat(parts), full, atol=2e-5, rtol=1e-5)


def test_tied_output_falls_back_to_token_embd(tiny):
    hf_model, model = tiny
    weights = {k: v for k, v in model.weights.items() if k != "output.weight"}
    tied = Model(model.hp, weights)
    with torch.inference_mode():
        logits, hidden = tied.forward(_prompt(8), tied.new_state(), return_hidden=True)
    torch.testing.assert_close(logits, hidden @ weights["token_embd.weight"].T)


def test_expert_backend_is_the_swap_point(tiny):
    """A custom backend gets every routed call (layer, x, ids, renormalised weights); its result is used."""
    _, model = tiny
    calls = []
    floats = FloatExperts(model.weights)

    def recording(layer, x, ids, w):
        calls.append((layer, tuple(x.shape), tuple(ids.shape), ids.dtype))
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[0]))
        return floats(layer, x, ids, w)

    swapped = Model(model.hp, model.weights, experts=recording)
    ids = _prompt(12, seed=4)
    with torch.inference_mode():
        torch.testing.assert_close(swapped.forward(ids), model.forward(ids))
    assert calls == [(n, (12, ref.HIDDEN), (12, 2), torch.int64) for n in range(4)]


def test_route_is_softmax_topk_renormalised(tiny):
    _, model = tiny
    x = torch.randn(5, ref.HIDDEN, generator=torch.Generator().manual_seed(0))
    ids, w = model.route(2, x)
    probs = torch.softmax(x @ model.weights["blk.2.ffn_gate_inp.weight"].T, -1)
    top = probs.topk(2, dim=-1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(w, top.values / top.values.sum(-1, keepdim=True))
