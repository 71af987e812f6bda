"""What a proposer is to the speculator (the Proposer protocol: NgramProposer, SuffixProposer, DraftModelProposer),
and the rows a speculating sequence's tokens are verified in (verify_rows, what the step guard builds)."""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.engine.sequence import Sequence
from minivllm.model.runner import SequenceInput


def verify_rows(seq: Sequence, n: int) -> list[SequenceInput]:
    """The runner inputs of a speculating sequence's n scheduled tokens (its last token, then proposals):
    one single-token row each, at consecutive positions over the same block table. A step's rows write
    their K/V before any row attends, and each attends up to its own position, so this is the chunk's
    causal attention, and a verification step stays an all-decode step (on CPU, the native decode stack
    rather than the module path that multi-token chunks take)."""
    start = seq.num_computed_tokens
    toks = (seq.token_ids[start:] + seq.spec_token_ids)[:n]
    lora = seq.group.lora.slot if seq.group is not None and seq.group.lora is not None else -1
    tables = tuple(v.block_table for v in seq.kv_views)
    return [SequenceInput([t], start + i, seq.block_table, True, lora=lora, group_tables=tables)
            for i, t in enumerate(toks)]


class Proposer(Protocol):
    """What the speculator needs of a proposer."""

    def propose(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, list[int], torch.Tensor | None]]:
        """Each (sequence, at most k)'s proposed tokens, and (a draft model's) the distributions they came from."""
        ...

    def overhead(self, longest: int, tokens: int, seqs: int) -> float:
        """Seconds a round of proposals costs: the longest proposal's length, the proposals' tokens in all, the
        sequences proposing."""
        ...

    def catch_up_cost(self, seq: Sequence) -> float:
        """Seconds the proposer would spend catching up on seq before its first proposal (0 without state)."""
        ...

    def settle(self) -> None:
        """After the step: the proposer's state rolled back to what verification accepted."""
        ...

    def release(self, seq: Sequence) -> None:
        """seq finished, was aborted or preempted: what the proposer holds for it goes."""
        ...

    def check_invariants(self) -> None:
        ...
