"""generate(): chunked prompt + decode on the tiny qwen3next, against transformers' greedy tokens."""

import dataclasses

import pytest
import torch

from strata_ray.engine.generate import SMALL_HOST_THREADS, GenerationError, decode_threads, generate
from strata_ray.engine.sampling import SamplingParams
from strata_ray.model.forward import Model
from tests.model import hf_reference as ref

PROMPT = torch.randint(0, ref.VOCAB, (100,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def tiny():
    hf_model = ref.tiny_qwen3next(seed=4)
    return hf_model, Model(ref.hparams_of(hf_model), ref.gguf_weights(hf_model))


@pytest.fixture(scope="module")
def greedy(tiny):
    _, model = tiny
    return generate(model, PROMPT, 16, SamplingParams(), stop_ids=(), prefill_chunk=64)


def test_greedy_matches_transformers(tiny, greedy):
    hf_model, _ = tiny
    assert greedy.token_ids == ref.hf_greedy(hf_model, PROMPT, 16)
    assert greedy.prompt_tokens == 100 and greedy.finish_reason == "length"
    assert greedy.prompt_seconds > 0 and greedy.decode_seconds > 0


def test_prefill_chunk_size_does_not_change_tokens(tiny, greedy):
    _, model = tiny
    for chunk in (128, 512):
        out = generate(model, PROMPT, 16, SamplingParams(), (), prefill_chunk=chunk)
        assert out.token_ids == greedy.token_ids


def test_stop_id_ends_generation_and_is_not_emitted(tiny, greedy):
    _, model = tiny
    stop = greedy.token_ids[5]
    first = greedy.token_ids.index(stop)
    seen = []
    out = generate(model, PROMPT, 16, SamplingParams(), {stop}, on_token=seen.append, prefill_chunk=64)
    assert out.token_ids == greedy.token_ids[:first] == seen
    assert out.finish_reason == "stop"


def test_on_token_streams_every_token_in_order(tiny, greedy):
    _, model = tiny
    seen = []
    out = generate(model, PROMPT, 16, SamplingParams(), (), on_token=seen.append, prefill_chunk=64)
    assert seen == out.token_ids == greedy.token_ids


def test_top_logprobs(tiny):
    _, model = tiny
    out = generate(model, PROMPT, 6, SamplingParams(), (), logprobs=3, prefill_chunk=64)
    assert len(out.top_logprobs) == len(out.token_logprobs) == 6
    for tok, lp, top in zip(out.token_ids, out.token_logprobs, out.top_logprobs, strict=True):
        ids, values = zip(*top, strict=True)
        assert len(top) == 3 and list(values) == sorted(values, reverse=True)
        assert ids[0] == tok and values[0] == lp  # greedy picks the most likely token
        assert sum(torch.tensor(values).exp()) <= 1.0 + 1e-6


@pytest.mark.parametrize("chunk,n", [(64, 100), (128, 100), (64, 129)])  # 129: a last chunk of one token
def test_prompt_logprobs_score_each_prompt_token_and_leave_the_generation_alone(tiny, chunk, n):
    _, model = tiny
    prompt = (PROMPT * 2)[:n]
    handed = []
    out = generate(model, prompt, 6, SamplingParams(), (), logprobs=2, prefill_chunk=chunk,
                   prompt_logprobs=3, on_prompt=handed.append)
    plain = generate(model, prompt, 6, SamplingParams(), (), logprobs=2, prefill_chunk=chunk)
    # the same chunks and the first token from the same last row's logits: the same tokens and logprob bits
    assert (out.token_ids, out.token_logprobs, out.top_logprobs) == \
        (plain.token_ids, plain.token_logprobs, plain.top_logprobs)
    assert handed == [out.prompt_logprobs] and plain.prompt_logprobs == []
    # against every row of one whole forward: token t's logprob given tokens < t
    with torch.inference_mode():
        lp = torch.log_softmax(model.forward(prompt).float(), dim=-1)  # [n, V]
    assert len(out.prompt_logprobs) == len(prompt) - 1
    want = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert [e.logprob for e in out.prompt_logprobs] == pytest.approx(want.tolist(), abs=1e-4)
    for row, e in zip(lp, out.prompt_logprobs, strict=False):
        assert [v for _, v in e.top] == pytest.approx(torch.topk(row, 3).values.tolist(), abs=1e-4)
        assert all(row[i] == pytest.approx(v, abs=1e-4) for i, v in e.top)  # each id with its own value


def test_on_token_gets_each_tokens_logprobs_when_asked(tiny):
    _, model = tiny
    seen = []
    out = generate(model, PROMPT, 5, SamplingParams(), (), on_token=lambda t, **kw: seen.append((t, kw)),
                   logprobs=2, prefill_chunk=64)
    assert [t for t, _ in seen] == out.token_ids
    entries = [kw["logprob"] for _, kw in seen]
    assert [e.logprob for e in entries] == out.token_logprobs
    assert [list(e.top) for e in entries] == out.top_logprobs
    plain = []
    generate(model, PROMPT, 2, SamplingParams(), (), on_token=plain.append, prefill_chunk=64)  # one argument
    assert plain == out.token_ids[:2]


def test_seeded_sampling_is_reproducible(tiny):
    _, model = tiny
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=123)
    a = generate(model, PROMPT[:30], 12, params, (), prefill_chunk=64).token_ids
    b = generate(model, PROMPT[:30], 12, params, (), prefill_chunk=64).token_ids
    assert a == b and len(a) == 12


def test_an_unseeded_draw_names_the_seed_that_repeats_it(tiny, greedy):
    """A sampled request without a seed draws one; the result names it, and that seed given back draws the
    same tokens. Greedy has none."""
    _, model = tiny
    free = generate(model, PROMPT[:30], 12, SamplingParams(temperature=1.0), (), prefill_chunk=64)
    assert isinstance(free.seed, int) and 0 <= free.seed < 2**64
    again = generate(model, PROMPT[:30], 12, SamplingParams(temperature=1.0, seed=free.seed), (),
                     prefill_chunk=64)
    assert again.token_ids == free.token_ids and again.seed == free.seed
    assert greedy.seed is None


def test_stops_when_the_context_is_full(tiny):
    hf_model, model = tiny
    small = Model(dataclasses.replace(model.hp, context_length=104), model.weights)
    out = generate(small, PROMPT, 50, SamplingParams(), (), prefill_chunk=64)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"  # 100 + 4 fed back fill 104


def test_zero_max_tokens_runs_only_the_prompt(tiny):
    _, model = tiny
    out = generate(model, PROMPT[:10], 0, SamplingParams(), ())
    assert out.token_ids == [] and out.prompt_tokens == 10


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_ids=[]), "prompt is empty"),
    (dict(prefill_chunk=100), "multiple of 64"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(prompt_ids=[ref.VOCAB]), "out of range"),
])
def test_bad_requests_are_one_line_errors(tiny, kwargs, message):
    _, model = tiny
    args = dict(prompt_ids=[1, 2], max_tokens=2, sampling=SamplingParams(), stop_ids=())
    args.update(kwargs)
    with pytest.raises(GenerationError, match=message):
        generate(model, **args)


