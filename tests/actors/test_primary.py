"""Primary in process (the class the actor runs): one generation at a time, and a stop that names its run."""

from __future__ import annotations

import pytest

from strata_ray.actors.launch import PRIMARY_NAME, describe_failure
from strata_ray.actors.primary import BUSY, EngineBusy, Primary
from strata_ray.config import EngineConfig
from strata_ray.engine.engine import GenerationRequest, GenerationStopped, GenerationSummary

LONG = GenerationRequest(prompt="The Python standard library", max_tokens=120)  # greedy: no end before 120


def test_a_busy_primary_refuses_as_the_users_line_and_stops_only_its_owners_generation():
    """A second run on a kept engine: EngineBusy, exit 2 with the line to wait (it was "strata:primary
    failed", exit 1). A stop naming another run leaves the generation alone (a run whose own generation was
    refused, then Ctrl-C'd, stopped the other run's); the owner's stop ends it."""
    primary = Primary(EngineConfig(device="cpu"))
    primary.load()
    held = primary.generate_stream(LONG, owner="a")
    next(held)  # the generation holds the engine while its stream is suspended
    assert primary.busy()
    with pytest.raises(EngineBusy) as info:
        next(primary.generate_stream(GenerationRequest(prompt_ids=(1,), max_tokens=2), owner="b"))
    assert describe_failure(info.value, PRIMARY_NAME) == (BUSY, 2)
    primary.stop("b")
    summary = list(held)[-1]
    assert isinstance(summary, GenerationSummary) and len(summary.token_ids) == LONG.max_tokens
    assert not primary.busy()

    held = primary.generate_stream(LONG, owner="a")
    next(held)
    primary.stop("a")
    with pytest.raises(GenerationStopped):
        list(held)
    assert not primary.busy()
