"""Per-request decoding state: token ids, status, block table, computed-token count."""

from __future__ import annotations

import enum

import torch

from minivllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        """Whether the sequence is done."""
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


class Sequence:
    """One sequence being generated. `token_ids` = prompt + output; the KV cache holds the first
    `num_computed_tokens` of them in the blocks of `block_table`."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "token_ids", "num_prompt_tokens", "sampling_params",
                 "priority", "arrival_time", "arrival_index", "status", "num_computed_tokens", "num_cached_tokens",
                 "block_table", "block_hashes", "num_preemptions", "generator")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float, arrival_index: int, priority: int = 0, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = arrival_time
        self.arrival_index = arrival_index
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids, grown lazily
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None  # the request's own, when it has a seed

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_index)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
