"""EngineRunner in process (no Ray): arrival order, and an engine failure that the runner survives."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from strata_ray.config import EngineConfig
from strata_ray.serve.openai_api import APIError, Sampling
from strata_ray.serve.runner import EngineRunner, Finished
from strata_ray.serve.status import ServeMetrics

GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def runner(model_path):
    r = EngineRunner(EngineConfig(model=str(model_path), device="cpu"), ServeMetrics())
    assert r.wait_loaded_blocking(120) and r.loaded, r.load_error
    return r


async def collect(runner, name: str, prompt_ids, max_tokens=3, stop=()):
    rec = runner.metrics.enqueue(name, "test")
    events = runner.stream(rec, prompt_ids, max_tokens, GREEDY, stop)
    pieces = []
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Finished):
                return "".join(pieces), event
            pieces.append(event)


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
