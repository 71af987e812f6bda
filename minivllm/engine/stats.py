"""Engine statistics per step, and the stat loggers that consume them (the periodic log line here;
Prometheus in entrypoints/metrics.py). Timestamps are taken in the engine, in one process."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger("minivllm.stats")


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished (or aborted) request."""

    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency: float  # arrival → finish, seconds
    queue_time: float | None  # arrival → first scheduled (None: never scheduled)
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass(slots=True)
class IterationStats:
    """What happened since the last `take_stats()`: normally one step, plus any aborts."""

    num_steps: int = 0
    num_iteration_tokens: list[int] = field(default_factory=list)  # forward tokens of each step
    num_prefill_tokens: int = 0  # of which prompt tokens (prefill chunks; recomputation after preemption too)
    num_prompt_tokens: int = 0  # prompts of requests that produced their first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)  # from arrival
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass(slots=True, frozen=True)
class SchedulerSnapshot:
    """Gauges at one instant."""

    num_running: int  # requests with a sequence running
    num_waiting: int  # requests queued (including those not yet handed to the engine)
    kv_cache_usage: float  # fraction of KV blocks referenced by live sequences (cached-evictable count as free)


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

    def record(self, stats: IterationStats | None, snapshot: SchedulerSnapshot) -> None:
        """Accumulate; log once per interval while there is (or just was) work."""
        if stats is not None:
            self._prompt += stats.num_prefill_tokens
            self._gen += stats.num_generation_tokens
            self._queries += stats.prefix_cache_queries
            self._hits += stats.prefix_cache_hits
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
        self._last = now
        self._prompt = self._gen = self._queries = self._hits = 0
