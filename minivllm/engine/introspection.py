"""LLMEngine's read-only side: the stats and gauges its metrics read, and the invariant checks tests run
after every step (a base class of LLMEngine, so llm_engine.py keeps to the step itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.engine.stats import IterationStats, SchedulerSnapshot

if TYPE_CHECKING:
    from minivllm.engine.block_manager import BlockManager
    from minivllm.engine.scheduler import Scheduler, SchedulerOutput
    from minivllm.engine.sequence import SequenceGroup
    from minivllm.engine.stats import StatsRecorder
    from minivllm.engine.swap_manager import SwapManager
    from minivllm.model.input_batch import InputBatch
    from minivllm.spec_decode.speculator import Speculator


class EngineIntrospection:
    """Stats, gauges and invariant checks over the engine's state (set by LLMEngine.__init__)."""

    scheduler: Scheduler
    block_manager: BlockManager
    swap: SwapManager | None
    speculator: Speculator | None
    recorder: StatsRecorder
    input_batch: InputBatch
    groups: dict[str, SequenceGroup]
    _in_flight: SchedulerOutput | None

    # ---- stats ---------------------------------------------------------------------------------
    def take_failed_step(self) -> list[str]:
        """The request ids of a step that raised (empty if none was in progress); clears it."""
        sched, self._in_flight = self._in_flight, None
        return list(dict.fromkeys(seq.request_id for seq, _ in sched.scheduled)) if sched else []

    def take_stats(self) -> IterationStats:
        """The stats gathered since the previous call (scheduler counters as deltas)."""
        return self.recorder.take(self.scheduler.stats, self.speculator.stats if self.speculator else None,
                                  self.block_manager.num_evicted_blocks)

    def snapshot(self, extra_waiting: int = 0) -> SchedulerSnapshot:
        """Requests running, waiting and swapped, and KV usage of both tiers, now."""
        sched, bm, swap = self.scheduler, self.block_manager, self.swap
        running_ids = {seq.request_id for seq in sched.running}
        # A request with one sequence running and another swapped out counts as running.
        swapped = len({seq.request_id for seq in sched.swapped} - running_ids)
        return SchedulerSnapshot(len(running_ids), len(self.groups) - len(running_ids) - swapped + extra_waiting,
                                 bm.num_used / bm.num_blocks, num_swapped=swapped,
                                 cpu_cache_usage=swap.num_used / swap.num_blocks if swap else 0.0,
                                 num_swapped_blocks=swap.num_used if swap else 0)

    # ---- introspection -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Block accounting of both tiers agrees with the live sequences, and every sampling slot belongs to
        one."""
        live = self.scheduler.running + self.scheduler.waiting + self.scheduler.swapped
        self.block_manager.check_invariants(live)
        if self.swap is not None:
            self.swap.check_invariants(self.scheduler.swapped)
        if self.speculator is not None:
            self.speculator.proposer.check_invariants()
        slots = [s.slot for s in live if s.slot >= 0]
        assert len(set(slots)) == len(slots) == self.input_batch.num_active, (slots, self.input_batch.num_active)
