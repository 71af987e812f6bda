"""BlockManager accounting: ref counts, prefix hits with LRU retention, copy-on-write, no leaks."""

from __future__ import annotations

import random

import pytest

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams

BS = 4


def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), 0)


def _compute(bm: BlockManager, seq: Sequence, n: int, computed: list[int] | None = None) -> None:
    """What the scheduler + engine do for one step of n tokens."""
    assert bm.allocate_slots(seq, n, computed)
    seq.num_computed_tokens += len(computed or []) * BS
    bm.check_writable(seq, n)
    seq.num_computed_tokens += n
    bm.cache_blocks(seq)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, BS)
    s = _seq("a", list(range(10)))
    _compute(bm, s, 10)
    assert len(s.block_table) == 3 and bm.num_used == 3
    bm.check_invariants([s])
    bm.free(s)
    assert bm.num_used == 0 and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_prefix_hit_never_covers_last_token():
    bm = BlockManager(16, BS)
    a = _seq("a", list(range(8)))  # exactly two full blocks
    _compute(bm, a, 8)
    b = _seq("b", list(range(8)))
    hits = bm.get_computed_blocks(b)
    # Only the first block: a hit on both would leave no token to compute logits from.
    assert hits == a.block_table[:1]
    _compute(bm, b, 4, hits)
    assert b.block_table[0] == a.block_table[0] and bm.ref_counts[a.block_table[0]] == 2
    assert b.block_table[1] != a.block_table[1]
    bm.check_invariants([a, b])


def test_freed_prefix_stays_cached_and_is_evicted_lru():
    bm = BlockManager(4, BS)
    a = _seq("a", [1] * 9)
    _compute(bm, a, 9)
    bm.free(a)
    # Two full blocks stay cached (evictable), the partial one is simply free.
    assert len(bm.evictable) == 2 and len(bm.free_ids) == 2
    bm.check_invariants([])
    b = _seq("b", [1] * 9)
    assert len(bm.get_computed_blocks(b)) == 2
    # A request needing the whole pool evicts the cached blocks.
    c = _seq("c", [7] * 16)
    _compute(bm, c, 16)
    assert not bm.evictable and bm.num_used == 4
    assert bm.get_computed_blocks(b) == []
    bm.check_invariants([c])


def test_lru_evicts_least_recently_freed_first():
    bm = BlockManager(6, BS)
    old, new = _seq("old", [1] * 5), _seq("new", [2] * 5)
    _compute(bm, old, 5)
    _compute(bm, new, 5)
    bm.free(old)
    bm.free(new)
    x = _seq("x", [3] * 16)  # needs 4 blocks: 4 free (2 partial + 2 never used) → no eviction yet
    _compute(bm, x, 16)
    y = _seq("y", [4] * 2)  # needs 1 more: evicts the "old" prefix block first
    _compute(bm, y, 2)
    assert bm.get_computed_blocks(_seq("o", [1] * 5)) == []
    assert len(bm.get_computed_blocks(_seq("n", [2] * 5))) == 1
    bm.check_invariants([x, y])


def test_fork_shares_blocks_and_copy_on_write_before_write():
    bm = BlockManager(8, BS)
    parent = _seq("p", list(range(6)))
    _compute(bm, parent, 6)
    child = _seq("c", list(range(6)))
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    assert all(bm.ref_counts[b] == 2 for b in parent.block_table)
    bm.check_invariants([parent, child])
    # Both append a different token into the shared, partially filled last block.
    for seq, tok in ((parent, 100), (child, 200)):
        seq.token_ids.append(tok)
        _compute(bm, seq, 1)
    assert parent.block_table[0] == child.block_table[0]  # full block still shared
    assert parent.block_table[1] != child.block_table[1]  # last block diverged
    copies = bm.take_copies()
    assert len(copies) == 1 and copies[0][0] in (parent.block_table[1], child.block_table[1])
    bm.check_invariants([parent, child])
    bm.free(parent)
    bm.free(child)
    assert bm.num_used == 0
    bm.check_invariants([])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(2, BS)
    s = _seq("s", list(range(12)))
    before = (list(bm.free_ids), bm.num_used)
    assert not bm.allocate_slots(s, 12)
    assert (list(bm.free_ids), bm.num_used) == before and s.block_table == []


def test_check_writable_catches_a_shared_write():
    bm = BlockManager(8, BS)
    a = _seq("a", list(range(6)))
    _compute(bm, a, 6)
    b = _seq("b", list(range(6)))
    b.num_computed_tokens = 6
    bm.fork(a, b)
    b.num_computed_tokens = 5  # pretend the scheduler forgot copy-on-write and rewrites position 5
    with pytest.raises(AssertionError, match="shared block"):
        bm.check_writable(b, 1)


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_invariants(seed):
    rng = random.Random(seed)
    bm = BlockManager(24, BS)
    live: list[Sequence] = []
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    for step in range(400):
        op = rng.random()
        if op < 0.3 and len(live) < 8:
            s = _seq(f"r{step}", rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
            hits = bm.get_computed_blocks(s)
            n = s.num_tokens - len(hits) * BS
            if bm.allocate_slots(s, n, hits):
                s.num_computed_tokens = len(hits) * BS + n
                bm.cache_blocks(s)
                live.append(s)
        elif op < 0.45 and live and len(live) < 8:
            parent = rng.choice(live)
            child = _seq(f"f{step}", list(parent.token_ids))
            child.num_computed_tokens = parent.num_computed_tokens
            bm.fork(parent, child)
            live.append(child)
        elif op < 0.8 and live:
            s = rng.choice(live)
            s.token_ids.append(rng.randrange(50))
            if bm.allocate_slots(s, 1):
                bm.check_writable(s, 1)
                s.num_computed_tokens += 1
                bm.cache_blocks(s)
            else:
                s.token_ids.pop()
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.take_copies()
        bm.check_invariants(live)
    for s in live:
        bm.free(s)
    assert bm.num_used == 0
    bm.check_invariants([])
