"""Whether a prompt fits the model's context, and the one line that says it does not (the engine, the
server and `run`'s early check all ask here, so they agree)."""

from __future__ import annotations


def prompt_fits(tokens: int, context: int, max_tokens: int | None) -> bool:
    """A prompt of `tokens` in a context of `context`: each token it makes needs a row of the context, so a
    prompt as long as the context fits only a request that makes none (max_tokens 0: the prompt scored, as
    evaluation harnesses ask with echo); None (until the context is full) needs one row."""
    return tokens < context or (tokens == context and max_tokens == 0)


def too_long(tokens: int | str, context: int) -> str:
    """The one line for a prompt that leaves no room in the context."""
    return f"the prompt has {tokens} tokens; the model's context is {context} tokens"
