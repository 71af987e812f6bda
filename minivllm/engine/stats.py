"""Engine statistics per step, and the stat loggers that consume them (the periodic log line here;
Prometheus in entrypoints/metrics.py). Timestamps are taken in the engine, in one process."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from minivllm.slo import priority_class

if TYPE_CHECKING:
    from minivllm.engine.scheduler import Scheduler, SchedulerStats
    from minivllm.engine.sequence import Sequence, SequenceGroup
    from minivllm.spec_decode.records import SpecDecodeStats

logger = logging.getLogger("minivllm.stats")


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished (or aborted) request."""

    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency: float  # arrival → finish, seconds
    queue_time: float | None  # arrival → first scheduled (None: never scheduled)
    num_prompt_tokens: int
    num_generation_tokens: int
    request_id: str = ""  # for the live view's feed (metrics never label by request)
    priority_class: str = "interactive"  # slo.py's class of its priority


@dataclass(slots=True)
class IterationStats:
    """What happened since the last `take_stats()`: normally one step, plus any aborts."""

    num_steps: int = 0
    num_iteration_tokens: list[int] = field(default_factory=list)  # forward tokens of each step
    num_prefill_tokens: int = 0  # of which prompt tokens (prefill chunks; recomputation after preemption too)
    num_prompt_tokens: int = 0  # prompts of requests that produced their first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)  # from arrival
    first_token_classes: list[str] = field(default_factory=list)  # the class of each of those requests
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    deadline_misses: list[str] = field(default_factory=list)  # the class of each request past its TTFT deadline
    num_preemptions: int = 0
    num_swap_preemptions: int = 0  # of num_preemptions, those by swap (the rest by recompute)
    kv_swap_out_bytes: int = 0
    kv_swap_in_bytes: int = 0
    num_evicted_blocks: int = 0  # released by sink-window eviction
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding (zero when it is off): drafts verified, tokens proposed, tokens accepted, and
    # per proposal position how many drafts had it accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class SchedulerSnapshot:
    """Gauges at one instant."""

    num_running: int  # requests with a sequence running
    num_waiting: int  # requests queued (including those not yet handed to the engine)
    kv_cache_usage: float  # fraction of KV blocks referenced by live sequences (cached-evictable count as free)
    num_swapped: int = 0  # requests preempted by swap with no sequence running
    cpu_cache_usage: float = 0.0  # fraction of the host tier's blocks held by swapped sequences
    num_swapped_blocks: int = 0  # those blocks


def scheduler_snapshot(scheduler: Scheduler, num_requests: int, extra_waiting: int = 0) -> SchedulerSnapshot:
    """Requests running, waiting and swapped, and KV usage of both tiers, now (num_requests: those unfinished)."""
    bm, swap = scheduler.bm, scheduler.swap
    running_ids = {seq.request_id for seq in scheduler.running}
    # A request with one sequence running and another swapped out counts as running.
    swapped = len({seq.request_id for seq in scheduler.swapped} - running_ids)
    return SchedulerSnapshot(len(running_ids), num_requests - len(running_ids) - swapped + extra_waiting,
                             bm.num_used / bm.num_blocks, num_swapped=swapped,
                             cpu_cache_usage=swap.num_used / swap.num_blocks if swap else 0.0,
                             num_swapped_blocks=swap.num_used if swap else 0)


@dataclass
class StepTimings:
    """Seconds per phase of the step, summed over steps (the step-time split)."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Phase → seconds."""
        return {"schedule": self.schedule, "prepare": self.prepare, "forward": self.forward,
                "sample": self.sample, "update": self.update}


