"""Token rates of a finished generation (torch-free, so the driver can import it before torch)."""


class TokenRates:
    """tok/s of a finished generation, for any result with prompt_tokens, prompt_seconds, token_ids and
    decode_seconds (GenerationResult and the engine's GenerationSummary)."""

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_forwards(self) -> int:
        """The one-token forwards that decode_seconds holds. The first token is drawn from the prompt's
        logits (prompt_seconds), so n tokens take n - 1 forwards, and n where a stop id drawn from the last
        one's logits ended the run. The rate counted n tokens over n - 1 forwards: a 1-token run showed
        5,284 tok/s for a model that decodes ~500."""
        n = len(self.token_ids)
        return n if getattr(self, "finish_reason", "length") == "stop" else max(0, n - 1)

    @property
    def decode_tokens_per_second(self) -> float:
        """Decode forwards a second (0.0 where there were none: one token, from the prompt's logits)."""
        return self.decode_forwards / self.decode_seconds if self.decode_seconds > 0 else 0.0
