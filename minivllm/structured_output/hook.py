"""Guided decoding at the step's hook points (engine/hooks.py): each guided sequence gets its grammar matcher when
set up (or once its thinking ends), proposals are cut to what the grammar accepts, token masks are filled during the
forward and applied to the guided rows before sampling or verification, and every new token advances the matcher."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from minivllm.engine.hooks import Entry, RowSpan, StepHook
from minivllm.engine.sequence import SequenceStatus
from minivllm.model.sampler import apply_token_bitmask
from minivllm.structured_output.manager import StepMasks, StructuredOutputManager

if TYPE_CHECKING:
    import torch

    from minivllm.engine.scheduler import Scheduler
    from minivllm.engine.sequence import Sequence


class GuidedDecodingHook(StepHook):
    """The structured-output manager's part in the step; `fail(request_id, reason)` fails a request after the step."""

    wanted_if = "grammar"  # on demand: requests without a grammar never run this hook's code

    def __init__(self, manager: StructuredOutputManager, fail: Callable[[str, str], object]) -> None:
        self.manager = manager
        self.fail = fail
        self.masks: StepMasks | None = None  # this step's, while it runs

    def sequence_added(self, seq: Sequence) -> None:
        group = seq.group
        assert group is not None
        if group.grammar is None:
            return
        if group.grammar_after_reasoning:  # the grammar constrains the answer, after </think>
            self.manager.attach_later(seq, group.grammar)
        else:  # (children of n > 1 fork before their first token: each gets a fresh matcher)
            self.manager.attach(seq, group.grammar)

    def sequence_finished(self, seq: Sequence) -> None:
        self.manager.detach(seq)

    def before_schedule(self, scheduler: Scheduler) -> None:
        if self.manager.num_live:  # proposals (made just before) a grammar would refuse could never be accepted
            self.manager.check_proposals([s for s in scheduler.running if s.spec_token_ids])

    def before_forward(self, scheduled: list[Entry]) -> None:
        self.masks = self.manager.start_step(scheduled)  # filled during the forward where a core is free

    def process_logits(self, logits: torch.Tensor, spans: list[RowSpan]) -> None:
        """Forbidden tokens get -inf in each guided row (logprobs then report the constrained distribution, as
        vLLM's do); a speculating sequence's rows take its masks one per verified position."""
        masks = self.masks
        if masks is None:
            return
        rows: list[int] = []
        at: list[int] = []
        for seq, r0, n in spans:
            first = masks.rows.get(seq.seq_id)
            if first is not None:
                rows += range(r0, r0 + n)
                at += range(first, first + n)
        if rows:
            apply_token_bitmask(logits, rows, masks.mask()[at])

    def token_accepted(self, seq: Sequence, token: int, status: SequenceStatus | None) -> SequenceStatus | None:
        """FINISHED_STOPPED once the grammar is complete (it would take nothing but EOS). A token the grammar refuses
        fails the request (masking makes that a bug)."""
        manager = self.manager
        if seq.seq_id not in manager.matchers:
            if manager.pending:
                manager.attach_after_reasoning(seq)
            return status
        if status is not None:
            return status
        accepted, done = manager.accept(seq, token)
        if not accepted:
            self.fail(seq.request_id, f"internal error: guided decoding refused token {token}: {manager.error(seq)}")
            return None
        return SequenceStatus.FINISHED_STOPPED if done else None

    def end_step(self) -> None:
        self.masks = None
