"""Timing generations the way a user sees them, and the benchmark plan (contexts x repeats, then the story).

A runner sends one prompt and times the tokens as they reach the caller:
- prefill tok/s = prompt tokens / time to the first token (request sent -> first token seen);
- decode tok/s = tokens that arrived after the first ones / (last arrival - first arrival), or not
  measurable (None, with the reason) where the arrivals cannot time a decode: no token after the first, every
  token in one chunk, or the rest within less than any decode takes (one burst: a stream that a proxy or the
  server buffered and sent at once read ~0.2 ms for 15 tokens, 70,000 tok/s).
Three runners share this: `LocalRunner` (the Engine in this process, per-token callbacks), `RayRunner`
(the same `strata:primary` actor `run` uses, token batches streamed through Ray) and `HttpRunner`
(http_client.py, any OpenAI-compatible server). The engine's own timings are kept next to them when the
runner has them, so the cost of the path between engine and caller is visible.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

from strata_ray.bench.prompts import Prompt, PromptBuilder

SHORT_FRACTION = 0.5  # a generation below this share of the requested tokens is flagged "short"
WARMUP_GEN_TOKENS = 8
# A decode span shorter than either of these times no decode: no single stream decodes a token in under
# 50 us (20,000 tok/s), while reading a buffered chunk takes ~10-30 us (a burst); and under 1 ms the clock's
# and the scheduler's jitter are much of the span
MIN_DECODE_SPAN_S = 1e-3
MIN_TOKEN_INTERVAL_S = 50e-6


@dataclass(frozen=True)
class RunTiming:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float  # request sent -> first token seen by the caller
    decode_tokens: int  # tokens seen after the first arrival
    decode_s: float  # first arrival -> last arrival
    total_s: float
    engine_prompt_s: float | None = None  # the engine's own prompt time (None: not reported)
    engine_decode_s: float | None = None
    token_ids: tuple[int, ...] | None = None  # None: the server does not return ids
    text: str = ""
    decode_chunks: int = 0  # arrivals after the first (chunks, token batches or tokens)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_problem(self) -> str | None:
        """Why the arrivals cannot time this run's decode, one line (None: they can)."""
        if self.generated_tokens <= 1:
            return "no token generated" if self.generated_tokens < 1 else "1 token generated: none after it"
        if self.decode_chunks < 1:
            return f"all {self.generated_tokens} tokens arrived in one chunk: no interval to time"
        if self.decode_tokens <= 0:
            return "no token arrived after the first chunk's"
        if self.decode_s < self.decode_tokens * MIN_TOKEN_INTERVAL_S:
            return (f"the {self.decode_tokens} tokens after the first arrived within "
                    f"{1e3 * self.decode_s:.2f} ms of it, in one burst (the stream was buffered on its way: "
                    "no decode is that fast)")
        if self.decode_s < MIN_DECODE_SPAN_S:  # a real but short decode (a token or two on a fast device)
            return (f"the {self.decode_tokens} token(s) after the first took {1e3 * self.decode_s:.2f} ms, "
                    f"under the {1e3 * MIN_DECODE_SPAN_S:.0f} ms a clock can time (generate more tokens)")
        return None

    @property
    def decode_tps(self) -> float | None:
        """tok/s after the first arrival; None where it is not measurable (decode_problem says why)."""
        return None if self.decode_problem else self.decode_tokens / self.decode_s

    def record(self) -> dict:
        """The JSON form of one run (no token ids or text: the gates keep those)."""
        doc = {k: v for k, v in asdict(self).items() if k not in ("token_ids", "text")}
        doc["prefill_tps"] = self.prefill_tps
        doc["decode_tps"] = self.decode_tps
        doc["decode_note"] = self.decode_problem
        return doc


class Runner(Protocol):
    def run(self, prompt: Prompt, max_tokens: int, sampling) -> RunTiming: ...


