"""DecodeGraphs: one-token forwards through the captured segments give Model.forward's bits.

On the CPU the segments run uncaptured (capture=False): the same split into segments, static buffers and
state hand-offs. `pytest -m gpu` runs the captured graphs on CUDA against the eager forward there.
"""

import os

import pytest
import torch

from strata_ray.model.forward import Model
from tests.model import hf_reference as ref

PROMPT = 37  # not a multiple of the 64-token GDN chunk: decode starts mid-window
STEPS = 12


def _models(device="cpu"):
    """(eager model, model with decode graphs) over the same weights."""
    out = {}
    for arch, make in (("qwen3next", ref.tiny_qwen3next), ("qwen3moe", ref.tiny_qwen3moe)):
        hf = make(seed=0)
        weights = {k: v.to(device) for k, v in ref.gguf_weights(hf).items()}
        hp = ref.hparams_of(hf)
        graphed = Model(hp, weights)
        graphed.use_decode_graphs(capture=device == "cuda")
        out[arch] = (Model(hp, weights), graphed)
    return out


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=GPU),
                                        pytest.param("cuda-device-attention", marks=GPU)])
def models(request):
    """On the CPU the segments uncaptured; on CUDA (-m gpu) the captured graphs, with the attention core
    eager between them, or (STRATA_DECODE_DEVICE_ATTENTION=1) in them: the KV cache written and read at the
    position held on the device (DeviceAttention)."""
    device, _, variant = request.param.partition("-")
    old = os.environ.get("STRATA_DECODE_DEVICE_ATTENTION")
    os.environ["STRATA_DECODE_DEVICE_ATTENTION"] = "1" if variant else "0"  # read when the graphs are built
    try:
        models = _models(device)
    finally:
        if old is None:
            del os.environ["STRATA_DECODE_DEVICE_ATTENTION"]
        else:
            os.environ["STRATA_DECODE_DEVICE_ATTENTION"] = old
    if variant:
        assert all(graphed.decode_graphs.attn is not None for _, graphed in models.values())
    return models


def _decode(model, prompt, steps, state=None):
    """Prompt, then `steps` greedy one-token forwards -> (token ids, stacked logits)."""
    with torch.inference_mode():
        state = model.new_state() if state is None else state
        logits = model.forward(prompt, state)[-1:]
        toks, all_logits = [], []
        for _ in range(steps):
            toks.append(int(logits[-1].argmax()))
            logits = model.forward([toks[-1]], state)
            all_logits.append(logits)
    return toks, torch.cat(all_logits)


def _assert_same_decode(eager, graphed, prompt):
    toks_e, logits_e = _decode(eager, prompt, STEPS)
    toks_g, logits_g = _decode(graphed, prompt, STEPS)
    assert toks_g == toks_e
    assert torch.equal(logits_g, logits_e)  # bit for bit
    assert len(set(toks_e)) > 2  # a model stuck on one token would prove little


@pytest.mark.parametrize("arch", ["qwen3next", "qwen3moe"])
def test_decode_steps_equal_the_plain_forward_bit_for_bit(models, arch):
    eager, graphed = models[arch]
    _assert_same_decode(eager, graphed, ref.random_prompt(PROMPT, seed=4))


def test_interleaved_sequences_keep_their_own_state(models):
    eager, graphed = models["qwen3next"]
    prompts = [ref.random_prompt(PROMPT, seed=5), ref.random_prompt(20, seed=6)]
    alone = [_decode(eager, p, STEPS)[1] for p in prompts]
    with torch.inference_mode():
        states = [graphed.new_state() for _ in prompts]
        last = [graphed.forward(p, s)[-1:] for p, s in zip(prompts, states, strict=True)]
        got = [[], []]
        for _ in range(STEPS):  # A, B, A, B, ...: every step hands the GDN buffers to the other sequence
            for i, s in enumerate(states):
                last[i] = graphed.forward([int(last[i][-1].argmax())], s)
                got[i].append(last[i])
    for i in range(2):
        assert torch.equal(torch.cat(got[i]), alone[i])


def test_prompt_chunk_after_graph_steps_continues_the_same_state(models):
    """Decode steps, then a multi-token forward (eager, reads the graph-owned state), then decode again."""
    eager, graphed = models["qwen3next"]
    prompt, extra = ref.random_prompt(PROMPT, seed=7), ref.random_prompt(9, seed=8)
    results = []
    for model in (eager, graphed):
        with torch.inference_mode():
            state = model.new_state()
            model.forward(prompt, state)
            a = [model.forward([t], state) for t in (5, 9, 11)]
            b = model.forward(extra, state)
            c = [model.forward([t], state) for t in (3, 4)]
        results.append(torch.cat(a + [b] + c))
    assert torch.equal(results[1], results[0])


def test_snapshot_of_a_graph_owned_state_is_independent(models):
    """state.clone() while the graphs hold its GDN state, decode on: the snapshot replays the same tokens."""
    _, graphed = models["qwen3next"]
    with torch.inference_mode():
        state = graphed.new_state()
        graphed.forward(ref.random_prompt(PROMPT, seed=9), state)
        graphed.forward([7], state)
        snap = state.clone()
        first = [graphed.forward([t], state) for t in (1, 2, 3)]
        again = [graphed.forward([t], snap) for t in (1, 2, 3)]
    assert torch.equal(torch.cat(again), torch.cat(first))


def test_return_hidden_gives_the_final_normed_state(models):
    eager, graphed = models["qwen3next"]
    out = []
    for model in (eager, graphed):
        with torch.inference_mode():
            state = model.new_state()
            model.forward(ref.random_prompt(PROMPT, seed=10), state)
            out.append(model.forward([3], state, return_hidden=True))
    assert torch.equal(out[1][0], out[0][0]) and torch.equal(out[1][1], out[0][1])


def test_decode_across_kv_cache_growth(models):
    """40 steps from a 37-token prompt: the caches grow past 64 rows mid-decode (they move; the graphs' table
    of cache addresses follows)."""
    eager, graphed = models["qwen3moe"]
    toks_e, logits_e = _decode(eager, ref.random_prompt(PROMPT, seed=11), 40)
    toks_g, logits_g = _decode(graphed, ref.random_prompt(PROMPT, seed=11), 40)
    assert toks_g == toks_e and torch.equal(logits_g, logits_e)


def test_capture_on_a_cpu_model_is_refused():
    _, graphed = _models()["qwen3moe"]
    with pytest.raises(ValueError, match="need a CUDA device"):
        graphed.use_decode_graphs(capture=True)
