"""SamplingParams: how to decode one request; validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this are greedy (vLLM's rule): dividing logits by ~0 only overflows.
SAMPLING_EPS = 1e-5


def _int(name: str, value: object, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


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
        _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}")
        if self.seed is not None:
            _int("seed", self.seed, 0)
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for tok in self.stop_token_ids:
            _int("stop_token_ids entries", tok, 0)
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """Whether decoding takes the argmax."""
        return self.temperature < SAMPLING_EPS
