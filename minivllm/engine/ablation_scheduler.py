"""Benchmark-only scheduling modes, for the ablations that show what each technique buys: the seed's
static (request-level) batching, a contiguous per-sequence KV reservation, and no KV reuse at all. They
live in a subclass the engine picks only when EngineArgs ask for one, so the default scheduler's step
carries no branch for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.engine_config import SchedulerConfig

if TYPE_CHECKING:
    from minivllm.engine.swap_manager import SwapManager


class AblationScheduler(Scheduler):
    """The scheduler with SchedulerConfig's ablation modes switched on."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 swap_manager: SwapManager | None = None) -> None:
        super().__init__(config, block_manager, swap_manager)
        self._batch_forming = True  # static batching: the current batch still admits requests

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        if not self.config.static_batching:
            return super()._admit_waiting(out, budget)
        # Static batching admits only while a batch forms; a new batch starts once the previous one is done.
        if not self.running:
            self._batch_forming = True
        if not self._batch_forming:
            return budget
        scheduled = len(out.scheduled)
        budget, budget_bound = self._admit(out, budget)
        # A static batch keeps forming only while the step budget (not the batch size or the pool) stopped
        # it, i.e. its prompts did not fit one step, and not once it decodes without admitting (decodes
        # alone can fill a step, e.g. when every step recomputes everything).
        admitted = len(out.scheduled) > scheduled
        started = any(s.num_output_tokens for s in self.running)
        self._batch_forming = budget_bound and (admitted or not started)
        return budget

    def _reserve(self, n: int, num_cached: int) -> int:
        # A contiguous cache holds a sequence's whole reservation from admission on.
        return max(n, (self.config.reserve_tokens or 0) - num_cached)

    def update_from_output(self, sampled: list[Sequence]) -> None:
        if self.config.recompute_kv:
            # No KV reuse: the next token is computed from the whole sequence again (its blocks stay
            # allocated only as the forward's scratch space).
            for seq in sampled:
                if not seq.status.finished:
                    seq.num_computed_tokens = 0
