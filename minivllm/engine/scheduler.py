"""Scheduler (vLLM v1 style): one token budget per step, running requests first, then waiting ones.

Chunked prefill and prefix-cache hits fall out of the same loop: a sequence is scheduled for
`num_tokens - num_computed_tokens` tokens, capped by what is left of the budget. When the pool runs
out, the lowest-priority (then newest) running sequence is preempted by recompute.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from minivllm.config import SchedulerConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's work: each scheduled sequence with its number of new tokens, in schedule order."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to run this step."""
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Counters since start."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which served from cache


def _order(seq: Sequence) -> tuple[int, int]:
    return seq.sort_key


def _reversed_order(seq: Sequence) -> tuple[int, int]:
    priority, arrival = seq.sort_key
    return -priority, -arrival


def _remove_sorted(queue: list[Sequence], seq: Sequence, key: Callable[[Sequence], tuple[int, int]]) -> None:
    """Remove seq from a queue sorted by key: a bisection to its key, then a short scan among equal keys
    (a request's samples and beams share one), instead of list.remove's scan of the whole queue."""
    i = bisect.bisect_left(queue, key(seq), key=key)
    while queue[i] is not seq:
        i += 1
    del queue[i]


class Scheduler:
    """Decides, each step, which sequences run and for how many tokens."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.is_ablation and type(self) is Scheduler:
            raise ValueError("ablation modes (static batching, contiguous or no KV cache) run on "
                             "engine.ablation_scheduler.AblationScheduler")
        self.config = config
        self.bm = block_manager
        # Sorted by sort_key, last first: the next to admit is at the end, so admission pops in O(1).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # sorted by sort_key: the preemption victim is the last
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        seq.status = SequenceStatus.WAITING
        bisect.insort_left(self.waiting, seq, key=_reversed_order)  # equal keys: first come, first served

    @property
    def num_unfinished(self) -> int:
        """Sequences waiting or running."""
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        """Fill one step's token budget: running sequences first, then admit waiting ones."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # Speculative proposals are scheduled after the sequence's last token, in the same chunk.
            n = min(seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed_tokens, budget)
            if n == 0:  # a beam whose next-token log-probs wait for the rest of its beam group
                i += 1
                continue
            while not self.bm.allocate_slots(seq, n):
                if seq.spec_token_ids:  # proposals never cost another sequence its place: drop them first
                    seq.spec_token_ids = []
                    n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                    continue
                victim = self.running.pop()  # lowest priority, newest: running is kept sorted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
        # vLLM v1's rule: no admissions in a step that had to preempt (the pool is under pressure).
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        # Beams waiting for their siblings hold blocks but compute nothing, so they are never preempted
        # above. If they starve a waiting sibling (nothing at all could run), they make room: their
        # next-token log-probs are kept by their beam group, only their KV is recomputed later.
        while not out.scheduled and self.waiting and any(self._idle(s) for s in self.running):
            victim = next(s for s in reversed(self.running) if self._idle(s))
            _remove_sorted(self.running, victim, _order)
            self._preempt(victim)
            out.preempted.append(victim)
            budget, _ = self._admit(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.block_copies = self.bm.take_copies()
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Continuous batching: admit waiting sequences every step. Returns the budget left."""
        return self._admit(out, budget)[0]

    def _reserve(self, n: int, num_cached: int) -> int:
        """Slots to allocate for a sequence admitted to compute n tokens after num_cached cached ones."""
        return n

    def update_from_output(self, sampled: list[Sequence]) -> None:
        """After a step: the sequences that sampled a token (nothing to do for the paged KV cache)."""

    @staticmethod
    def _idle(seq: Sequence) -> bool:
        return seq.num_computed_tokens == seq.num_tokens

    def _admit(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Admit waiting sequences in order while they fit; returns the budget left and whether the step
        budget (rather than the seats, the pool, or an empty queue) is what stopped admission."""
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            if budget == 0:
                return budget, True
            seq = self.waiting[-1]
            computed = [] if seq.skips_prefix_cache else self.bm.get_computed_blocks(seq)
            num_cached = len(computed) * self.bm.block_size
            n = seq.num_tokens - num_cached
            if n > budget and not cfg.enable_chunked_prefill:
                return budget, True
            n = min(n, budget)
            if not self.bm.allocate_slots(seq, self._reserve(n, num_cached), computed):
                return budget, False
            self.waiting.pop()
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += num_cached
            if seq.num_preemptions == 0 and seq.group is not None and seq.index == 0 and seq.num_output_tokens == 0:
                seq.group.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_order)
            out.scheduled.append((seq, n))
            budget -= n
        return budget, False

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute (seq already off the running list): drop its KV blocks and requeue it;
        it resumes from its tokens so far."""
        self.bm.free(seq)
        seq.spec_token_ids = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.add(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Add child as a copy of parent that shares its KV blocks (copy-on-write later). Forks join the
        running set even past max_num_seqs: a request's samples / beams (at most n or beam_width) stay
        together rather than waiting behind other requests."""
        child.token_ids = list(parent.token_ids)
        child.block_hashes = list(parent.block_hashes)
        if parent.status == SequenceStatus.RUNNING:
            self.bm.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            bisect.insort(self.running, child, key=_order)
        else:  # parent was preempted: the child recomputes from scratch too
            self.add(child)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence (finished or aborted) and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            _remove_sorted(self.running, seq, _order)
        elif seq.status == SequenceStatus.WAITING:
            _remove_sorted(self.waiting, seq, _reversed_order)
        seq.status = status
        self.bm.free(seq)
