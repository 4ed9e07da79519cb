"""EngineRunner in process (no Ray): arrival order, and an engine failure that the runner survives."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from strata_ray.config import EngineConfig
from strata_ray.engine.engine import GenerationRequest
from strata_ray.serve.openai_api import APIError, Sampling
from strata_ray.serve.runner import EngineRunner, Finished, system_fingerprint
from strata_ray.serve.status import ServeMetrics

GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def runner(model_path):
    r = EngineRunner(EngineConfig(model=str(model_path), device="cpu"), ServeMetrics())
    assert r.wait_loaded_blocking(120) and r.loaded, r.load_error
    return r


async def collect(runner, name: str, prompt_ids, max_tokens=3, stop=(), logprobs=0, whole=False, echo=False,
                  added_bos=False, delay=0.0):
    """(text, Finished); whole: (the pieces, Finished); delay: seconds the reader takes a piece (a slow
    stream's client)."""
    rec = runner.metrics.enqueue(name, "test")
    events = runner.stream(rec, prompt_ids, max_tokens, GREEDY, stop, logprobs, echo, added_bos)
    pieces = []
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Finished):
                return (pieces if whole else "".join(p.text for p in pieces)), event
            pieces.append(event)
            await asyncio.sleep(delay)


def test_requests_run_one_at_a_time_in_arrival_order(runner):
    async def main():
        order = []

        async def one(i):
            await collect(runner, f"r{i}", [10 + i], max_tokens=2)
            order.append(i)

        await asyncio.gather(*(one(i) for i in range(5)))
        return order

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
    assert runner.metrics.queued == 0 and runner.metrics.state == "idle"


def own_runner(model_path) -> EngineRunner:
    """A runner of the test's own: the shared one's lock is bound to the event loop of the test that first
    made a request wait, and a drain is for good."""
    runner = EngineRunner(EngineConfig(model=str(model_path), device="cpu"), ServeMetrics())
    assert runner.wait_loaded_blocking(120) and runner.loaded, runner.load_error
    return runner


def test_a_request_closed_while_queued_is_listed_cancelled(model_path):
    """A client that leaves while its request waits for the engine: the request is listed and counted as
    cancelled, so the totals add up (it was counted in requests and nowhere else)."""
    runner = own_runner(model_path)
    ids = runner.engine.tokenizer.encode("Hello")
    m = runner.metrics

    async def main():
        first = asyncio.create_task(collect(runner, "long", ids, max_tokens=min(300, runner.context - 2)))
        await asyncio.sleep(0.01)  # the first holds the engine
        rec = m.enqueue("gone", "test")
        events = runner.stream(rec, ids, 3, GREEDY, ())
        waiting = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.02)
        assert not waiting.done() and m.queued == 1
        waiting.cancel()  # as Serve cancels the handler of a client that went away
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await events.aclose()
        assert m.queued == 0
        await first

    asyncio.run(main())
    gone = next(r for r in m.recent if r.id == "gone")
    assert gone.finish_reason == "cancelled" and gone.generated == 0
    t = m.totals
    assert (t.requests, t.completed, t.cancelled, t.failed) == (2, 1, 1, 0)


def test_a_drain_refuses_new_requests_and_ends_the_running_one_with_a_503_after_its_grace(model_path):
    """The server's stop: new requests get the 503 at once; the running generation gets the grace, then ends
    with a 503 of its own (a stream's error event), and the one queued behind it gets the 503 too."""
    runner = own_runner(model_path)
    ids = runner.engine.tokenizer.encode("The Python standard library")  # greedy: no end for 2000 tokens
    long_tokens = min(2000, runner.context - len(ids) - 1)

    async def main():
        long = asyncio.create_task(collect(runner, "long", ids, max_tokens=long_tokens))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(collect(runner, "queued", ids, max_tokens=3))
        await asyncio.sleep(0.02)
        runner.drain(0.3)
        runner.drain(60.0)  # a second call keeps the first deadline
        with pytest.raises(APIError) as refused, runner.taking():
            pass
        assert runner.busy and not long.done()
        return refused.value, await asyncio.gather(long, queued, return_exceptions=True)

    refused, (long, queued) = asyncio.run(main())
    for e in (refused, long, queued):
        assert isinstance(e, APIError) and (e.status, e.code) == (503, "server_shutting_down"), e
    assert "before this generation finished" in long.message and "shutting down" in queued.message
    rec = next(r for r in runner.metrics.recent if r.id == "long")
    assert 0 < rec.generated < long_tokens and not runner.busy