class ArrivalClock:
    """Arrival times of token chunks: the first, the last, how many tokens came with the first, and how many
    chunks came."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.first_count = 0
        self.count = 0
        self.chunks = 0

    def arrived(self, n_tokens: int) -> None:
        now = time.perf_counter()
        if n_tokens <= 0:
            return
        if self.first is None:
            self.first, self.first_count = now, n_tokens
        self.last = now
        self.count += n_tokens
        self.chunks += 1

    def timing(self, prompt_tokens: int, generated: int | None = None, **extra) -> RunTiming:
        end = time.perf_counter()
        generated = self.count if generated is None else generated
        if self.first is None:  # nothing generated: the whole call was prompt work
            return RunTiming(prompt_tokens, 0, end - self.start, 0, 0.0, end - self.start, **extra)
        first_count = min(self.first_count, generated)
        return RunTiming(
            prompt_tokens=prompt_tokens,
            generated_tokens=generated,
            ttft_s=self.first - self.start,
            decode_tokens=generated - first_count,
            decode_s=self.last - self.first,
            total_s=end - self.start,
            decode_chunks=self.chunks - 1,
            **extra,
        )


def _request(prompt: Prompt, max_tokens: int, sampling):
    from strata_ray.engine.engine import GenerationRequest

    if prompt.ids is None:
        raise ValueError(f"prompt {prompt.name} has no token ids (built without a tokenizer)")
    return GenerationRequest(prompt_ids=prompt.ids, max_tokens=max_tokens, sampling=sampling)


class LocalRunner:
    """The Engine in this process; every token is timed by the engine's callback."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, prompt: Prompt, max_tokens: int, sampling) -> RunTiming:
        clock = ArrivalClock()
        request = _request(prompt, max_tokens, sampling)
        summary = self.engine.generate(request, on_token=lambda _t: clock.arrived(1))
        return _timing(clock, summary)


def _timing(clock: ArrivalClock, summary) -> RunTiming:
    """The caller's arrival times plus the engine's own timings and output from its summary."""
    return clock.timing(
        summary.prompt_tokens,
        len(summary.token_ids),
        engine_prompt_s=summary.prompt_seconds,
        engine_decode_s=summary.decode_seconds,
        token_ids=tuple(summary.token_ids),
        text=summary.text,
    )


class RayRunner:
    """The `strata:primary` actor, streamed through Ray exactly as `run` streams it."""

    def __init__(self, primary):
        self.primary = primary

    def run(self, prompt: Prompt, max_tokens: int, sampling) -> RunTiming:
        import ray

        from strata_ray.engine.engine import GenerationSummary, TokenBatch

        request = _request(prompt, max_tokens, sampling)
        clock = ArrivalClock()
        summary = None
        for ref in self.primary.generate_stream.options(num_returns="streaming").remote(request):
            item = ray.get(ref)
            if isinstance(item, TokenBatch):
                clock.arrived(len(item.token_ids))
            elif isinstance(item, GenerationSummary):
                summary = item
        if summary is None:
            raise RuntimeError("the primary ended the stream without a summary")
        return _timing(clock, summary)


# ---- the plan --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchPlan:
    contexts: tuple[int, ...]  # prompt depths in tokens
    gen_tokens: int  # tokens generated after each context prompt (decode at that depth)
    repeats: int
    story_tokens: int  # 0 = no story
    warmup: bool = True


