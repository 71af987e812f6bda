"""What a request returns: RequestOutput with one CompletionOutput per sample (or beam)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """The log-probability of one token, its rank among all tokens (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


# One entry per position: token id → Logprob (the chosen token plus the top-N alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence (for DELTA outputs: only what is new since the previous output)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        """Whether this sequence is done."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request; `finished` once every completion has a finish_reason."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first entry None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # --runner pooling: the prompt's pooled vector (no completion is generated)


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (vLLM's name): its pooled vector."""

    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