def test_a_generation_that_ends_within_the_drains_grace_is_answered_whole(model_path):
    """And a request still on its way to the queue (its prompt's tokens, say) counts as work to wait for."""
    runner = own_runner(model_path)
    ids = runner.engine.tokenizer.encode("Hello")

    async def main():
        with runner.taking():
            task = asyncio.create_task(collect(runner, "short", ids, max_tokens=4))
            await asyncio.sleep(0.01)
            runner.drain(60.0)
            result = await task
            assert runner.busy  # the request being taken
        assert not runner.busy
        return result

    text, done = asyncio.run(main())
    assert done.finish_reason in ("stop", "length") and done.completion_tokens > 0


def test_engine_failure_is_a_500_and_the_runner_keeps_serving(runner):
    ids = runner.engine.tokenizer.encode("Hello")
    model = runner.engine.loaded.model
    runner.engine.loaded.model = None  # a broken engine: generate() fails inside the engine thread
    try:
        with pytest.raises(APIError) as info:
            asyncio.run(collect(runner, "broken", ids))
        assert info.value.status == 500 and info.value.type == "server_error"
    finally:
        runner.engine.loaded.model = model
    assert runner.metrics.recent[0].finish_reason == "error"
    text, done = asyncio.run(collect(runner, "after", ids))
    assert done.finish_reason in ("stop", "length") and done.completion_tokens > 0


def test_logprobs_come_with_the_pieces_their_tokens_make(runner):
    ids = runner.engine.tokenizer.encode("Hello")
    pieces, done = asyncio.run(collect(runner, "lp", ids, max_tokens=8, logprobs=3, whole=True))
    tokens = [t for p in pieces for t in p.tokens]
    want = runner.engine.generate(GenerationRequest(prompt_ids=tuple(ids), max_tokens=8, logprobs=3))
    assert [t.token_id for t in tokens] == list(want.token_ids)
    assert [list(t.top) for t in tokens] == want.top_logprobs[: len(tokens)]
    assert all(t.top[0][0] == t.token_id and len(t.top) == 3 for t in tokens)  # greedy: the most likely
    text, sent = "".join(p.text for p in pieces), 0
    for p in pieces:  # a piece's tokens start inside the text sent up to and with it, never later
        sent += len(p.text)
        assert all(t.offset < sent or (t.offset == sent and p is pieces[-1]) for t in p.tokens)
    plain, _ = asyncio.run(collect(runner, "plain", ids, max_tokens=8, whole=True))
    assert "".join(p.text for p in plain) == text and all(p.tokens == () for p in plain)


def test_an_echo_sends_the_prompt_first_with_its_scores_and_counts_it_in_the_offsets(runner):
    tok = runner.engine.tokenizer
    ids = tok.encode("import os\nimport sys")
    pieces, done = asyncio.run(collect(runner, "echo", ids, max_tokens=5, logprobs=2, whole=True, echo=True))
    first, *rest = pieces
    assert first.text == tok.decode(ids) and [t.token_id for t in first.tokens] == ids
    assert first.tokens[0].logprob is None and all(t.logprob is not None for t in first.tokens[1:])
    want = runner.engine.generate(GenerationRequest(prompt_ids=tuple(ids), max_tokens=5, logprobs=2,
                                                    prompt_logprobs=2))
    assert [t.logprob for t in first.tokens[1:]] == [e.logprob for e in want.prompt_logprobs]
    generated = [t for p in rest for t in p.tokens]
    assert [t.token_id for t in generated] == list(want.token_ids) and done.completion_tokens == 5
    assert all(t.offset >= len(first.text) for t in generated)  # after the echoed prompt
    plain, _ = asyncio.run(collect(runner, "plain", ids, max_tokens=5))
    assert "".join(p.text for p in rest) == plain
    only, done = asyncio.run(collect(runner, "only", ids, max_tokens=0, echo=True))
    assert only == tok.decode(ids) and done.completion_tokens == 0 and done.finish_reason == "length"


