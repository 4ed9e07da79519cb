"""Generation loop over the reference Model: prompt in aligned chunks, then one token at a time."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from strata_ray.engine.rates import TokenRates
from strata_ray.engine.sampling import Sampler, SamplingParams
from strata_ray.model.decode_graph import decode_chain
from strata_ray.model.ops import GDN_CHUNK

DEFAULT_PREFILL_CHUNK = 512  # tokens per prompt forward; a multiple of GDN_CHUNK
# a prompt scored token by token (prompt logprobs): the LM head runs over slices of at most this many rows,
# [rows, V] float32 logits and their log-softmax (2 x 311 MB at a 152K vocabulary)
PROMPT_LOGPROBS_ROWS = 512
# On a host this small, one-token forwards run torch's CPU ops on one thread: their ops are too small to gain
# from a second thread, and waking it costs more than the op (decode on the 2-core VM: about the same speed
# when idle, 3-4x faster when another process keeps a core busy). The bits are the same at any thread count.
SMALL_HOST_THREADS = 4


class GenerationError(ValueError):
    """A generation request that cannot run. The message is one line."""


@dataclass
class GenerationResult(TokenRates):
    token_ids: list[int]  # generated tokens, without the stop token
    prompt_tokens: int
    prompt_seconds: float  # prompt forward until the first token's logits are ready
    decode_seconds: float  # everything after: sampling and the one-token forwards
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: top (id, logprob)
    token_logprobs: list[float] = field(default_factory=list)  # per token: logprob of the chosen id
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (prompt_logprobs)
    finish_reason: str = "length"  # "stop" (a stop id was sampled) or "length" (max_tokens / context full)
    stop: tuple | None = None  # (the stop id sampled, its TokenLogprob when logprobs > 0, else None)
    seed: int | None = None  # the draws' seed (the request's, or one drawn for it); None: greedy


@dataclass(frozen=True)
class TokenLogprob:
    """What the model gave an emitted token: its log-probability and the top K (id, logprob), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@contextmanager
def decode_threads(device) -> Iterator[None]:
    """Torch intra-op threads for the one-token forwards: one on a small host when the model is on the CPU."""
    if torch.device(device).type != "cpu" or torch.get_num_threads() > SMALL_HOST_THREADS:
        yield
        return
    with one_torch_thread():
        yield


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch's CPU ops inside run on the calling thread alone (the thread count restored after)."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def generate(
    model,
    prompt_ids: Sequence[int],
    max_tokens: int,
    sampling: SamplingParams | Sampler | None = None,
    stop_ids: Collection[int] = (),
    on_token: Callable[[int], None] | None = None,
    logprobs: int = 0,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    prompt_logprobs: int = 0,
    on_prompt: Callable[[list], None] | None = None,
) -> GenerationResult:
    """Run the prompt through `model` in chunks of `prefill_chunk` tokens, then sample up to `max_tokens`
    tokens one forward at a time. Stops at a sampled id in stop_ids (not emitted), at max_tokens, or when the
    context is full. on_token(id) is called for every emitted token as soon as it is sampled. logprobs > 0
    records that many top (id, logprob) pairs of the model's distribution per emitted token, and on_token is
    called as on_token(id, logprob=TokenLogprob) with them. prompt_logprobs > 0 records each prompt token's
    (after the first) logprob and top pairs given the tokens before it (`result.prompt_logprobs`, handed to
    on_prompt before the first token): the prompt's rows through the LM head in slices of at most
    PROMPT_LOGPROBS_ROWS; the first token is chosen from the same last row's logits as without them."""
    prompt = [int(t) for t in prompt_ids]
    hp = model.hp
    if not prompt:
        raise GenerationError("the prompt is empty (at least one token is needed)")
    if max_tokens < 0:
        raise GenerationError(f"max_tokens must be >= 0, got {max_tokens}")
    if prefill_chunk <= 0 or prefill_chunk % GDN_CHUNK:
        raise GenerationError(f"prefill chunk must be a positive multiple of {GDN_CHUNK}: {prefill_chunk}")
    if len(prompt) > hp.context_length:
        raise GenerationError(f"prompt of {len(prompt)} tokens exceeds the context ({hp.context_length})")
    if any(not 0 <= t < hp.n_vocab for t in prompt):
        raise GenerationError(f"prompt token id out of range [0, {hp.n_vocab})")
    sampler = sampling if isinstance(sampling, Sampler) else Sampler(sampling)
    stops = set(stop_ids)

    with torch.inference_mode():
        t0 = time.perf_counter()
        state = model.new_state()
        # a prompt of a few tokens runs the decode's small-batch path: the tiers count it as a prompt all
        # the same (their windows, hit rates and adaptive usage are the decode's)
        prompt_forwards = getattr(getattr(model, "experts", None), "prompt_forwards", nullcontext)
        scored: list[TokenLogprob] = []
        with prompt_forwards():
            if prompt_logprobs > 0:
                logits = _score_prompt(model, prompt, state, prefill_chunk, prompt_logprobs, scored)
            else:
                for start in range(0, len(prompt), prefill_chunk):
                    logits = model.forward(prompt[start : start + prefill_chunk], state, last_only=True)
        last = logits[-1].float()  # [V] where the model ran: the sampler draws there
        if last.device.type == "cuda":
            torch.cuda.synchronize(last.device)  # the prompt's time ends when its logits are there
        t1 = time.perf_counter()

        result = GenerationResult([], len(prompt), t1 - t0, 0.0, prompt_logprobs=scored,
                                  seed=sampler.seed if sampler.params.temperature > 0 else None)
        if on_prompt is not None and prompt_logprobs > 0:
            on_prompt(scored)
        graphs = getattr(model, "decode_graphs", None)
        chained = graphs is not None and graphs.chain and max_tokens > 0
        with decode_threads(model.device):
            if chained:  # each token chosen on the device and launched before the host reads the one before
                choose = None if sampler.params.temperature == 0 else sampler.choose_into
                _generate_chained(graphs, sampler.sample(last), last, state, hp.context_length, max_tokens,
                                  stops, on_token, result, choose, logprobs)
            while not chained and len(result.token_ids) < max_tokens:
                tok = sampler.sample(last)
                if tok in stops:
                    result.finish_reason = "stop"
                    result.stop = (tok, _logprob_entry(last, tok, logprobs) if logprobs > 0 else None)
                    break
                entry = _record_logprobs(result, last, tok, logprobs) if logprobs > 0 else None
                result.token_ids.append(tok)
                _emit(on_token, tok, entry)
                if len(result.token_ids) == max_tokens or state.pos >= hp.context_length:
                    break
                last = model.forward([tok], state)[-1].float()
        result.decode_seconds = time.perf_counter() - t1
    return result


