"""The engine inside a server replica: loaded in the background, one generation at a time, in arrival order.

Requests wait on an asyncio.Lock, which wakes waiters first come, first served. The engine runs on one
dedicated thread so the replica's event loop keeps answering /health and /metrics while it generates.
Tokens cross to the loop through an asyncio.Queue (with their log-probabilities, for a request that asks).
A request whose consumer goes away (client disconnect, stop string) stops its generation at the next token,
and the engine is free for the next request as soon as that token is done. `drain` is the server's stop:
requests from then on are refused, those taken get a grace time, then the running one ends with a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from strata_ray.actors.launch import first_line
from strata_ray.config import EngineConfig
from strata_ray.serve import status
from strata_ray.serve.openai_api import APIError, Sampling, server_error, shutting_down
from strata_ray.serve.text_stream import EmittedToken, TextStream


@dataclass(frozen=True)
class Piece:
    """Text to send, and the tokens it completes with their logprobs (a request that asks for them)."""

    text: str
    tokens: tuple[EmittedToken, ...] = ()


@dataclass(frozen=True)
class PromptScores:
    """The prompt tokens' logprobs (a generate.TokenLogprob each, tokens 1..), from the engine thread."""

    scores: tuple


def prompt_text(tokenizer, ids: Sequence[int], skip: int = 0) -> tuple[str, list[int]]:
    """An echoed prompt: its text and where each token's text starts in it (a token that ends inside a
    character starts where that character does); the first `skip` tokens (a BOS the server put before a text
    prompt) add no text and start at 0."""
    decoder = tokenizer.stream_decoder()
    offsets, parts, n = [], [], 0
    for j, i in enumerate(ids):
        offsets.append(n)
        if j < skip:
            continue
        parts.append(decoder.push(i))
        n += len(parts[-1])
    parts.append(decoder.flush())
    return "".join(parts), offsets


def _shifted(tokens: list[EmittedToken], shift: int) -> tuple[EmittedToken, ...]:
    return tuple(dataclasses.replace(t, offset=t.offset + shift) for t in tokens) if shift else tuple(tokens)


FINGERPRINT_BYTES = 5  # "fp_" and 10 hex digits, as OpenAI's look


def system_fingerprint(config: EngineConfig, file, device: str, environ: Mapping[str, str]) -> str:
    """OpenAI's `system_fingerprint`: "fp_" and a digest of what decides the answers' bits, so that a client
    comparing answers (a seeded draw, an exactness gate) sees the backend change under it. It hashes the
    package's version; the model file (the GGUFFile `file`): its path, each shard's size, its hparams and
    tensor types (a Q4_0 and a Q4_K file of one model have one size) and its routing digest (a fine-tune
    put at the same path and size has other routers); the device kind; the prompt chunk and MTP drafts;
    and every STRATA_* switch `environ` sets. Most switches keep the bits (README), but a fingerprint that
    changes needlessly costs a client a re-check, one that stays while the bits change a silent difference.
    The replicas of one server share the config, the file and the environment: one fingerprint."""
    from strata_ray import __version__
    from strata_ray.config import ENGINE_FLAGS, INTERNAL_ENV, env_name, known_env_names
    from strata_ray.model.routing_digest import routing_digest

    h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
    h.update(f"strata-ray {__version__}|{file.path}|{device}|{config.prefill}|{config.spec}|".encode())
    h.update(f"{[os.path.getsize(p) for p in file.paths]}|{file.hparams!r}|".encode())
    h.update("".join(f"{t.name}:{t.ggml_type};" for t in file.tensors.values()).encode())
    h.update(routing_digest(file))
    # the engine flags are in the config above (those that may move bits) or only place the work
    switches = known_env_names() - {env_name(name) for name in ENGINE_FLAGS} - set(INTERNAL_ENV)
    h.update("".join(f"|{k}={environ[k]}" for k in sorted(switches) if environ.get(k, "") != "").encode())
    return "fp_" + h.hexdigest()


@dataclass(frozen=True)
class Finished:
    """The last event of a generation."""

    finish_reason: str  # "stop" (end of turn or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    timings: dict


