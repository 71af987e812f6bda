"""The live view's event feed (SPEC §7): one JSON-ready record per engine step, for `/dashboard`.

Built on the engine thread right after a step, from what the step already holds (the schedule it ran,
the scheduler's queues, the block tables, the step's IterationStats), and only while a viewer is
subscribed: with none, the engine pays one integer test per step. Records reach subscribers on the
event loop through bounded queues; a viewer that falls behind loses records (counted per viewer and in
total), never slows the engine. The KV block grid, O(blocks), is sent at most every KV_PERIOD_S.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import sys
import time
from array import array
from typing import TYPE_CHECKING, Any

from minivllm.engine.block_manager import EVICTED
from minivllm.engine.sequence import SequenceStatus
from minivllm.engine.stats import IterationStats

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
KV_PERIOD_S = 0.2
QUEUE_STEPS = 256  # records a viewer may fall behind before it loses some
MAX_WAITING_LISTED = 128
FREE, CACHED = -1, -2  # KV grid cells that no request owns: free, or free but holding a cached prefix


class Subscription:
    """One viewer's queue of records."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE_STEPS)
        self.dropped = 0


class StepTracer:
    """Builds step records (engine thread) and hands them to subscribers (event-loop thread)."""

    def __init__(self) -> None:
        self.subscribers: list[Subscription] = []
        self.active = 0  # len(subscribers), read by the engine thread without a lock
        self.dropped = 0
        self._steps = itertools.count(1)
        self._last_kv = 0.0

    # ---- event loop ---------------------------------------------------------------------------------
    def subscribe(self) -> Subscription:
        sub = Subscription()
        self.subscribers.append(sub)
        self.active = len(self.subscribers)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)
        self.active = len(self.subscribers)

    def publish(self, record: dict[str, Any]) -> None:
        """Give a record to every viewer; a full queue loses it (counted)."""
        for sub in self.subscribers:
            try:
                sub.queue.put_nowait(record)
            except asyncio.QueueFull:
                sub.dropped += 1
                self.dropped += 1

    # ---- engine thread ------------------------------------------------------------------------------
    def record(self, eng: LLMEngine, stats: IterationStats) -> dict[str, Any]:
        """The step's record; one that cannot be built is an error record, never an exception in the engine
        loop (the view only observes)."""
        try:
            return self.build(eng, stats)
        except Exception as e:
            logger.exception("live view: the step record could not be built")
            return {"type": "error", "message": f"the step record could not be built ({type(e).__name__})"}

    def build(self, eng: LLMEngine, stats: IterationStats) -> dict[str, Any]:
        """The record of the step just run (and of aborts since the last one)."""
        sched = eng.last_schedule
        batch = []
        if sched is not None and stats.num_steps:
            for seq, n in sched.scheduled:
                before = seq.num_computed_tokens - n
                batch.append([seq.request_id, "prefill" if before < seq.num_prompt_tokens else "decode", n])
        scheduler = eng.scheduler
        now = time.time()
        record: dict[str, Any] = {
            "type": "step", "step": next(self._steps), "t": now,
            "batch": batch, "num_batched_tokens": sched.num_batched_tokens if sched and stats.num_steps else 0,
            "token_budget": eng.scheduler_config.max_num_batched_tokens,
            "preempted": sorted({s.request_id for s in sched.preempted}) if sched and stats.num_steps else [],
            # Of those, the ones whose KV went to the host tier (preemption by swap) rather than away.
            "swapped_out": sorted({s.request_id for s in sched.preempted if s.status == SequenceStatus.SWAPPED})
            if sched and stats.num_steps else [],
            "num_swapped": len({s.request_id for s in scheduler.swapped}),
            "waiting": [s.request_id for s in scheduler.waiting[:MAX_WAITING_LISTED]],
            "num_waiting": len(scheduler.waiting), "num_running": len({s.request_id for s in scheduler.running}),
            "finished": [[f.request_id, f.finish_reason, round(f.e2e_latency, 4)] for f in stats.finished],
            "ttft": [round(x, 4) for x in stats.time_to_first_tokens],
            "generation_tokens": stats.num_generation_tokens, "prompt_tokens": stats.num_prompt_tokens,
            "prefix_cache_hits": stats.prefix_cache_hits, "prefix_cache_queries": stats.prefix_cache_queries,
            "dropped": self.dropped,
        }
        if now - self._last_kv >= KV_PERIOD_S or stats.finished:
            self._last_kv = now
            record["kv"] = self._kv_grid(eng)
        return record

    def _kv_grid(self, eng: LLMEngine) -> dict[str, Any]:
        """Owner of every block: a request's index in `requests`, FREE or CACHED, as little-endian int32s in
        base64 (one C call to encode, however large the pool); `shared` lists the blocks more than one
        sequence references (prefix sharing, samples, beams). O(blocks in use) Python work."""
        bm = eng.block_manager
        owners = array("i", [FREE]) * bm.num_blocks
        for b in bm.evictable:
            owners[b] = CACHED
        requests: list[str] = []
        index: dict[str, int] = {}
        shared = set()
        refs = bm.ref_counts
        for seq in eng.scheduler.running:
            i = index.get(seq.request_id)
            if i is None:
                i = index[seq.request_id] = len(requests)
                requests.append(seq.request_id)
            for b in seq.block_table:
                if b == EVICTED:
                    continue
                owners[b] = i
                if refs[b] > 1:
                    shared.add(b)
        if sys.byteorder != "little":
            owners.byteswap()
        return {"num_blocks": bm.num_blocks, "block_size": bm.block_size, "requests": requests,
                "owners_b64": base64.b64encode(owners.tobytes()).decode("ascii"), "shared": sorted(shared),
                "used": bm.num_used}
