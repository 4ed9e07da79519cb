"""context_room: which prompts fit the context, as the engine, the server and `run` count them."""

from __future__ import annotations

import pytest

from strata_ray.engine.context_room import prompt_fits, too_long


@pytest.mark.parametrize("tokens, max_tokens, fits", [
    (99, 1, True), (99, None, True), (99, 0, True),
    (100, 0, True),  # the whole context scored, nothing made (echo with max_tokens 0)
    (100, 1, False), (100, None, False), (101, 0, False), (5000, 0, False),
])
def test_a_prompt_fits_with_a_row_for_each_token_it_makes(tokens, max_tokens, fits):
    assert prompt_fits(tokens, 100, max_tokens) is fits


def test_the_line_names_both_counts():
    assert too_long(5000, 4096) == "the prompt has 5000 tokens; the model's context is 4096 tokens"
    line = "the prompt has at least 12 tokens; the model's context is 10 tokens"
    assert too_long("at least 12", 10) == line
