"""Generated token ids -> the text a client sees, with OpenAI `stop` strings.

Text that might be the start of a stop string is held back until it is clearly not one, so a client never
receives part of a stop string. End-of-turn tokens (the tokenizer's stop ids) produce no text, as in
`Engine.text_of`.

A request for logprobs hands each token's log-probabilities in beside it; they come back out (`take_tokens`)
with the text they belong to: a token is released once text from its first character on has been sent, so a
token held back with a possible stop string waits with its text. At a stop string, the tokens that begin
before the cut are listed (the one the cut falls in included, so its bytes can run past the text sent, as
vLLM lists the token that completes a stop) and those after it are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EmittedToken:
    """A sent token with its log-probabilities (a request for logprobs)."""

    token_id: int
    offset: int  # where its text starts in the completion's text (characters); its text may be empty
    logprob: float | None  # None: an echoed prompt's first token (nothing before it to predict it)
    top: tuple[tuple[int, float], ...]  # the top K (id, logprob), best first


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._decoder = tokenizer.stream_decoder()
        self._stop_ids = tokenizer.stop_ids
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded text not yet handed out (may begin a stop string)
        self._decoded = 0  # characters decoded so far: sent, held and cut
        self._tokens: list[EmittedToken] = []  # tokens with logprobs not yet taken
        self._final = False
        self.stopped = False  # a stop string was found; nothing more is emitted
        self.text = ""  # everything emitted so far

    def push(self, token_id: int, logprob=None) -> str:
        """The text that token_id makes safe to emit (often ""). logprob: its generate.TokenLogprob, kept
        for take_tokens."""
        if self.stopped or token_id in self._stop_ids:
            return ""
        decoded = self._decoder.push(token_id)
        if logprob is not None:
            self._tokens.append(EmittedToken(token_id, self._decoded, logprob.logprob, tuple(logprob.top)))
        self._decoded += len(decoded)
        return self._emit(self._held + decoded, final=False)

    def finish(self) -> str:
        """End of generation: whatever is still held (an unfinished UTF-8 character becomes U+FFFD)."""
        if self.stopped:
            return ""
        self._final = True
        return self._emit(self._held + self._decoder.flush(), final=True)

    def take_tokens(self) -> list[EmittedToken]:
        """The tokens pushed with logprobs whose text has started to be sent (all of them after finish()
        without a stop string), in order, each once. After a stop string, those that begin after the cut
        never are."""
        sent = len(self.text)
        n = len(self._tokens) if self._final else next(
            (i for i, t in enumerate(self._tokens) if t.offset >= sent), len(self._tokens))
        out, self._tokens = self._tokens[:n], self._tokens[n:]
        return out

    def _emit(self, buffer: str, final: bool) -> str:
        hit = min((i for i in (buffer.find(s) for s in self._stop) if i >= 0), default=-1)
        if hit >= 0:
            self.stopped = True
            out, self._held = buffer[:hit], ""
        else:
            keep = 0 if final else _held_suffix(buffer, self._stop)
            out, self._held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        self.text += out
        return out


def _held_suffix(buffer: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of buffer that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(buffer)), best, -1):
            if buffer.endswith(s[:n]):
                best = n
                break
    return best
