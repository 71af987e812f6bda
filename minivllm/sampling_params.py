"""SamplingParams: how to decode one request; validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Decoding settings of one request (vLLM's names and meanings)."""

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """Whether decoding takes the argmax."""
        return self.temperature == 0.0
