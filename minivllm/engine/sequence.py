"""Per-request decoding state: a SequenceGroup (the request) holds one Sequence per sample or beam."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.client_seats import ClientSeats
    from minivllm.engine.lora_registry import LoadedLoRA
    from minivllm.engine.output_processor import IncrementalDetokenizer
    from minivllm.engine.stop_matcher import StopMatcher
    from minivllm.outputs import PositionLogprobs


_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its computed KV waits in the host tier
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

    __slots__ = ("seq_id", "request_id", "group", "index", "token_ids", "num_prompt_tokens", "sampling_params",
                 "priority", "arrival_index", "status", "num_computed_tokens", "block_table", "block_hashes",
                 "num_preemptions", "generator", "detokenizer", "logprobs", "cumulative_logprob", "stop_reason",
                 "num_emitted_tokens", "finish_reported", "slot", "spec_token_ids", "ttft_deadline", "cache_salt",
                 "kv_views")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_index: int, priority: int = 0, group: SequenceGroup | None = None, index: int = 0) -> None:
        self.seq_id = next(_seq_ids)  # unique per sequence (samples and beams share their request's id)
        self.request_id = request_id
        self.group = group
        self.index = index  # completion index within the request
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_index = arrival_index
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids, grown lazily
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None  # the sequence's own, when its request has a seed
        self.detokenizer: IncrementalDetokenizer | None = None
        self.logprobs: list[PositionLogprobs] | None = None
        self.cumulative_logprob: float | None = None
        self.stop_reason: str | int | None = None
        self.num_emitted_tokens = 0  # output tokens already handed out in DELTA outputs
        self.finish_reported = False  # DELTA outputs: its finish_reason went out already
        self.slot = -1  # its row of settings in the engine's input batch once sampled (-1: none)
        # Tokens proposed for this step (speculative decoding), verified by the step's forward after its last one.
        self.spec_token_ids: list[int] = []
        # Its request's (samples and beams inherit it through the group); a copy, so sort keys read one slot.
        self.ttft_deadline = group.ttft_deadline if group is not None else math.inf
        self.kv_views: tuple[Any, ...] = ()  # its block tables in the window KV groups (engine/kv_groups.py)
        # Seeds its prefix-cache hash chain: KV computed under a LoRA adapter is only shared with the same adapter.
        self.cache_salt = group.lora.cache_salt if group is not None and group.lora is not None else b""

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
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then earliest TTFT deadline (none: math.inf, after every
        deadline), then earlier arrival. Fixed for a sequence's life, so sorted queues stay sorted."""
        return (self.priority, self.ttft_deadline, self.arrival_index)

    @property
    def skips_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position computed, so such a prompt never hits the cache."""
        return (self.group is not None and self.group.prompt_logprobs is not None
                and len(self.group.prompt_logprobs) < self.num_prompt_tokens)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")


@dataclass
class BeamState:
    """Beam search bookkeeping of one request (HF transformers' algorithm)."""

    width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    live: list[Sequence]  # running beams, best first
    scores: list[float]  # their cumulative logprobs
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # beam seq_id → next-token log-probs
    finished: list[tuple[float, list[int], float]] = field(default_factory=list)  # (score, output ids, cum logprob)
    improvable: bool = True  # HF's early-stop heuristic has not fired yet
    num_generated: int = 0


@dataclass
class SequenceGroup:
    """One request: its prompt, parameters and sequences (n samples, or live beams)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    beam: BeamState | None = None
    prompt_logprobs_sent: bool = False  # DELTA outputs: prompt logprobs go out once
    forked: bool = False  # n > 1: children created at the first sample
    num_cached_tokens: int = 0
    aborted: bool = False
    # Stats timestamps (time.time(), like arrival_time).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    ttft_deadline: float = math.inf  # when the first token is due (arrival_time's clock; slo.py)
    start_deadline: float = math.inf  # its timeout: not started by then, it is dropped before any prefill
    grammar: str | None = None  # guided decoding: the compiled constraint each of its sequences follows
    grammar_after_reasoning: bool = False  # ... from the end of the thinking on (structured_output/reasoning.py)
    lora: LoadedLoRA | None = None  # the LoRA adapter it runs with
    stop_matcher: StopMatcher | None = None  # its stop strings' automaton, built for its first sequence
    seats: ClientSeats | None = None  # its client's share of the engine (client_seats.py)
    embedding: list[float] | None = None  # --runner pooling: its prompt's pooled vector, once computed (pooling.py)

    @property
    def finished(self) -> bool:
        """All sequences done (beam search: the search has ended)."""
        if self.aborted:
            return True
        if self.beam is not None:
            return not self.beam.live
        return (self.forked or self.params.n == 1) and all(s.status.finished for s in self.seqs)