@dataclass
class ContextResult:
    context: int  # as asked
    prompt_tokens: int  # as sent (after any cut)
    note: str | None
    runs: list[RunTiming] = field(default_factory=list)

    def summary(self, gen_tokens: int) -> dict:
        return {
            "context": self.context,
            "prompt_tokens": self.prompt_tokens,
            "note": self.note,
            "prefill_tps": median([r.prefill_tps for r in self.runs]),
            **decode_summary(self.runs),
            "ttft_s": median([r.ttft_s for r in self.runs]),
            "generated_tokens": median([r.generated_tokens for r in self.runs]),
            "short": any(r.generated_tokens < SHORT_FRACTION * gen_tokens for r in self.runs),
            "runs": [r.record() for r in self.runs],
        }


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def decode_summary(runs: list[RunTiming]) -> dict:
    """decode_tps: the median of the runs whose decode could be timed (None where none could), and
    decode_note: why the others could not (None where every run could)."""
    rates = [r.decode_tps for r in runs if r.decode_tps is not None]
    problems = [r.decode_problem for r in runs if r.decode_problem]
    if not problems:
        note = None
    elif not rates:
        note = f"decode tok/s not measurable: {problems[0]}"
    else:
        note = f"decode tok/s from {len(rates)} of {len(runs)} runs (the others: {problems[0]})"
    return {"decode_tps": median(rates) if rates else None, "decode_note": note}


def run_plan(runner: Runner, builder: PromptBuilder, plan: BenchPlan, sampling,
             progress: Callable[[str], None] | None = None) -> dict:
    """Every context `repeats` times (a fresh random prefix each time), then the story. Returns the
    `results` part of the JSON report. A Ctrl-C (KeyboardInterrupt) after the warm-up returns what was
    measured so far, the context it fell in with its finished runs, and `interrupted: true`."""
    tick = progress or (lambda _label: None)
    if plan.warmup:
        runner.run(builder.story_prompt(), WARMUP_GEN_TOKENS, sampling)  # short: fits any context
        tick("warm-up")
        if plan.contexts:  # the prompt path at the smallest depth too: its first-use compiles (a prompt of
            # 1024+ tokens streams through the ring, which the short story prompt never reaches) are not timed
            prompt = builder.bench_prompt(min(plan.contexts), WARMUP_GEN_TOKENS)
            builder.observe(prompt, runner.run(prompt, WARMUP_GEN_TOKENS, sampling).prompt_tokens)
            tick("warm-up")
    contexts, result = [], None
    try:
        for context in plan.contexts:
            for _ in range(plan.repeats):
                prompt = builder.bench_prompt(context, plan.gen_tokens)
                if result is None:
                    result = ContextResult(context, prompt.n_tokens, prompt.note)
                result.runs.append(runner.run(prompt, plan.gen_tokens, sampling))
                builder.observe(prompt, result.runs[-1].prompt_tokens)  # a foreign tokenizer's true ratio
                tick(f"context {context}")
            contexts.append(result.summary(plan.gen_tokens))
            result = None
        story = _story(runner, builder, plan, sampling, tick)
    except KeyboardInterrupt:  # a long sweep stopped: what it measured is kept, not thrown away
        if result is not None and result.runs:
            contexts.append(result.summary(plan.gen_tokens))
        return {"contexts": contexts, "story": None, "interrupted": True}
    return {"contexts": contexts, "story": story}


def _story(runner: Runner, builder: PromptBuilder, plan: BenchPlan, sampling, tick) -> dict | None:
    if plan.story_tokens <= 0:
        return None
    runs, note, wanted = [], None, plan.story_tokens
    for _ in range(plan.repeats):
        prompt = builder.story_prompt()
        wanted, note = builder.story_tokens(prompt, plan.story_tokens)
        runs.append(runner.run(prompt, wanted, sampling))
        tick("story")
    return {
        "tokens": wanted,
        "note": note,
        **decode_summary(runs),
        "generated_tokens": median([r.generated_tokens for r in runs]),
        "short": any(r.generated_tokens < SHORT_FRACTION * wanted for r in runs),
        "runs": [r.record() for r in runs],
    }


def plan_steps(plan: BenchPlan) -> int:
    """How many runs run_plan makes (for a progress bar)."""
    story = plan.repeats if plan.story_tokens > 0 else 0
    warmup = (1 + bool(plan.contexts)) if plan.warmup else 0
    return warmup + len(plan.contexts) * plan.repeats + story
