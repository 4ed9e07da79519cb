"""Engine without Ray: prompts (text, chat, ids), streaming batches, stop(), request errors."""

import threading
from dataclasses import replace

import pytest

from strata_ray.actors.coordinator import Coordinator
from strata_ray.actors.primary import Primary
from strata_ray.config import EngineConfig
from strata_ray.engine.engine import (
    Engine,
    FeatureNotAvailable,
    GenerationRequest,
    GenerationStopped,
    GenerationSummary,
    RequestError,
    TokenBatch,
    check_supported,
)
from strata_ray.model.synth import write_synth


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "tiny.gguf"
    write_synth(path, arch="qwen3next", preset="tiny", progress=False)
    return Engine(EngineConfig(model=str(path), device="cpu"), progress=False)


def test_text_prompt_and_chat_template(engine):
    tok = engine.tokenizer
    assert engine.prompt_ids(GenerationRequest(prompt="Hi there")) == tok.encode("Hi there")
    chat = engine.prompt_ids(GenerationRequest(prompt="Hi there", chat=True))
    assert tok.decode(chat) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert engine.prompt_ids(GenerationRequest(prompt_ids=(5, 6, 7))) == [5, 6, 7]  # as given, no BOS


@pytest.mark.parametrize(
    "request_, message",
    [
        (GenerationRequest(prompt=""), "the prompt is empty"),
        (GenerationRequest(prompt_ids=(1, 100000)),
         "prompt token id 100000 is out of range (vocabulary of 288 tokens)"),
        (GenerationRequest(prompt="x" * 5000),
         "the prompt has 5000 tokens; the model's context is 4096 tokens"),
    ],
)
def test_request_errors_are_one_line(engine, request_, message):
    with pytest.raises(RequestError) as e:
        engine.prompt_ids(request_)
    assert str(e.value) == message


def spread_ids(n: int) -> tuple[int, ...]:
    """n prompt ids spread over the tiny vocabulary (288 tokens), none of them a control token."""
    return tuple((i * 37 + 11) % 250 + 5 for i in range(n))


@pytest.mark.parametrize("prompt", [1, 63, 64, 65, 127, 128, 129, " ", "\n\n\t "])
def test_the_prompt_chunk_does_not_change_the_tokens_at_its_edges(engine, monkeypatch, prompt):
    """--prefill 64, 128 and 512 (the CPU's auto) over prompts of one token, a chunk, one more and one less,
    and whitespace alone: the same greedy ids, and prompt logprobs (an echo's) equal to rounding. Their last
    bits may move with the chunking on the CPU, whose F.linear rounds calls of a few rows differently (DESIGN
    section 7's batch invariance, a known gap of the CPU dense path)."""
    import numpy as np

    if isinstance(prompt, int):
        request = GenerationRequest(prompt_ids=spread_ids(prompt), max_tokens=6, prompt_logprobs=2)
    else:
        request = GenerationRequest(prompt=prompt, max_tokens=6, prompt_logprobs=2)
    outputs, scores = set(), []
    for chunk in (64, 128, 512):
        monkeypatch.setattr(engine, "config", replace(engine.config, prefill=chunk))
        summary = engine.generate(request)
        outputs.add((summary.token_ids, summary.finish_reason))
        scores.append([lp.logprob for lp in summary.prompt_logprobs])
    assert len(outputs) == 1
    (ids, finish), = outputs
    assert len(scores[0]) == summary.prompt_tokens - 1 and (len(ids) == 6 or finish == "stop")
    assert all(np.allclose(s, scores[0], rtol=1e-5, atol=1e-6) for s in scores[1:])


