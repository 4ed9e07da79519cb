"""Engine: one loaded model plus the generation loop, as a plain class.

The primary actor is a thin shell over this class, and tests use it without Ray. `stream()` turns the
token-by-token `generate()` into batches of tokens, flushed every ~20 ms, so a remote caller gets a few
messages per second instead of one per token.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from strata_ray.config import ConfigError, EngineConfig, check_peer_device_visible
from strata_ray.engine.context_room import prompt_fits, too_long
from strata_ray.engine.progress import LoadProgress, local_progress
from strata_ray.engine.rates import TokenRates
from strata_ray.engine.sampling import SamplingParams
from strata_ray.experts.profile import ProfileError

FLUSH_SECONDS = 0.02
log = logging.getLogger("strata_ray.engine")


class FeatureNotAvailable(ConfigError):
    """A flag whose engine part has not landed yet; one line."""


class RequestError(ValueError):
    """A generation request this model cannot run (empty prompt, bad token id, too long); one line."""


class GenerationStopped(Exception):
    """Raised from the token callback to end a generation early (stop() or a closed stream)."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None  # text, tokenized by the engine (special tokens such as <|im_start|> parsed)
    prompt_ids: tuple[int, ...] | None = None  # token ids used as given (no BOS added)
    chat: bool = False  # wrap `prompt` as one user message in the model's chat template
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int = 0  # top-K log-probabilities per generated token
    prompt_logprobs: int = 0  # top-K log-probabilities of each prompt token after the first (an echo's)


@dataclass(frozen=True)
class TokenBatch:
    """Tokens produced since the last batch and the text they complete (UTF-8 safe)."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class GenerationSummary(TokenRates):
    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    prompt_seconds: float
    decode_seconds: float
    top_logprobs: list | None = None
    token_logprobs: list | None = None  # each generated token's own logprob (request.logprobs)
    finish_reason: str = "length"  # "stop": a stop id ended it; "length": max_tokens or the context
    stop: tuple | None = None  # (the stop id that ended it, its generate.TokenLogprob with logprobs, or None)
    prompt_logprobs: list | None = None  # generate.TokenLogprob per prompt token after the first, when asked
    experts: str | None = None  # the expert tiers' line of this request (hit rates, CPU entries, ms/token)
    expert_stats: dict | None = None  # the tiers' counters of this request (TierMetrics.summary(since))
    warnings: tuple[str, ...] = ()  # what the request asked and could not do, a line each (a profile save)
    seed: int | None = None  # the sampled draws' seed, the request's or one drawn for it; None: greedy


    def summary_line(self) -> str:
        line = (
            f"prompt: {self.prompt_tokens} tokens, {self.prompt_tokens_per_second:.1f} tok/s | "
            f"generated: {len(self.token_ids)} tokens, {self.decode_tokens_per_second:.1f} tok/s"
        )
        return line if self.experts is None else f"{line} | {self.experts}"


def unavailable_feature(cfg: EngineConfig) -> str | None:
    """The first flag in cfg whose engine part has not landed yet, or None. Shrinks as the tiers land."""
    checks = [
        ("--peer-device", cfg.peer_active),
        ("--layer-split", cfg.layer_split is not None),
        ("--expert-cache-device1..3", any(h is not None for h in cfg.helper_caches)),
        ("--spec", cfg.spec > 0),
    ]
    return next((flag for flag, used in checks if used), None)


def check_supported(cfg: EngineConfig) -> None:
    flag = unavailable_feature(cfg)
    if flag is not None:
        raise FeatureNotAvailable(f"{flag} is not available yet")


def text_prompt_ids(tokenizer, fields, text: str, chat: bool) -> list[int]:
    """The ids a text prompt runs: wrapped in the chat template where asked, after a BOS where the GGUF's
    tokenizer.ggml.add_bos_token says. One function for the engine and `run`'s early check, so both count
    the same tokens."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text, add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)))


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible here (use --device cpu)")
    return device