def test_decode_threads_uses_one_thread_on_a_small_cpu_host_and_restores():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with decode_threads(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with decode_threads("cuda"):  # GPU models keep the host's setting
            assert torch.get_num_threads() == 2
        torch.set_num_threads(SMALL_HOST_THREADS + 1)
        with decode_threads("cpu"):  # a large host keeps its threads for large dense matrices
            assert torch.get_num_threads() == SMALL_HOST_THREADS + 1
    finally:
        torch.set_num_threads(before)


def test_logprobs_are_computed_on_one_torch_thread_whatever_the_host_has(tiny, monkeypatch):
    """A large host (a CUDA model's, whose CPU team spins on every core but one) keeps its torch threads for
    the decode, but a token's logprobs run on one: the count seen inside log_softmax, restored after."""
    _, model = tiny
    seen, log_softmax = [], torch.log_softmax

    def counted(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return log_softmax(*args, **kwargs)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(SMALL_HOST_THREADS + 1)
        monkeypatch.setattr(torch, "log_softmax", counted)
        out = generate(model, PROMPT, 3, SamplingParams(), (), logprobs=2, prefill_chunk=64)
        assert seen == [1, 1, 1] and len(out.token_logprobs) == 3
        assert torch.get_num_threads() == SMALL_HOST_THREADS + 1
    finally:
        torch.set_num_threads(before)


def _decode_logits(model, threads: int) -> torch.Tensor:
    torch.set_num_threads(threads)
    with torch.inference_mode():
        state = model.new_state()
        model.forward(PROMPT, state)
        return torch.stack([model.forward([t], state)[-1] for t in PROMPT[:8]])  # [8, V]


def _blas_sums_alike_on_1_and_2_threads(model) -> bool:
    """Whether torch's BLAS itself gives the same bits on 1 and 2 threads for products of the model's shapes.

    MKL does not promise that: on some CPUs it splits a small product's sum across threads (one CI machine
    gave different decode logits). Our own code must add no thread dependence, which can only be seen where
    the BLAS adds none."""
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(3)
        products = []
        for rows in (1, len(PROMPT)):
            for cols in (model.hp.n_embd, model.hp.n_vocab, model.hp.n_ff_exp):
                x = torch.randn(rows, model.hp.n_embd, generator=gen)  # [T, H]
                w = torch.randn(cols, model.hp.n_embd, generator=gen)  # [N, H]
                products.append(torch.nn.functional.linear(x, w))  # [T, N]
        results.append(products)
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_decode_logits_are_reproducible_at_a_fixed_thread_count(tiny):
    _, model = tiny
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            assert torch.equal(_decode_logits(model, threads), _decode_logits(model, threads))
    finally:
        torch.set_num_threads(before)


def test_decode_logits_do_not_depend_on_the_thread_count(tiny):
    """decode_threads() drops to one torch thread for decode on a small host; that must not change bits."""
    _, model = tiny
    before = torch.get_num_threads()
    try:
        if not _blas_sums_alike_on_1_and_2_threads(model):
            pytest.skip("this CPU's BLAS sums differently on 1 and 2 threads, so the model's logits may too")
        assert torch.equal(_decode_logits(model, 1), _decode_logits(model, 2))
    finally:
        torch.set_num_threads(before)


def test_the_decode_rate_counts_the_forwards_it_timed(tiny, greedy, monkeypatch):
    """The first token is drawn from the prompt's logits (prompt_seconds), so n tokens that end on the
    length take n - 1 one-token forwards in decode_seconds, and n where a stop id ended them. The rate
    divides those forwards, not n: a one-token run showed 5,284 tok/s for a model that decodes ~500."""
    _, model = tiny
    one_token = []
    real = model.forward

    def counting(ids, state, **kw):
        one_token.append(len(ids) == 1)  # the prompt's chunks are 64 and 36 tokens
        return real(ids, state, **kw)

    monkeypatch.setattr(model, "forward", counting)
    stop = greedy.token_ids[5]
    runs = [(n, ()) for n in (1, 2, 6)] + [(16, {stop})]
    for n, stops in runs:
        one_token.clear()
        out = generate(model, PROMPT, n, SamplingParams(), stops, prefill_chunk=64)
        forwards = sum(one_token)
        assert out.decode_forwards == forwards, (n, out.finish_reason)
        assert out.decode_tokens_per_second == (forwards / out.decode_seconds if forwards else 0.0)
    assert out.finish_reason == "stop" and out.decode_forwards == len(out.token_ids) > 0
