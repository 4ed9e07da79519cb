"""Generated token ids -> the text a client sees, with OpenAI `stop` strings.

Text that might be the start of a stop string is held back until it is clearly not one, so a client never
receives part of a stop string. End-of-turn tokens (the tokenizer's stop ids) produce no text, as in
`Engine.text_of`.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._decoder = tokenizer.stream_decoder()
        self._stop_ids = tokenizer.stop_ids
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded text not yet handed out (may begin a stop string)
        self.stopped = False  # a stop string was found; nothing more is emitted
        self.text = ""  # everything emitted so far

    def push(self, token_id: int) -> str:
        """The text that token_id makes safe to emit (often "")."""
        if self.stopped or token_id in self._stop_ids:
            return ""
        return self._emit(self._held + self._decoder.push(token_id), final=False)

    def finish(self) -> str:
        """End of generation: whatever is still held (an unfinished UTF-8 character becomes U+FFFD)."""
        if self.stopped:
            return ""
        return self._emit(self._held + self._decoder.flush(), final=True)

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