class EngineRunner:
    def __init__(self, config: EngineConfig, metrics: status.ServeMetrics):
        self.config = config
        self.metrics = metrics
        self.engine = None
        self.info: dict = {}
        self.fingerprint: str | None = None  # system_fingerprint, once loaded
        self.load_error: str | None = None
        self.tier_totals: dict[str, dict[str, float]] = {}
        self._loaded = threading.Event()
        self._lock = asyncio.Lock()
        self.draining = False  # told to stop: new requests are refused
        self._stopped = False  # the drain's grace is over: the running one ends, the queued are refused
        self._cancel: threading.Event | None = None  # the running generation's
        self._arriving = 0  # requests past check_open not yet queued (waiting for the load, tokenizing)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-engine")
        self._executor.submit(self._load)

    # --- loading ------------------------------------------------------------------------------------------

    def _load(self) -> None:
        from strata_ray.actors.primary import use_all_cores
        from strata_ray.engine.engine import Engine

        try:
            if self.config.device != "cuda":
                use_all_cores()
            engine = Engine(self.config)
            # before the engine is published: no answer goes out without it
            self.fingerprint = system_fingerprint(self.config, engine.loaded.file, engine.device, os.environ)
            self.engine = engine
            self.info = self.engine.info()
            hp = self.engine.loaded.hp
            self.tier_totals = status.tier_counters(self.engine) or {
                self.engine.device: {"experts": hp.n_layer * hp.n_expert, "hits": 0, "lookups": 0,
                                     "hit_rate": 0.0}}
            self.metrics.state = "idle"
        except Exception as e:  # reported by /health and every request; the replica stays up to say so
            self.load_error = f"{type(e).__name__}: {first_line(e)}"
            self.metrics.state = "failed"
        finally:
            self._loaded.set()

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    def wait_loaded_blocking(self, timeout: float | None = None) -> bool:
        return self._loaded.wait(timeout)

    async def wait_loaded(self) -> None:
        while not self._loaded.is_set():
            await asyncio.sleep(0.05)
        if self.engine is None:
            raise APIError(503, f"the model failed to load ({self.load_error})", "server_error", None,
                           "model_not_loaded")

    @property
    def context(self) -> int:
        return self.engine.loaded.hp.context_length if self.engine else 0

    @property
    def add_bos(self) -> bool:
        return bool(self.engine.loaded.file.fields.get("tokenizer.ggml.add_bos_token", False))

    # --- stopping -----------------------------------------------------------------------------------------

    def drain(self, grace_s: float) -> None:
        """The server is stopping: requests from now on are refused (check_open); those already taken, queued
        or running, get grace_s seconds, then the running one ends with a 503 (in a stream: an error event and
        [DONE], not a cut connection) and the queued ones get it too. On the event loop; a second call keeps
        the first one's deadline."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(grace_s, self._stop_now)

    def _stop_now(self) -> None:
        self._stopped = True
        if self._cancel is not None and not self._cancel.is_set():
            self._cancel.set()
            self.engine.stop()

    def check_open(self) -> None:
        """Raises the 503 once the server is stopping."""
        if self.draining:
            raise shutting_down()

    @contextlib.contextmanager
    def taking(self):
        """A request from its check_open until metrics.enqueue queues it (the model's load, the prompt's
        tokens: seconds for a long one), so that a drain waits for it as for the queued ones."""
        self.check_open()
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1

    @property
    def busy(self) -> bool:
        """Whether a request is taken and not answered yet (arriving, queued, or holding the engine)."""
        return self._arriving > 0 or self.metrics.queued > 0 or self._lock.locked()

    # --- generation ---------------------------------------------------------------------------------------

    async def stream(self, rec: status.RequestRecord, prompt_ids: Sequence[int], max_tokens: int,
                     sampling: Sampling, stop: Sequence[str], logprobs: int = 0,
                     echo: bool = False, added_bos: bool = False) -> AsyncIterator[Piece | Finished]:
        """Yields Pieces, then one Finished. Closing it (aclose) cancels; callers must close it. rec must come
        from metrics.enqueue (it counts as queued until the engine takes it). logprobs > 0: each piece's
        tokens carry their top-`logprobs` log-probabilities. echo: the first piece is the prompt's text (with
        logprobs, its tokens scored, the first one without a logprob), and the later offsets count it;
        added_bos: the first prompt token is a BOS the server put before the request's text, whose echo
        leaves it out of the text (as vLLM's: the prompt as sent), still listed first among the scores."""
        from strata_ray.engine.engine import GenerationRequest
        from strata_ray.engine.sampling import SamplingParams

        started = False
        try:
            async with self._lock:
                if self._stopped:  # queued past the drain's grace: refused, listed as cancelled
                    raise shutting_down()
                started = True
                try:
                    params = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k,
                                            top_p=sampling.top_p, min_p=sampling.min_p, seed=sampling.seed)
                except ValueError as e:  # SamplingError: ranges the API check let through
                    raise APIError(400, first_line(e), code="invalid_value") from None
                request = GenerationRequest(prompt_ids=tuple(prompt_ids), max_tokens=max_tokens,
                                            sampling=params, logprobs=logprobs,
                                            prompt_logprobs=logprobs if echo else 0)
                self.metrics.begin(rec, len(prompt_ids), max_tokens)
                async for event in self._generate(rec, request, stop, echo, added_bos):
                    yield event
        finally:
            if not started:
                self.metrics.dequeue_unstarted(rec)

    async def _generate(self, rec, request, stop: Sequence[str], echo: bool,
                        added_bos: bool = False) -> AsyncIterator[Piece | Finished]:
        from strata_ray.engine.engine import GenerationStopped, RequestError

        engine = self.engine
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()  # per request: engine.stop() alone could race with the next request
        self._cancel = cancel  # the drain's stop ends it too

        def on_token(token_id: int, logprob=None) -> None:  # on the engine thread
            if cancel.is_set():
                raise GenerationStopped()
            loop.call_soon_threadsafe(tokens.put_nowait, (token_id, logprob))

        def on_prompt(scores) -> None:  # on the engine thread: the prompt's logprobs, before the first token
            loop.call_soon_threadsafe(tokens.put_nowait, PromptScores(tuple(scores)))

        before = status.tier_counters(engine)
        job = loop.run_in_executor(self._executor, engine.generate, request, on_token, on_prompt)
        job.add_done_callback(lambda _: tokens.put_nowait(None))
        text = TextStream(engine.tokenizer, stop)
        echoed, offsets = (prompt_text(engine.tokenizer, request.prompt_ids, skip=int(added_bos)) if echo
                           else ("", []))
        shift = len(echoed)  # the generated text's offsets count the echoed prompt before it
        finish, error = "cancelled", None
        try:
            if echoed and not request.prompt_logprobs:
                yield Piece(echoed)
            while (event := await tokens.get()) is not None:
                if isinstance(event, PromptScores):
                    ids = request.prompt_ids
                    scored = [EmittedToken(ids[0], 0, None, ())] + [
                        EmittedToken(i, o, e.logprob, tuple(e.top))
                        for i, o, e in zip(ids[1:], offsets[1:], event.scores, strict=True)]
                    yield Piece(echoed, tuple(scored))
                    continue
                if text.stopped:  # made before the engine saw the stop: not the answer's, nor counted (a
                    continue      # slow stream's reader let more of them in: usage varied run to run)
                self.metrics.token(rec)
                piece = Piece(text.push(*event), _shifted(text.take_tokens(), shift))
                if piece.text or piece.tokens:
                    yield piece
                if text.stopped and not cancel.is_set():
                    cancel.set()  # a stop string: end the generation, keep what was said before it
                    engine.stop()
            summary = None
            try:
                summary = job.result()
                rec.prompt_ms, rec.decode_ms = 1000 * summary.prompt_seconds, 1000 * summary.decode_seconds
            except GenerationStopped:
                if cancel.is_set() and self._stopped and not text.stopped:  # the drain's, not a stop string's
                    raise shutting_down("the server stopped before this generation finished") from None
            except RequestError as e:
                finish, error = "error", str(e)
                raise APIError(400, first_line(e), param="messages", code="invalid_prompt") from None
            except Exception as e:
                finish, error = "error", f"{type(e).__name__}: {first_line(e)}"
                raise server_error(f"the engine failed: {error}") from None
            tail = Piece(text.finish(), _shifted(text.take_tokens(), shift))
            if tail.text or tail.tokens:
                yield tail
            listed = summary is not None and echo and request.logprobs and not text.stopped
            end = summary.stop if listed else None
            if end is not None and end[1] is not None:  # an echo's stop id listed last, as vLLM lists it:
                # evaluation harnesses read token_logprobs[prompt:-1], one generated entry assumed at the end
                yield Piece("", (EmittedToken(end[0], shift + len(text.text), end[1].logprob, end[1].top),))
            length = not text.stopped and rec.generated >= request.max_tokens
            finish = "length" if length else "stop"
            yield Finished(finish, len(request.prompt_ids), rec.generated, rec.timings())
        finally:
            if self._cancel is cancel:
                self._cancel = None
            if job.done():
                self._finish(rec, finish, error, before)
            else:  # the consumer left (disconnect): the engine stops at its next token
                cancel.set()
                engine.stop()
                # No await here: Serve may cancel this task again while it cleans up. The next request may
                # take the lock now; its work queues behind this one's last token on the engine thread.
                job.add_done_callback(lambda _: self._finish(rec, finish, error, before))

    def _finish(self, rec, finish: str, error: str | None, before) -> None:
        after = status.tier_counters(self.engine)
        if before is not None and after is not None:
            tiers = status.tier_delta(before, after)
        else:
            tiers = status.reference_tiers(self.engine, rec.prompt_tokens + rec.generated)
        status.add_tiers(self.tier_totals, tiers)
        self.metrics.end(rec, finish, error, tiers)
