"""The speculator's plain data: its counters since start (vLLM's spec_decode metrics, read by the engine's stats) and
each sequence's record of how its proposals fared (the adaptive rule's per-sequence factor)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # sequences that proposed at least one token, per step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose proposal i was accepted
    proposed_per_position: list[int] = field(default_factory=list)  # [i]: drafts that had a proposal i


@dataclass(slots=True)
class SpecRecord:
    """One sequence's speculation record: proposals verified so far, and (recent ones weighing most) the tokens
    they yielded against what all drafts' acceptance expected of them."""

    drafts: int = 0
    accepted: float = 0.0
    expected: float = 0.0
