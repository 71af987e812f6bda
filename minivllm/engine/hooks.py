"""The step's hook points: how optional features (speculation, guided decoding, swap costs, test fault injection)
take part in a step without the step naming them.

A feature is a StepHook subclass holding its own per-sequence state; it overrides the points it needs. HookSet
keeps, per point, only the hooks whose class overrides it, so a point no feature uses costs the step one empty
loop. Points, in step order:

  before_schedule   the scheduler is about to decide (speculation proposes; guided decoding trims proposals)
  after_schedule    its decisions are known, nothing has moved yet (preempted sequences let go of drafts)
  before_forward    the forward is about to run (guided decoding starts filling token masks)
  forward           wraps the forward itself (test fault injection raises or poisons logits here)
  after_forward     a measured forward's time (cost models learn)
  process_logits    rows about to be sampled or verified: a feature may forbid tokens in its sequences' rows
  token_accepted    a sequence's new token passed the stop checks: a feature may finish it
  end_step          the step is done (proposals cleared, masks dropped)
and outside the step: request_added, sequence_added, sequence_finished (finished, aborted or preempted).

A hook made on demand (`wanted_if`, a request field) stays out of every point until the first request that sets
that field arrives: traffic that never uses a feature (guided decoding, say) never runs its code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from minivllm.engine.scheduler import Scheduler, SchedulerOutput
    from minivllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
    from minivllm.model.runner import SequenceInput

Entry = tuple["Sequence", int]
# One sequence's logits rows in a step: (sequence, first row, number of rows).
RowSpan = tuple["Sequence", int, int]
Forward = Callable[[list[Entry], list["SequenceInput"]], "torch.Tensor"]


class StepHook:
    """One feature's part in the step; every point is a no-op here (see the module doc)."""

    # On demand: dormant until a request whose SequenceGroup has this field set (not None) arrives, then on for good
    # (HookSet reads the field: a dormant feature's code never runs). Such a hook may not wrap the forward.
    wanted_if: str | None = None

    def request_added(self, group: SequenceGroup) -> None:
        """A request was queued (its first sequence not yet set up)."""

    def sequence_added(self, seq: Sequence) -> None:
        """A sequence was set up: a request's first, or a sample forked from it."""

    def sequence_finished(self, seq: Sequence) -> None:
        """A sequence finished or was aborted, or was preempted (it will be set up again when it resumes)."""

    def before_schedule(self, scheduler: Scheduler) -> None:
        """Before the scheduler decides this step's work."""

    def after_schedule(self, sched: SchedulerOutput) -> None:
        """After the scheduler decided, before any block moves or the forward."""

    def before_forward(self, scheduled: list[Entry]) -> None:
        """Just before the forward over the scheduled entries."""

    def forward(self, inner: Forward) -> Forward:
        """The forward to run: `inner`, or a wrapper of it."""
        return inner

    def after_forward(self, sched: SchedulerOutput, forward_s: float, moves_s: float, first: bool) -> None:
        """A measured forward (not one split to isolate a failure): its time and the block moves' time; first: the
        runner's first forward over this many tokens, slower than the size's usual (ModelRunner.last_forward_first)."""

    def process_logits(self, logits: torch.Tensor, spans: list[RowSpan]) -> None:
        """The rows about to be sampled or verified; change them in place (e.g. -inf for forbidden tokens)."""

    def token_accepted(self, seq: Sequence, token: int, status: SequenceStatus | None) -> SequenceStatus | None:
        """seq's new token, with the status the stop checks gave it; returns the status it ends with."""
        return status

    def end_step(self) -> None:
        """The step is done."""


_POINTS = ("request_added", "sequence_added", "sequence_finished", "before_schedule", "after_schedule",
           "before_forward", "forward", "after_forward", "process_logits", "token_accepted", "end_step")


class HookSet:
    """The engine's hooks, grouped by the points each overrides (in registration order)."""

    def __init__(self, hooks: list[StepHook]) -> None:
        self.install(hooks)

    def install(self, hooks: list[StepHook]) -> None:
        """Replace the hooks (the on-demand ones dormant again)."""
        self.hooks = hooks
        self._dormant = [h for h in hooks if h.wanted_if is not None]
        assert all(type(h).forward is StepHook.forward for h in self._dormant), "an on-demand hook may not wrap"
        self._group()

    def _group(self) -> None:
        active = [h for h in self.hooks if h not in self._dormant]
        self.at: dict[str, list[StepHook]] = {
            point: [h for h in active if getattr(type(h), point) is not getattr(StepHook, point)] for point in _POINTS}
        self._before_schedule = self.at["before_schedule"]
        self._after_schedule = self.at["after_schedule"]
        self._before_forward = self.at["before_forward"]
        self._after_forward = self.at["after_forward"]
        self._process_logits = self.at["process_logits"]
        self._token_accepted = self.at["token_accepted"]
        self._end_step = self.at["end_step"]
        self._sequence_added = self.at["sequence_added"]
        self._sequence_finished = self.at["sequence_finished"]
        self._request_added = self.at["request_added"]

    def find(self, kind: type[StepHook]) -> StepHook | None:
        """The registered hook of this class, if any."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    def wrap_forward(self, inner: Forward) -> Forward:
        """The forward with every hook's wrapper around it (the first registered outermost)."""
        for h in reversed(self.at["forward"]):
            inner = h.forward(inner)
        return inner

    def request_added(self, group: SequenceGroup) -> None:
        if self._dormant:
            asleep = [h for h in self._dormant if getattr(group, str(h.wanted_if)) is None]
            if len(asleep) < len(self._dormant):
                self._dormant = asleep
                self._group()  # (between steps: the engine thread adds requests)
        for h in self._request_added:
            h.request_added(group)

    def sequence_added(self, seq: Sequence) -> None:
        for h in self._sequence_added:
            h.sequence_added(seq)

    def sequence_finished(self, seq: Sequence) -> None:
        for h in self._sequence_finished:
            h.sequence_finished(seq)

    def before_schedule(self, scheduler: Scheduler) -> None:
        for h in self._before_schedule:
            h.before_schedule(scheduler)

    def after_schedule(self, sched: SchedulerOutput) -> None:
        for h in self._after_schedule:
            h.after_schedule(sched)

    def before_forward(self, scheduled: list[Entry]) -> None:
        for h in self._before_forward:
            h.before_forward(scheduled)

    def after_forward(self, sched: SchedulerOutput, forward_s: float, moves_s: float, first: bool) -> None:
        for h in self._after_forward:
            h.after_forward(sched, forward_s, moves_s, first)

    def process_logits(self, logits: torch.Tensor, spans: list[RowSpan]) -> None:
        for h in self._process_logits:
            h.process_logits(logits, spans)

    def token_accepted(self, seq: Sequence, token: int, status: SequenceStatus | None) -> SequenceStatus | None:
        for h in self._token_accepted:
            status = h.token_accepted(seq, token, status)
        return status

    def end_step(self) -> None:
        for h in self._end_step:
            h.end_step()
