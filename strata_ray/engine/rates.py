"""Token rates of a finished generation (torch-free, so the driver can import it before torch)."""


class TokenRates:
    """tok/s of a finished generation, for any result with prompt_tokens, prompt_seconds, token_ids and
    decode_seconds (GenerationResult and the engine's GenerationSummary)."""

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return len(self.token_ids) / self.decode_seconds if self.decode_seconds > 0 else 0.0