def _score_prompt(model, prompt: list[int], state, chunk: int, k: int,
                  out: list[TokenLogprob]) -> torch.Tensor:
    """The prompt forwards of a plain prompt (the same chunks, so the same state), each prompt token after the
    first scored with its logprob and the top k given the tokens before it (into out), from the final norm
    and LM head over slices of at most PROMPT_LOGPROBS_ROWS rows of the trunk's output. Returns the last
    row's logits [1, V] from that row alone, as a last_only forward computes them (the first token's bits
    unchanged)."""
    for start in range(0, len(prompt), chunk):
        ids = prompt[start : start + chunk]
        if len(ids) == 1:  # a one-token chunk (the prompt's last): the decode's path, as without scoring
            logits = model.forward(ids, state, last_only=True)
            continue
        h = model.trunk(ids, state)  # [t, E]
        following = prompt[start + 1 : start + 1 + len(ids)]  # the token each row predicts (none for the end)
        for row in range(0, len(following), PROMPT_LOGPROBS_ROWS):
            rows = following[row : row + PROMPT_LOGPROBS_ROWS]
            with one_torch_thread():  # as _record_logprobs: beside the CPU team's spinning members
                lp = torch.log_softmax(model.head(h[row : row + len(rows)]).float(), dim=-1)  # [n, V]
                top = torch.topk(lp, min(k, lp.shape[1]))
                chosen = lp.gather(1, torch.tensor(rows, device=lp.device)[:, None])[:, 0]
            top_ids, top_values = top.indices.cpu().tolist(), top.values.cpu().tolist()
            scored = zip(chosen.cpu().tolist(), top_ids, top_values, strict=True)
            out.extend(TokenLogprob(c, tuple(zip(i, v, strict=True))) for c, i, v in scored)
            del lp
        logits = model.head(h[-1:])
    return logits


def _emit(on_token: Callable | None, tok: int, entry: TokenLogprob | None) -> None:
    if on_token is None:
        return
    if entry is None:
        on_token(tok)
    else:
        on_token(tok, logprob=entry)


def _record_logprobs(result: GenerationResult, logits: torch.Tensor, tok: int, k: int) -> TokenLogprob:
    """The top k (id, logprob) pairs of logits [V] (f32) and tok's logprob, into result: computed on the host,
    so both decode loops give the same values from the same logits, on one thread: on CUDA the CPU team's
    members compute the next token's rows meanwhile (chained) or spin between tokens on every core but one,
    and a parallel region of torch's beside them would oversubscribe the cores. ~0.4 ms at V = 151,936 on
    the 2-core VM."""
    entry = _logprob_entry(logits, tok, k)
    result.top_logprobs.append(list(entry.top))
    result.token_logprobs.append(entry.logprob)
    return entry


def _logprob_entry(logits: torch.Tensor, tok: int, k: int) -> TokenLogprob:
    """tok's logprob and the top k (id, logprob) pairs of logits [V] (f32), on the host (_record_logprobs)."""
    with one_torch_thread():
        lp = torch.log_softmax(logits.cpu(), dim=-1)
        top = torch.topk(lp, min(k, lp.shape[0]))
    return TokenLogprob(float(lp[tok]), tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)))


def _generate_chained(graphs, first: int, last: torch.Tensor, state, context: int, max_tokens: int,
                      stops: set[int], on_token: Callable[[int], None] | None, result: GenerationResult,
                      choose: Callable | None, logprobs: int = 0) -> None:
    """generate()'s loop over chained decode graphs (DecodeGraphs.chain), greedy or drawing with `choose`
    (a Sampler's choose_into): the same tokens, stops and limits; the token launched ahead of a stop is
    dropped (the state is not reused). first was chosen from last [V] (the prompt's logits); with logprobs,
    each later token's logits come out of the chain beside it."""
    tok, logits = first, last
    chain = decode_chain(graphs, tok, state, min(max_tokens - 1, context - state.pos), choose,
                         logits=logprobs > 0)
    try:
        while True:
            if tok in stops:
                result.finish_reason = "stop"
                result.stop = (tok, _logprob_entry(logits, tok, logprobs) if logprobs > 0 else None)
                return
            entry = _record_logprobs(result, logits, tok, logprobs) if logprobs > 0 else None
            result.token_ids.append(tok)
            _emit(on_token, tok, entry)
            if len(result.token_ids) == max_tokens:
                return
            nxt = next(chain, None)
            if nxt is None:  # the context is full
                return
            tok, logits = nxt if logprobs > 0 else (nxt, None)
    finally:
        chain.close()