def test_an_echo_leaves_out_the_text_of_a_bos_the_server_added(runner):
    """A model that adds a BOS before text prompts: the echo is the prompt's own text, the BOS still scored
    first (no logprob, no text: its offset 0), and the generated offsets count the text alone."""
    tok = runner.engine.tokenizer
    text = "import os\nimport sys"
    bos = tok.eos_id  # any special token stands in: this model adds none
    ids = [bos, *tok.encode(text)]
    assert tok.decode(ids) != text  # echoed whole, the stand-in's text would lead
    pieces, done = asyncio.run(collect(runner, "bos", ids, max_tokens=3, logprobs=1, whole=True, echo=True,
                                       added_bos=True))
    first, *rest = pieces
    assert first.text == text and [t.token_id for t in first.tokens] == ids
    assert [t.offset for t in first.tokens[:2]] == [0, 0] and first.tokens[0].logprob is None
    assert all(t.offset >= len(text) for p in rest for t in p.tokens)
    only, _ = asyncio.run(collect(runner, "bos-only", ids, max_tokens=0, echo=True, added_bos=True))
    assert only == text


def test_an_echo_that_ends_on_a_stop_id_lists_it_last(runner):
    """lm-evaluation-harness asks an echo with max_tokens 1 and reads token_logprobs[prompt:-1]: one generated
    entry assumed at the end. Where the model's next token is its end of turn, that entry is the stop id (as
    vLLM lists it), text "", after the prompt's; before, the list ended with the prompt and a score lost."""
    tok, engine = runner.engine.tokenizer, runner.engine
    ids = engine.prompt_ids(GenerationRequest(prompt="What is a Python list?", chat=True))
    answer = engine.generate(GenerationRequest(prompt_ids=tuple(ids), max_tokens=200))
    assert answer.finish_reason == "stop", "the embedded model ends its answer with a stop id"
    whole = [*ids, *answer.token_ids]  # the answer's end is next
    pieces, done = asyncio.run(collect(runner, "eos", whole, max_tokens=1, logprobs=1, whole=True, echo=True))
    tokens = [t for p in pieces for t in p.tokens]
    assert [t.token_id for t in tokens] == [*whole, answer.stop[0]] and answer.stop[0] in tok.stop_ids
    assert tokens[-1].logprob is not None and tokens[-1].offset == len("".join(p.text for p in pieces))
    assert done.completion_tokens == 0 and done.finish_reason == "stop"
    plain, _ = asyncio.run(collect(runner, "plain", whole, max_tokens=1, logprobs=1, whole=True))
    assert [t for p in plain for t in p.tokens] == []  # not an echo: the stop id is not listed


def test_tokens_made_past_a_stop_are_not_counted_however_slow_the_reader(runner):
    """The engine goes on until it sees the cancel; a slow reader let more of those tokens queue up, and each
    was counted in usage (a stream's completion_tokens varied run to run). Now the stop's own token is the
    last counted, whatever the reader's pace."""
    ids = runner.engine.tokenizer.encode("The json module")
    full, _ = asyncio.run(collect(runner, "full", ids, max_tokens=40))
    if len(full) < 12:
        pytest.skip("the model's answer is too short to cut")
    stop = full[8:11]
    fast_text, fast = asyncio.run(collect(runner, "fast", ids, max_tokens=40, stop=(stop,)))
    slow_text, slow = asyncio.run(collect(runner, "slow", ids, max_tokens=40, stop=(stop,), delay=0.05))
    assert fast_text == slow_text == full[: full.index(stop)]
    assert (fast.finish_reason, slow.finish_reason) == ("stop", "stop")
    assert slow.completion_tokens == fast.completion_tokens < 40


def test_the_fingerprint_follows_the_model_file_and_the_arithmetic_switches(runner, tmp_path):
    import os

    from strata_ray.model.gguf_file import GGUFFile
    from strata_ray.model.synth import write_synth

    cfg = runner.config
    assert runner.fingerprint == system_fingerprint(cfg, runner.engine.loaded.file, "cpu", os.environ)
    path = tmp_path / "m.gguf"

    def fp(env=None, device="cpu", **synth) -> str:
        if synth:
            write_synth(path, arch="qwen3next", preset="tiny", progress=False, **synth)
        return system_fingerprint(cfg, GGUFFile(path), device, env or {})

    base, size = fp(seed=0), path.stat().st_size
    assert base.startswith("fp_") and len(base) == 13 and base == fp()
    assert fp({"STRATA_EXPERT_CACHE": "0", "STRATA_MODEL": "x"}) == base  # placement and the path's default
    assert fp({"STRATA_ATTN_DOT": "ieee"}) != base
    assert fp(device="cuda") != base
    # the same path and size, other weights: a Q4_0 file of the same model (the same routers), another seed's
    assert fp(seed=0, expert_type="Q4_0") != base and path.stat().st_size == size
    assert fp(seed=1) != base and path.stat().st_size == size
    assert fp(seed=0) == base