def test_a_generation_ends_at_the_context_with_length(engine):
    """prompt + generated tokens fill the context at most (as vLLM's max_model_len and llama.cpp's n_ctx
    count them): past it max_tokens is cut, and the end is "length", the last prompt that fits being one
    token short of the context."""
    context = engine.loaded.hp.context_length
    for n, max_tokens, generated in ((context - 1, 1, 1), (context - 1, 2, 1), (context - 2, 2, 2),
                                     (context - 2, 500, 2)):
        summary = engine.generate(GenerationRequest(prompt_ids=spread_ids(n), max_tokens=max_tokens))
        assert (len(summary.token_ids), summary.finish_reason) == (generated, "length"), (n, max_tokens)
    with pytest.raises(RequestError, match=f"^the prompt has {context} tokens; the model's context is "):
        engine.generate(GenerationRequest(prompt_ids=spread_ids(context), max_tokens=1))
    # the whole context scored (echo with max_tokens 0): no row is needed after it
    whole = GenerationRequest(prompt_ids=spread_ids(context), max_tokens=0, prompt_logprobs=1)
    scored = engine.generate(whole)
    assert (scored.token_ids, scored.prompt_tokens, len(scored.prompt_logprobs)) == ((), context, context - 1)


def test_stream_batches_add_up_to_the_summary(engine):
    request = GenerationRequest(prompt="import os", max_tokens=20)
    items = list(engine.stream(request, flush_seconds=0.0))
    *batches, summary = items
    assert isinstance(summary, GenerationSummary) and all(isinstance(b, TokenBatch) for b in batches)
    assert tuple(t for b in batches for t in b.token_ids) == summary.token_ids
    assert "".join(b.text for b in batches) == summary.text
    assert summary.token_ids == engine.generate(request).token_ids  # streaming does not change tokens
    assert summary.prompt_tokens == len(engine.tokenizer.encode("import os"))
    assert summary.summary_line().startswith(f"prompt: {summary.prompt_tokens} tokens, ")


def test_logprobs_reach_on_token_and_the_stream(engine):
    request = GenerationRequest(prompt="import os", max_tokens=6, logprobs=2)
    seen = []
    summary = engine.generate(request, on_token=lambda t, lp: seen.append((t, lp.top)))
    assert [t for t, _ in seen] == list(summary.token_ids) and [list(top) for _, top in seen] == \
        summary.top_logprobs
    *batches, streamed = list(engine.stream(request, flush_seconds=0.0))  # its queue takes the ids alone
    assert streamed.token_ids == summary.token_ids and streamed.top_logprobs == summary.top_logprobs


def test_batches_group_tokens_within_the_flush_interval(engine):
    items = list(engine.stream(GenerationRequest(prompt="a", max_tokens=12), flush_seconds=60.0))
    *batches, summary = items
    # the first token alone at once (the time to the first token), then one batch with every other token
    assert [len(b.token_ids) for b in batches] == [1, len(summary.token_ids) - 1]


def test_stop_ends_a_running_generation(engine):
    stream = engine.stream(GenerationRequest(prompt="a", max_tokens=4000), flush_seconds=0.0)
    first = next(stream)
    assert isinstance(first, TokenBatch)
    threading.Timer(0.05, engine.stop).start()
    with pytest.raises(GenerationStopped):
        for _ in stream:
            pass


def test_closing_the_stream_stops_the_worker(engine):
    stream = engine.stream(GenerationRequest(prompt="a", max_tokens=4000), flush_seconds=0.0)
    next(stream)
    stream.close()  # joins the generation thread: it must end promptly
    assert not any(t.name == "strata-generate" for t in threading.enumerate())


def test_primary_and_coordinator_without_ray(engine):
    coordinator = Coordinator(engine.config)
    primary = Primary(engine.config)
    primary.engine = engine  # reuse the loaded model
    items = list(primary.generate_stream(GenerationRequest(prompt="x", max_tokens=5)))
    summary = items[-1]
    coordinator.record_generation(summary.prompt_tokens, len(summary.token_ids), summary.prompt_seconds,
                                  summary.decode_seconds, summary.decode_forwards)
    status = coordinator.status()
    assert status["generations"] == 1 and status["generated_tokens"] == len(summary.token_ids)
    # 5 tokens ("length"): 4 one-token forwards after the prompt's, and the rate counts those
    assert (summary.finish_reason, status["decode_forwards"]) == ("length", 4)
    rate = summary.decode_tokens_per_second
    assert status["decode_tokens_per_second"] == 4 / summary.decode_seconds == rate


def test_flags_whose_engine_part_is_missing_say_so():
    with pytest.raises(FeatureNotAvailable) as e:
        check_supported(EngineConfig(layer_split="auto"))
    assert str(e.value) == "--layer-split is not available yet"
    check_supported(EngineConfig())
