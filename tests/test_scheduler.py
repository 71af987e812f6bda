"""Scheduler policy without a model: token budget, chunking, priorities, preemption order, admission."""

from __future__ import annotations

import pytest

from minivllm.engine.ablation_scheduler import AblationScheduler
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine_config import SchedulerConfig
from minivllm.sampling_params import SamplingParams

_arrival = iter(range(10**9))


def _seq(rid: str, n: int, priority: int = 0) -> Sequence:
    """A sequence with a prompt of n tokens unique to it (no accidental prefix-cache hits)."""
    k = next(_arrival)
    return Sequence(rid, [1000 * (k + 1) + i for i in range(n)], SamplingParams(), k, priority)


def _sched(num_blocks=64, budget=16, max_seqs=8, chunked=True, block_size=4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget, chunked), BlockManager(num_blocks, block_size))


def _advance(s: Scheduler, out) -> None:
    """What the engine does after the forward: count computed tokens, append a token when sampled."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        s.bm.cache_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1)


def test_budget_is_filled_and_prefill_is_chunked():
    s = _sched(budget=16)
    a, b, c = _seq("a", 10), _seq("b", 10), _seq("c", 10)
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 10), ("b", 6)]
    assert out.num_batched_tokens == 16
    _advance(s, out)
    out = s.schedule()
    # Running first: a decodes, b finishes its prefill, then c starts within what is left.
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 4), ("c", 10)]


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    s = _sched(budget=16, chunked=False)
    a, b = _seq("a", 10), _seq("b", 10)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 10)]


def test_priority_orders_admission():
    s = _sched(budget=10)
    low, high = _seq("low", 8, priority=5), _seq("high", 8, priority=-1)
    s.add(low)
    s.add(high)
    out = s.schedule()
    assert out.scheduled[0][0] is high


def test_preemption_takes_lowest_priority_then_newest():
    s = _sched(num_blocks=6, budget=64, block_size=4)
    old, new, vip = _seq("old", 8, priority=0), _seq("new", 8, priority=0), _seq("vip", 8, priority=-1)
    for q in (old, new, vip):
        s.add(q)
    _advance(s, s.schedule())  # each holds 2 blocks: the pool is full
    assert s.bm.num_free_blocks == 0
    # Every decode needs one more block at position 8: someone must go, and it is the newest of the
    # lowest priority.
    out = s.schedule()
    assert out.preempted[0] is new
    assert new.status == SequenceStatus.WAITING and new.num_computed_tokens == 0 and not new.block_table
    assert s.stats.num_preemptions >= 1
    assert {q.request_id for q, _ in out.scheduled} <= {"vip", "old"}
    s.bm.check_invariants(s.running + s.waiting)


def test_max_num_seqs_caps_running():
    s = _sched(budget=100, max_seqs=2)
    for i in range(4):
        s.add(_seq(str(i), 3))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.running) == 2 and len(s.waiting) == 2


def test_a_sequence_alone_always_progresses():
    # The pool holds exactly one request at its longest; two such requests must both finish.
    s = _sched(num_blocks=3, budget=64, block_size=4)
    a, b = _seq("a", 6), _seq("b", 6)
    s.add(a)
    s.add(b)
    for _ in range(200):
        out = s.schedule()
        if out.is_empty:
            break
        _advance(s, out)
        for q in list(s.running):
            if q.num_output_tokens >= 6:
                s.finish(q, SequenceStatus.FINISHED_LENGTH)
    assert a.status.finished and b.status.finished
    assert s.bm.num_used == 0


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_budget_never_exceeded(budget):
    s = _sched(budget=budget, num_blocks=200)
    for i in range(6):
        s.add(_seq(str(i), 5 + i))
    for _ in range(60):
        out = s.schedule()
        assert out.num_batched_tokens <= budget
        assert sum(n for _, n in out.scheduled) == out.num_batched_tokens
        _advance(s, out)


def test_static_batching_admits_a_new_batch_only_when_the_last_has_finished():
    s = AblationScheduler(SchedulerConfig(2, 64, True, static_batching=True), BlockManager(64, 4))
    seqs = [_seq(c, 6) for c in "abcd"]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["a", "b"]
    _advance(s, out)
    s.finish(seqs[0], SequenceStatus.FINISHED_LENGTH)  # a is done; b still runs
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.scheduled] == [("b", 1)]  # c waits for the batch to end
    _advance(s, out)
    s.finish(seqs[1], SequenceStatus.FINISHED_LENGTH)
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["c", "d"]


def test_static_batch_keeps_forming_while_its_prompts_exceed_the_budget():
    s = AblationScheduler(SchedulerConfig(3, 8, True, static_batching=True), BlockManager(64, 4))
    a, b, c, d = (_seq(x, 6) for x in "abcd")
    for q in (a, b, c, d):
        s.add(q)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 6), ("b", 2)]
    _advance(s, out)
    out = s.schedule()  # the batch is still forming: c joins; the batch is then full, d waits
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 4), ("c", 3)]
    _advance(s, out)
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["a", "b", "c"]


def test_contiguous_reservation_limits_admission_by_max_len():
    # 64 blocks of 4 slots, 40 slots (10 blocks) reserved per sequence: 6 sequences fit, not 10.
    s = AblationScheduler(SchedulerConfig(16, 256, True, reserve_tokens=40), BlockManager(64, 4, False))
    seqs = [_seq(str(i), 6) for i in range(10)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert len(out.scheduled) == 6 and all(n == 6 for _, n in out.scheduled)
    assert all(len(q.block_table) == 10 for q, _ in out.scheduled)
    _advance(s, out)
    out = s.schedule()  # decodes allocate nothing more
    assert s.bm.num_used == 60 and len(out.scheduled) == 6


def test_static_batch_without_chunking_keeps_forming_until_its_prompts_are_in():
    # Budget 16 fits two whole 6-token prompts per step: the batch of four forms over two steps.
    s = AblationScheduler(SchedulerConfig(4, 16, False, static_batching=True), BlockManager(64, 4))
    seqs = [_seq(c, 6) for c in "abcde"]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["a", "b"]
    for q, n in out.scheduled:  # prefill only (no token sampled yet, as for a prompt chunk)
        q.num_computed_tokens += n
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["c", "d"]  # a and b wait for the next token
    _advance(s, out)


def test_static_batch_closes_once_it_decodes_even_if_steps_stay_full():
    # A step budget that decodes keep full must not let new requests into a running batch.
    s = AblationScheduler(SchedulerConfig(4, 2, True, static_batching=True), BlockManager(64, 4))
    a, b, c = _seq("a", 2), _seq("b", 2), _seq("c", 2)
    for q in (a, b):
        s.add(q)
    _advance(s, s.schedule())  # a prefills and samples (budget 2 spent)
    s.add(c)
    for _ in range(4):
        out = s.schedule()
        assert "c" not in [q.request_id for q, _ in out.scheduled]
        _advance(s, out)


def test_default_scheduler_refuses_ablation_modes():
    """The production scheduler has no branch for the benchmark-only modes, so it must not accept them."""
    for cfg in (SchedulerConfig(2, 64, True, static_batching=True), SchedulerConfig(2, 64, True, reserve_tokens=8),
                SchedulerConfig(2, 64, True, recompute_kv=True)):
        with pytest.raises(ValueError, match="AblationScheduler"):
            Scheduler(cfg, BlockManager(64, 4))
