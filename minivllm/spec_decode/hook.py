"""Speculative decoding at the step's hook points (engine/hooks.py): the speculator proposes before the scheduler
decides (the proposals are the sequences' extra tokens to verify), preempted and finished sequences release what the
proposer holds for them, measured forwards feed its cost model, and the step's end clears the proposals."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.engine.hooks import StepHook
from minivllm.spec_decode.speculator import Speculator

if TYPE_CHECKING:
    from minivllm.engine.scheduler import Scheduler, SchedulerOutput
    from minivllm.engine.sequence import Sequence


class SpeculationHook(StepHook):
    """The speculator's part in the step."""

    def __init__(self, speculator: Speculator) -> None:
        self.speculator = speculator

    def before_schedule(self, scheduler: Scheduler) -> None:
        self.speculator.propose(scheduler.running, bool(scheduler.waiting))

    def after_schedule(self, sched: SchedulerOutput) -> None:
        for seq in sched.preempted:  # its draft K/V goes too: recomputed with it
            self.speculator.release(seq)

    def after_forward(self, sched: SchedulerOutput, forward_s: float, moves_s: float, first: bool) -> None:
        self.speculator.observe(sched.scheduled, forward_s, first)

    def sequence_finished(self, seq: Sequence) -> None:
        self.speculator.forget(seq)

    def end_step(self) -> None:
        self.speculator.end_step()