class StatsRecorder:
    """The engine's events (a step scheduled, tokens produced, a request finished) as IterationStats, with
    timestamps taken in the engine; `take()` hands them over and starts afresh."""

    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids
        self.enabled = False  # gather at all (the server's metrics); off for offline use
        self.stats = IterationStats()
        self.produced: set[str] = set()  # request ids that got a new token in the current step
        self._base = (0, 0, 0, 0, 0, 0, 0)  # scheduler (and block manager) counters at the last take()
        self._spec_base: tuple[int, int, int, list[int]] | None = None  # speculation's, likewise

    def scheduled(self, scheduled: Iterable[tuple[Sequence, int]], num_batched_tokens: int,
                  now: float | None = None) -> None:
        """A step was scheduled (at `now`, the scheduler's clock): its tokens, the prompt share of them,
        first-scheduled times."""
        st, now = self.stats, time.time() if now is None else now
        st.num_steps += 1
        st.num_iteration_tokens.append(num_batched_tokens)
        for seq, n in scheduled:
            st.num_prefill_tokens += min(n, max(0, seq.num_prompt_tokens - seq.num_computed_tokens))
            group = seq.group
            if group is not None and group.first_scheduled_time is None:
                group.first_scheduled_time = now

    def generated(self, request_id: str, num_tokens: int) -> None:
        """A request got num_tokens new tokens in this step."""
        self.stats.num_generation_tokens += num_tokens
        self.produced.add(request_id)

    def token_times(self, group: SequenceGroup, now: float) -> None:
        """TTFT or inter-token latency of a request that produced a token in this step."""
        if group.request_id not in self.produced:
            return
        if group.first_token_time is None:
            group.first_token_time = now
            cls = priority_class(group.seqs[0].priority)
            self.stats.time_to_first_tokens.append(now - group.arrival_time)
            self.stats.first_token_classes.append(cls)
            self.stats.num_prompt_tokens += len(group.prompt_token_ids)
            if now > group.ttft_deadline:  # counted once: a request has one first token
                self.stats.deadline_misses.append(cls)
        else:
            assert group.last_token_time is not None
            self.stats.inter_token_latencies.append(now - group.last_token_time)
        group.last_token_time = now

    def finished(self, group: SequenceGroup, now: float) -> None:
        """A request finished or was aborted."""
        if group.aborted:
            reason = "abort"
        elif group.beam is not None:
            ids = group.beam.finished[0][1] if group.beam.finished else []
            reason = "stop" if ids and ids[-1] in self.eos_token_ids else "length"
        else:
            reason = group.seqs[0].status.value
        generated = (sum(len(ids) for _, ids, _ in group.beam.finished) if group.beam is not None
                     else sum(s.num_output_tokens for s in group.seqs))
        queued = group.first_scheduled_time - group.arrival_time if group.first_scheduled_time is not None else None
        cls = priority_class(group.seqs[0].priority)
        self.stats.finished.append(FinishedRequestStats(reason, now - group.arrival_time, queued,
                                                        len(group.prompt_token_ids), generated, group.request_id, cls))
        if group.first_token_time is None and now > group.ttft_deadline:  # aborted, never served: missed too
            self.stats.deadline_misses.append(cls)

    def take(self, s: SchedulerStats, spec: SpecDecodeStats | None = None, num_evicted_blocks: int = 0
             ) -> IterationStats:
        """The stats gathered since the previous call, the scheduler's, the block manager's evictions and
        speculation's counters as deltas."""
        st, self.stats = self.stats, IterationStats()
        p0, q0, h0, w0, o0, i0, e0 = self._base
        st.num_preemptions = s.num_preemptions - p0
        st.prefix_cache_queries = s.prefix_cache_queries - q0
        st.prefix_cache_hits = s.prefix_cache_hits - h0
        st.num_swap_preemptions = s.num_swap_preemptions - w0
        st.kv_swap_out_bytes = s.swap_out_bytes - o0
        st.kv_swap_in_bytes = s.swap_in_bytes - i0
        st.num_evicted_blocks = num_evicted_blocks - e0
        self._base = (s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits, s.num_swap_preemptions,
                      s.swap_out_bytes, s.swap_in_bytes, num_evicted_blocks)
        if spec is not None:
            d0, t0, a0, pos0 = self._spec_base or (0, 0, 0, [0] * len(spec.accepted_per_position))
            st.spec_num_drafts = spec.num_drafts - d0
            st.spec_num_draft_tokens = spec.num_draft_tokens - t0
            st.spec_num_accepted_tokens = spec.num_accepted_tokens - a0
            st.spec_accepted_per_position = [a - b for a, b in zip(spec.accepted_per_position, pos0, strict=True)]
            self._spec_base = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                               list(spec.accepted_per_position))
        return st


class StatLogger(Protocol):
    """Receives stats from the engine loop after each step (stats None: an idle tick)."""

    def record(self, stats: IterationStats | None, snapshot: SchedulerSnapshot) -> None:
        """Consume one step's stats and the current gauges."""
        ...


class LoggingStatLogger:
    """vLLM's periodic line: throughput, running/waiting, KV usage and prefix-cache hit rate."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._prompt = self._gen = 0
        self._queries = self._hits = 0
        self._drafted = self._accepted = 0

    def record(self, stats: IterationStats | None, snapshot: SchedulerSnapshot) -> None:
        """Accumulate; log once per interval while there is (or just was) work."""
        if stats is not None:
            self._prompt += stats.num_prefill_tokens
            self._gen += stats.num_generation_tokens
            self._queries += stats.prefix_cache_queries
            self._hits += stats.prefix_cache_hits
            self._drafted += stats.spec_num_draft_tokens
            self._accepted += stats.spec_num_accepted_tokens
        now = time.monotonic()
        elapsed = now - self._last
        if elapsed < self.interval_s:
            return
        busy = snapshot.num_running or snapshot.num_waiting
        if busy or self._prompt or self._gen:
            hit_rate = 100.0 * self._hits / self._queries if self._queries else 0.0
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                        self._prompt / elapsed, self._gen / elapsed, snapshot.num_running,
                        snapshot.num_waiting, 100.0 * snapshot.kv_cache_usage, hit_rate)
            if snapshot.num_swapped or snapshot.cpu_cache_usage:
                logger.info("Swapped: %d reqs, CPU KV cache usage: %.1f%%", snapshot.num_swapped,
                            100.0 * snapshot.cpu_cache_usage)
            if self._drafted:
                logger.info("Speculative decoding: %d of %d proposed tokens accepted (%.1f%%)", self._accepted,
                            self._drafted, 100.0 * self._accepted / self._drafted)
        self._last = now
        self._prompt = self._gen = self._queries = self._hits = self._drafted = self._accepted = 0
