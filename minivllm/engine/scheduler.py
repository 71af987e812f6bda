"""Scheduler (vLLM v1 style): one token budget per step, running requests first, then waiting ones.

Chunked prefill and prefix-cache hits fall out of the same loop: a sequence is scheduled for
`num_tokens - num_computed_tokens` tokens, capped by what is left of the budget. When the pool runs
out, the running sequence whose preemption hurts least (`_pick_victim`) is preempted: by recompute, or with
preemption_mode swap/auto by copying its KV to the host tier (swap_manager.py). Swapped sequences resume
before any waiting one is admitted (vLLM v0's order: running, swapped, waiting).

SLO-aware (slo.py): queues are ordered by priority, then earliest TTFT deadline, then arrival. A waiting
request of a better class than running ones goes ahead of them in the step (`_admit_ahead`): it takes the
budget before their chunks, and preempts them when the seats or the pool are theirs. Without classes every
request is interactive and none of this fires: the order is vLLM v1's.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.engine.block_manager import EVICTED, BlockManager
from minivllm.engine.client_seats import SeatCounter
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine_config import SchedulerConfig
from minivllm.slo import CLASS_NAMES, class_rank

if TYPE_CHECKING:
    from minivllm.engine.swap_manager import SwapManager


@dataclass
class SchedulerOutput:
    """One step's work: each scheduled sequence with its number of new tokens, in schedule order."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    group_copies: list[list[tuple[int, int]]] = field(default_factory=list)  # KV groups 1..'s (kv_groups.py)
    group_swaps: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = field(default_factory=list)
    # Host-tier moves, run before the copy-on-write copies and the forward: (device, host) and (host, device).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    now: float = 0.0  # the scheduler's clock when it decided (deadlines and slack were judged against it)
    expired: list[Sequence] = field(default_factory=list)  # dropped unstarted: their timeout passed while waiting

    @property
    def is_empty(self) -> bool:
        """Nothing to run this step."""
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Counters since start."""

    num_preemptions: int = 0  # by either mode
    num_swap_preemptions: int = 0  # of which by swap
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which served from cache


_NO_CLASS = len(CLASS_NAMES)  # a class rank worse than every class: nothing may go ahead of running work


def _order(seq: Sequence) -> tuple[int, float, int]:
    return seq.sort_key


def _reversed_order(seq: Sequence) -> tuple[int, float, int]:
    priority, deadline, arrival = seq.sort_key
    return -priority, -deadline, -arrival


def _remove_sorted(queue: list[Sequence], seq: Sequence, key: Callable[[Sequence], tuple[int, float, int]]
                   ) -> None:
    """Remove seq from a queue sorted by key: a bisection to its key, then a short scan among equal keys
    (a request's samples and beams share one), instead of list.remove's scan of the whole queue."""
    i = bisect.bisect_left(queue, key(seq), key=key)
    while queue[i] is not seq:
        i += 1
    del queue[i]


class Scheduler:
    """Decides, each step, which sequences run and for how many tokens."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 swap_manager: SwapManager | None = None) -> None:
        if config.is_ablation and type(self) is Scheduler:
            raise ValueError("ablation modes (static batching, contiguous or no KV cache) run on "
                             "engine.ablation_scheduler.AblationScheduler")
        self.config = config
        self.bm = block_manager
        # Sorted by sort_key, last first: the next to admit is at the end, so admission pops in O(1).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # sorted by sort_key: classes in order, best first
        self.swap = swap_manager  # the host tier (preemption_mode swap or auto), else None
        self.swapped: list[Sequence] = []  # sorted like waiting: the next to resume is at the end
        self.stats = SchedulerStats()
        # Deadlines are arrival_time + SLO on time.time()'s scale; tests swap in a scripted clock (slack in steps).
        self.clock: Callable[[], float] = time.time
        # (start deadline, seq_id, seq) of waiting requests that have a timeout; stale entries are skipped when due.
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self.seats = SeatCounter()  # named API keys' shares of the seats (client_seats.py)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        seq.status = SequenceStatus.WAITING
        bisect.insort_left(self.waiting, seq, key=_reversed_order)  # equal keys: first come, first served
        group = seq.group
        if group is not None and group.seats is not None:
            self.seats.active = True
        if group is not None and group.start_deadline != math.inf and seq.num_preemptions == 0:
            heapq.heappush(self._deadlines, (group.start_deadline, seq.seq_id, seq))

    @property
    def num_unfinished(self) -> int:
        """Sequences waiting, running or swapped."""
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def schedule(self) -> SchedulerOutput:
        """Fill one step's token budget: running sequences first, then admit waiting ones; a waiting request
        of a better class than running ones goes ahead of those (`_admit_ahead`)."""
        now = self.clock()
        out = SchedulerOutput(now=now)
        if self._deadlines and self._deadlines[0][0] <= now:
            self._expire(out, now)
        budget = self.config.max_num_batched_tokens
        head_rank = self._head_rank()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if head_rank < class_rank(seq.priority):  # running is sorted: seq starts the first worse class
                budget, admitted, stalled = self._admit_ahead(out, budget, i, now)
                i += admitted  # the admitted sort before seq, and are scheduled
                head_rank = _NO_CLASS if stalled else self._head_rank()
                continue  # seq itself may have made room
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
                j = self._pick_victim(now, i)
                assert j is not None  # seq itself qualifies
                victim = self.running.pop(j)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
        # vLLM v1's rule: no admissions (nor swap-ins) in a step that had to preempt (the pool is under pressure).
        if not out.preempted:
            budget = self._resume_then_admit(out, budget, self._admit_waiting)
        # Beams waiting for their siblings hold blocks but compute nothing, so they are never preempted
        # above. If they starve a waiting sibling (nothing at all could run), they make room: their
        # next-token log-probs are kept by their beam group, only their KV is recomputed later.
        # A swapped sibling starves them alike (it resumes before anything waiting is admitted).
        while not out.scheduled and (self.waiting or self.swapped) and any(self._idle(s) for s in self.running):
            victim = next(s for s in reversed(self.running) if self._idle(s))
            _remove_sorted(self.running, victim, _order)
            self._preempt(victim)
            out.preempted.append(victim)
            budget = self._resume_then_admit(out, budget, lambda o, b: self._admit(o, b)[0])
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.block_copies = self.bm.take_copies()
        if self.bm.groups is not None:
            out.group_copies = self.bm.groups.take_copies()
        if self.swap is not None:
            out.swap_out, out.swap_in = self.swap.take()
            out.group_swaps = self.swap.take_groups()
            self.stats.swap_out_bytes += len(out.swap_out) * self.swap.block_bytes
            self.stats.swap_in_bytes += len(out.swap_in) * self.swap.block_bytes
        return out

    def _expire(self, out: SchedulerOutput, now: float) -> None:
        """Drop the waiting requests whose timeout passed before they started: they cost no prefill, and their
        clients (who gave up by now) get an error rather than a late answer."""
        while self._deadlines and self._deadlines[0][0] <= now:
            seq = heapq.heappop(self._deadlines)[2]
            if seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0 and seq.num_preemptions == 0:
                _remove_sorted(self.waiting, seq, _reversed_order)
                seq.status = SequenceStatus.FINISHED_ABORTED
                out.expired.append(seq)

    def _resume_then_admit(self, out: SchedulerOutput, budget: int,
                           admit: Callable[[SchedulerOutput, int], int]) -> int:
        """Swap sequences back in (highest priority first), and only once none is left admit waiting ones:
        a swapped sequence holds host blocks and has work done, so it never starves behind new arrivals."""
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            assert self.swap is not None
            seq = self.swapped[-1]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.swap.swap_in(seq, n):
                return budget
            self.swapped.pop()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_order)
            out.scheduled.append((seq, n))
            budget -= n
        return budget if self.swapped else admit(out, budget)

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
        seats = self.seats.start(self.running) if self.seats.active else None
        passed: list[Sequence] = []  # waiting sequences whose client holds all its seats: they keep their place
        try:
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                if budget == 0:
                    return budget, True
                if seats is not None and not seats.admits(self.waiting[-1]):
                    passed.append(self.waiting.pop())
                    continue
                n = self._admit_head(out, budget)
                if not n:
                    return budget, n == 0
                budget -= n
            return budget, False
        finally:
            if passed:  # they were the queue's tail, in order: put back as they were
                self.waiting.extend(reversed(passed))

    def _admit_head(self, out: SchedulerOutput, budget: int) -> int | None:
        """Admit the next waiting sequence for at most budget (> 0) tokens; returns how many it was scheduled
        for, 0 when its prompt needs more than the budget and chunked prefill is off, None when the pool lacks
        the blocks."""
        seq = self.waiting[-1]
        computed = [] if seq.skips_prefix_cache else self.bm.get_computed_blocks(seq)
        num_cached = len(computed) * self.bm.block_size
        n = seq.num_tokens - num_cached
        if n > budget and not self.config.enable_chunked_prefill:
            return 0
        n = min(n, budget)
        if not self.bm.allocate_slots(seq, self._reserve(n, num_cached), computed):
            return None
        self.waiting.pop()
        self.stats.prefix_cache_queries += seq.num_tokens
        self.stats.prefix_cache_hits += num_cached
        if seq.num_preemptions == 0 and seq.group is not None and seq.index == 0 and seq.num_output_tokens == 0:
            seq.group.num_cached_tokens = num_cached
        seq.num_computed_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_order)
        out.scheduled.append((seq, n))
        return n

    def _head_rank(self) -> int:
        """The class of the next waiting request (_NO_CLASS when none waits, or when a swapped sequence of its
        class or better waits to resume: swapped work goes first, so admitting ahead would invert priorities)."""
        if not self.waiting:
            return _NO_CLASS
        rank = class_rank(self.waiting[-1].priority)
        if self.swapped and class_rank(self.swapped[-1].priority) <= rank:
            return _NO_CLASS
        return rank

    def _admit_ahead(self, out: SchedulerOutput, budget: int, start: int, now: float) -> tuple[int, int, bool]:
        """Admit waiting requests of a better class than running[start] (the first running sequence of a worse
        class than the queue's head, not yet scheduled this step) before it: they take the budget ahead of its
        class's prefill chunks and decodes, so a long batch prefill cannot hold an interactive first token back
        by whole steps. A head short of a seat or of blocks preempts a running sequence of a worse class than
        its own (vLLM's priority scheduling); never one of its own class, so equals never thrash, and every
        victim is of a worse class than anything this call admits, so none is re-admitted in the same step.
        Returns the budget left, how many were admitted (all inserted before `start`) and whether it stalled
        (no budget for the head's prompt, or nothing worse to displace): a stall holds for the rest of the step."""
        admitted = 0
        limit = class_rank(self.running[start].priority)
        while budget > 0 and self.waiting and class_rank(self.waiting[-1].priority) < limit:
            head, rank = self.waiting[-1], class_rank(self.waiting[-1].priority)
            if len(self.running) < self.config.max_num_seqs:
                n = self._admit_head(out, budget)
                if n:
                    budget -= n
                    admitted += 1
                    continue
                if n == 0:
                    return budget, admitted, True
                # Short of blocks: preempt nobody unless preempting every worse-class sequence could make room.
                worse = (s for s in self.running[start + admitted:] if class_rank(s.priority) > rank)
                refs = self.bm.ref_counts  # only blocks a preemption would free: not evicted, not shared
                room = self.bm.num_free_blocks + sum(1 for s in worse for b in s.block_table
                                                     if b != EVICTED and refs[b] == 1)
                if room < self.bm.blocks_needed(min(head.num_tokens, budget)):
                    return budget, admitted, True
            j = self._pick_victim(now, start + admitted, rank)
            if j is None:
                return budget, admitted, True
            victim = self.running.pop(j)
            self._preempt(victim)
            out.preempted.append(victim)
        return budget, admitted, budget == 0

    def _pick_victim(self, now: float, start: int, worse_than: int = -1) -> int | None:
        """The index in running of the preemption that hurts least among running[start:] of a class worse than
        `worse_than` (None: no such sequence): the lowest priority; then the most slack before its TTFT deadline
        (one that has its first token, or has no deadline, has all the slack there is); then the cheapest to
        restore (fewest computed tokens: what a recompute redoes, what a swap moves); then the newest. Sequences
        scheduled earlier in the step (before `start`) are never victims: their copy-on-write copies are owed and
        their tokens counted. O(sequences of the lowest priority): running is sorted, so the scan stops there."""
        best, best_key = None, None
        for j in range(len(self.running) - 1, start - 1, -1):
            s = self.running[j]
            if (best_key is not None and s.priority < best_key[0]) or class_rank(s.priority) <= worse_than:
                break
            slack = math.inf if s.num_output_tokens else s.ttft_deadline - now
            key = (s.priority, slack, -s.num_computed_tokens, s.arrival_index)
            if best_key is None or key > best_key:
                best, best_key = j, key
        return best

    def _preempt(self, seq: Sequence) -> None:
        """Preempt seq (already off the running list). By swap (see _swaps): its KV goes to the host tier and
        it waits in `swapped`, keeping num_computed_tokens. By recompute: its KV blocks are dropped and it is
        requeued, to resume from its tokens so far."""
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        if self._swaps(seq):
            assert self.swap is not None
            self.swap.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort_left(self.swapped, seq, key=_reversed_order)
            self.stats.num_swap_preemptions += 1
            return
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        self.add(seq)

    def _swaps(self, seq: Sequence) -> bool:
        """Whether to preempt seq by swap: in swap mode whenever the host tier has room for it, in auto mode
        when the measured costs also say it is cheaper. An idle beam is always recomputed: it gives up its
        blocks to a sibling that needs them, and swapped it would resume first and take them back."""
        swap = self.swap
        if swap is None or self._idle(seq) or not swap.can_swap_out(seq):
            return False
        # Swap-outs read their blocks before the step's copy-on-write copies write theirs: a sequence scheduled
        # (so possibly copied-on-write) earlier in this step is never the victim.
        assert not {d for _, d in self.bm.pending_copies} & set(seq.block_table), seq
        return self.config.preemption_mode == "swap" or swap.prefers_swap(seq)

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
        elif seq.status == SequenceStatus.SWAPPED:
            _remove_sorted(self.swapped, seq, _reversed_order)
            assert self.swap is not None
            self.swap.free(seq)
        seq.status = status
        self.bm.free(seq)