class Engine:
    def __init__(self, config: EngineConfig, progress: LoadProgress | bool | None = None):
        """progress: a LoadProgress to report the load to (the primary actor; its driver draws the bars),
        None for bars drawn here when stderr is a terminal, False for none."""
        import torch

        from strata_ray.experts.build import load_tiered_model

        self.config = config
        self.device = resolve_device(config.device)
        if config.peer_active:
            check_peer_device_visible(config, torch.cuda.device_count())
        check_supported(config)
        reporter, bars = local_progress(progress)
        try:  # block-quantized experts: dense weights without them + the expert tiers (contract kernels)
            self.loaded, self.tiers = load_tiered_model(config, self.device, progress=reporter)
        finally:
            if reporter is not None:
                reporter.finish()
            if bars is not None:
                bars.close()
        self.tokenizer = self.loaded.tokenizer
        self._stop = threading.Event()

    def info(self) -> dict[str, Any]:
        hp = self.loaded.hp
        return {
            "path": str(self.loaded.path),
            "arch": hp.arch,
            "n_layer": hp.n_layer,
            "n_expert": hp.n_expert,
            "n_expert_used": hp.n_expert_used,
            "n_vocab": hp.n_vocab,
            "has_mtp": hp.has_mtp,
            "device": self.device,
            "expert_cache": self._fill_line(),
            # why the host store stopped page-locking (the OS refused), or None: the driver says it
            "pin_error": self.tiers.store.pin_error if self.tiers is not None else None,
        }

    def _fill_line(self) -> str | None:
        """The cache's 'pre-filled N of S slots ...' line (and the PCIe share picked from the host's memory
        rate, where one was); None without tiers or cache slots."""
        has_slots = self.tiers is not None and self.tiers.cache.n_slots > 0
        if not has_slots:
            return None
        line = self.tiers.cache.fill_line
        if self.tiers.host_gbs is not None:
            line += (f"; the GPU reads {self.tiers.pcie_share / 10:g}% of the decode's misses over PCIe "
                     f"(host memory {self.tiers.host_gbs:.0f} GB/s)")
        return line

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        n_vocab = self.loaded.hp.n_vocab
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            bad = next((i for i in ids if not 0 <= i < n_vocab), None)
            if bad is not None:
                raise RequestError(f"prompt token id {bad} is out of range (vocabulary of {n_vocab} tokens)")
        else:
            ids = text_prompt_ids(self.tokenizer, self.loaded.file.fields, request.prompt or "", request.chat)
        if not ids:
            raise RequestError("the prompt is empty")
        context = self.loaded.hp.context_length
        if not prompt_fits(len(ids), context, request.max_tokens):
            raise RequestError(too_long(len(ids), context))
        return ids

    def generate(self, request: GenerationRequest, on_token: Callable[[int], None] | None = None,
                 on_prompt: Callable[[list], None] | None = None):
        """Run one request to the end; returns a GenerationSummary. on_token(id) sees every new token; with
        request.logprobs, as on_token(id, logprob) (a generate.TokenLogprob), so such a callback must take
        two arguments. on_prompt(entries) gets request.prompt_logprobs' scores before the first token."""
        from strata_ray.engine.generate import generate
        from strata_ray.engine.prefill import prefill_chunk

        ids = self.prompt_ids(request)
        max_tokens = min(request.max_tokens, self.loaded.hp.context_length - len(ids))
        kwargs = {"prefill_chunk": prefill_chunk(self.config, self.device)}
        self._stop.clear()
        # the tiers outlive the request (kept actors, a server): its summary counts from here
        counts_before = self.tiers.metrics.snapshot() if self.tiers is not None else None

        def on_each(token_id, logprob=None):
            if self._stop.is_set():
                raise GenerationStopped()
            if on_token is None:
                return
            if logprob is None:
                on_token(int(token_id))
            else:
                on_token(int(token_id), logprob)

        result = generate(
            self.loaded.model,
            ids,
            max_tokens,
            request.sampling,
            self.tokenizer.stop_ids,
            on_token=on_each,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            on_prompt=on_prompt,
            **kwargs,
        )
        token_ids = tuple(int(t) for t in result.token_ids)
        experts = expert_stats = None
        warnings: tuple[str, ...] = ()
        if self.tiers is not None:
            self.tiers.finish()
            if self.config.expert_profile_save is not None:
                try:  # atomic; after every request
                    self.tiers.save_profile(self.config.expert_profile_save)
                except ProfileError as e:  # a full disk, a folder gone: the request's tokens are not lost
                    log.warning("%s", e)
                    warnings = (f"--expert-profile-save: {e}",)
            experts = self.tiers.summary_line(since=counts_before)
            expert_stats = self.tiers.metrics.summary(since=counts_before)
        return GenerationSummary(
            token_ids=token_ids,
            text=self.text_of(token_ids),
            prompt_tokens=result.prompt_tokens,
            prompt_seconds=result.prompt_seconds,
            decode_seconds=result.decode_seconds,
            top_logprobs=result.top_logprobs if request.logprobs else None,
            token_logprobs=result.token_logprobs if request.logprobs else None,
            finish_reason=result.finish_reason,
            stop=result.stop,
            prompt_logprobs=result.prompt_logprobs if request.prompt_logprobs else None,
            experts=experts,
            expert_stats=expert_stats,
            warnings=warnings,
            seed=result.seed,
        )

    def text_of(self, token_ids) -> str:
        stop = self.tokenizer.stop_ids
        return self.tokenizer.decode([t for t in token_ids if t not in stop])

    def stop(self) -> None:
        """Ask the running generation to end after its current token (safe from another thread)."""
        self._stop.set()

    def stream(self, request: GenerationRequest, flush_seconds: float = FLUSH_SECONDS) -> Iterator:
        """Yield TokenBatch items as tokens arrive (the first token alone at once, then every flush_seconds at
        most), then one GenerationSummary.

        The generation runs in a worker thread; closing this iterator early stops it."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        outcome: list = []

        def work():
            try:
                outcome.append(self.generate(request, on_token=lambda token_id, *_: events.put(token_id)))
            except BaseException as e:  # handed to the consumer below, re-raised there
                outcome.append(e)
            events.put(None)

        worker = threading.Thread(target=work, name="strata-generate", daemon=True)
        decoder = self.tokenizer.stream_decoder()
        stop_ids = self.tokenizer.stop_ids
        pending: list[int] = []
        first_sent = False
        worker.start()
        try:
            deadline = None
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    item = events.get(timeout=timeout)
                except queue.Empty:
                    item = "flush"
                if isinstance(item, int):
                    pending.append(item)
                    if first_sent:
                        deadline = deadline or time.monotonic() + flush_seconds
                        continue
                    # the first token goes at once: a caller's time to the first token (a bench's prefill
                    # rate through Ray) waited up to flush_seconds more, and a short decode had no interval
                    item, first_sent = "flush", True
                if pending:
                    text = "".join(decoder.push(t) for t in pending if t not in stop_ids)
                    yield TokenBatch(tuple(pending), text)
                    pending, deadline = [], None
                if item is None:
                    break
            if isinstance(outcome[0], BaseException):
                raise outcome[0]
            yield outcome[0]
        finally:
            self._stop.set()
            worker.join()


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
