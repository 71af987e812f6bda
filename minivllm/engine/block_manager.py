"""BlockManager: the only owner of KV block accounting.

Every block is in exactly one state: free (no reusable content), used (ref count > 0), or cached
(ref count 0 but holding a full block whose hash is registered, kept for prefix hits and evicted in
LRU order when a free block is needed). free + used + cached == num_blocks at all times.

With sink-window eviction (--kv-eviction sink-window, StreamingLLM) a running sequence's blocks that lie
wholly between its attention sinks and its recent window are released as it advances; their block-table
entries become EVICTED, which attention never reads (every token's keys are the sinks and the window). The same
rule, without sinks, is how the blocks of sliding-window layers go (a model whose layers all have one window, or
the window groups of kv_groups.py beside the full-attention layers' blocks).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from minivllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from minivllm.engine.kv_groups import WindowGroups

EVICTED = -1  # a block-table entry whose block was released by sink-window eviction


def hash_block(parent: bytes, tokens: list[int]) -> bytes:
    """Chained content hash of one full block: identical prefixes give identical chains."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    """Paged KV blocks: allocation, ref counts, prefix caching with LRU retention, copy-on-write."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sink_window: tuple[int, int] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently freed first
        self.hash_to_block: dict[bytes, int] = {}
        self.registered: dict[int, int] = {}  # seq_id → leading full blocks already hashed/registered
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies owed before the next forward
        self.num_used = 0
        # Sink-window eviction: blocks holding any of the first sink tokens are kept; a later block goes once
        # no upcoming token's window reaches it. evicted_upto: seq_id → logical blocks already considered.
        self.sink_window = sink_window
        self.evicted_upto: dict[int, int] = {}
        self.num_evicted_blocks = 0  # since start (a metric)
        # The blocks of the sliding-window layers of a model that also has full-attention ones (Gemma): pools and
        # tables of their own, kept in step with this manager's (kv_groups.py). None: one group, this one.
        self.groups: WindowGroups | None = None

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return len(self.free_ids) + len(self.evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def _ensure_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else seq.cache_salt, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, seq: Sequence, limit: int | None = None) -> list[int]:
        """The longest prefix of seq's full blocks whose KV is cached, as its blocks (at most `limit`); with window
        groups, cut to what every group has cached too.

        Never the whole sequence: the last token is always recomputed because its logits are needed. Under a window
        (sink-window eviction, sliding-window layers) only the blocks the next token still attends to (and the sink
        blocks) must be cached: those before are EVICTED entries of the hit.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if limit is not None:
            max_blocks = min(max_blocks, limit)
        ids = [self.hash_to_block.get(h) for h in self._ensure_hashes(seq, max_blocks)[:max_blocks]]
        if self.sink_window is None:
            hits = []
            for b in ids:
                if b is None:
                    break
                hits.append(b)
        else:
            hits = self._window_hits(ids)
        if self.groups is not None and hits:
            hits = hits[:self.groups.computed_blocks(seq, len(hits))]
        return hits

    def _window_hits(self, ids: list[int | None]) -> list[int]:
        """The longest hit whose needed blocks are all cached (ids: each full block's cached block, or None)."""
        sink_blocks = -(-self.sink_window[0] // self.block_size)  # type: ignore[index]
        best, run = 0, 0
        for n in range(1, len(ids) + 1):
            run = run + 1 if ids[n - 1] is not None else 0
            if n <= sink_blocks and run < n:
                break  # a sink block is missing: no longer hit can have it
            first, stop = self._out_of_window(n * self.block_size)
            if run >= n - max(first, stop):
                best = n
        first, stop = self._out_of_window(best * self.block_size)
        return [EVICTED if first <= i < stop else ids[i] for i in range(best)]  # type: ignore[misc]

    # ---- allocation ----------------------------------------------------------------------------
    def _pop_free(self) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        b, _ = self.evictable.popitem(last=False)
        del self.hash_to_block[self.block_hash[b]]  # type: ignore[arg-type]
        self.block_hash[b] = None
        return b

    def _incref(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            self.evictable.pop(b, None)
            self.num_used += 1
        self.ref_counts[b] += 1

    def _decref(self, b: int) -> None:
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            self.num_used -= 1
            if self.block_hash[b] is not None:
                self.evictable[b] = None
            else:
                self.free_ids.append(b)

    def _plan(self, seq: Sequence, num_new_tokens: int, computed: list[int]) -> tuple[int, bool, range, bool]:
        """What allocate_slots would do: (new blocks, copy-on-write, prefix-hit indices left EVICTED, fits)."""
        bs = self.block_size
        num_computed = seq.num_computed_tokens + len(computed) * bs
        have = len(seq.block_table) + len(computed)
        # Prefix hits that no upcoming token's window reaches are not taken (sink-window eviction): their
        # table entries are EVICTED from the start, so a long cached prefix costs only sinks + window.
        skip = range(0)
        if self.sink_window is not None and computed:
            first, stop = self._out_of_window(num_computed)
            skip = range(max(first, len(seq.block_table)), stop)
        taken = [b for i, b in enumerate(computed, len(seq.block_table)) if i not in skip]
        new = max(0, self.blocks_needed(num_computed + num_new_tokens) - have)
        cow = (num_new_tokens > 0 and num_computed % bs != 0 and not computed
               and self.ref_counts[seq.block_table[num_computed // bs]] > 1)
        reserved = sum(1 for b in taken if self.ref_counts[b] == 0)  # touched, so no longer evictable
        return new, cow, skip, new + cow <= self.num_free_blocks - reserved

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Whether allocate_slots would succeed (changes nothing but evicting blocks no window reaches)."""
        if self.sink_window is not None and seq.num_computed_tokens:
            self.evict_outside_window(seq)
        return self._plan(seq, num_new_tokens, computed_blocks or [])[3]

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make seq's block table cover num_new_tokens more tokens (after any prefix-hit blocks), in every window
        group too.

        Returns False, changing nothing, when the pool (or a group's) cannot supply the blocks. Copies the
        last block first (copy-on-write) when the new tokens would land in a block shared with another
        sequence.
        """
        computed = computed_blocks or []
        if self.sink_window is not None and seq.num_computed_tokens:
            self.evict_outside_window(seq)
        bs = self.block_size
        new, cow, skip, fits = self._plan(seq, num_new_tokens, computed)
        if not fits or (self.groups is not None and not self.groups.can_allocate(seq, num_new_tokens, len(computed))):
            return False
        num_computed = seq.num_computed_tokens + len(computed) * bs
        for i, b in enumerate(computed, len(seq.block_table)):
            if i in skip:
                seq.block_table.append(EVICTED)
            else:
                self._incref(b)
                seq.block_table.append(b)
        if computed:
            self.registered[seq.seq_id] = len(computed)
        if skip:
            self.evicted_upto[seq.seq_id] = max(skip.stop, self.evicted_upto.get(seq.seq_id, 0))
        if cow:
            i = num_computed // bs
            old, fresh = seq.block_table[i], self._pop_free()
            self._incref(fresh)
            self._decref(old)
            seq.block_table[i] = fresh
            self.pending_copies.append((old, fresh))
        for _ in range(new):
            b = self._pop_free()
            self._incref(b)
            seq.block_table.append(b)
        if self.groups is not None:
            self.groups.allocate(seq, num_new_tokens, len(computed))
        return True

    def evict_outside_window(self, seq: Sequence) -> None:
        """Release seq's blocks that neither hold a sink token nor reach into the window of its next token
        (position num_computed_tokens sees keys from num_computed_tokens - window + 1). A released block with a
        registered hash stays cached for prefix hits: under one engine-wide attention rule its KV is the
        same for any sequence with that prefix."""
        first, stop = self._out_of_window(seq.num_computed_tokens)
        i = max(first, self.evicted_upto.get(seq.seq_id, 0))
        table = seq.block_table
        while i < stop:
            b = table[i]
            if b != EVICTED:
                self._decref(b)
                table[i] = EVICTED
                self.num_evicted_blocks += 1
            i += 1
        if stop > first:
            self.evicted_upto[seq.seq_id] = max(i, self.evicted_upto.get(seq.seq_id, 0))

    def _out_of_window(self, num_computed: int) -> tuple[int, int]:
        """Logical blocks [first, stop) that hold no sink token and that no token from position num_computed on
        attends to (its keys start at num_computed - window + 1)."""
        assert self.sink_window is not None
        sinks, window = self.sink_window
        return -(-sinks // self.block_size), (num_computed - window + 1) // self.block_size

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks; tail blocks first so the LRU evicts a prefix's tail before its head."""
        for b in reversed(seq.block_table):
            if b != EVICTED:
                self._decref(b)
        seq.block_table = []
        self.registered.pop(seq.seq_id, None)
        self.evicted_upto.pop(seq.seq_id, None)
        if self.groups is not None:
            self.groups.free(seq)

    def _restore_plan(self, seq: Sequence, num_blocks: int, num_new_tokens: int, evicted: Collection[int]
                      ) -> tuple[dict[int, int], list[int], bool]:
        """What restore would do: (index → cached block reused, indices given fresh blocks, fits)."""
        full = seq.num_computed_tokens // self.block_size
        reuse: dict[int, int] = {}
        if self.enable_prefix_caching:
            for i, h in enumerate(self._ensure_hashes(seq, full)[:full]):
                if i not in evicted and (b := self.hash_to_block.get(h)) is not None:
                    reuse[i] = b
        fresh = [i for i in range(num_blocks) if i not in reuse and i not in evicted]
        new = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - num_blocks
        reserved = sum(1 for b in reuse.values() if self.ref_counts[b] == 0)  # touched, so no longer evictable
        return reuse, fresh, len(fresh) + new <= self.num_free_blocks - reserved

    def can_restore(self, seq: Sequence, num_blocks: int, num_new_tokens: int, evicted: Collection[int] = ()
                    ) -> bool:
        """Whether restore would succeed (changes nothing)."""
        return self._restore_plan(seq, num_blocks, num_new_tokens, evicted)[2]

    def restore(self, seq: Sequence, num_blocks: int, num_new_tokens: int, evicted: Collection[int] = ()
                ) -> list[tuple[int, int]] | None:
        """Give a sequence coming back from the host tier a block table of num_blocks blocks (its computed
        tokens), plus room for num_new_tokens more; the indices in `evicted` (released by sink-window eviction
        before it left) stay EVICTED. Its full blocks whose hash is still cached are reused as they are; the
        others are fresh. Returns (index, block) of the fresh ones (their KV is to be copied back), or None,
        changing nothing, when the pool cannot supply the blocks."""
        assert not seq.block_table
        reuse, fresh, fits = self._restore_plan(seq, num_blocks, num_new_tokens, evicted)
        if not fits:
            return None
        for b in reuse.values():  # first, so that no fresh block is taken by evicting one of them
            self._incref(b)
        table = [reuse.get(i, EVICTED) for i in range(num_blocks)]
        for i in fresh:
            table[i] = self._pop_free()
            self._incref(table[i])
        seq.block_table = table
        # Restored full blocks register their hashes again (their KV is copied in before the next forward).
        self.registered.pop(seq.seq_id, None)
        self.cache_blocks(seq)
        moves = [(i, table[i]) for i in fresh]  # before allocate_slots, which may evict out-of-window entries
        ok = self.allocate_slots(seq, num_new_tokens)
        assert ok  # room was counted above; the last block is fresh or full, so no copy-on-write
        return moves

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of parent's blocks with child (ref counts); writes diverge by copy-on-write."""
        assert not child.block_table
        for b in parent.block_table:
            if b != EVICTED:
                self._incref(b)
        child.block_table = list(parent.block_table)
        if parent.seq_id in self.registered:
            self.registered[child.seq_id] = self.registered[parent.seq_id]
        if parent.seq_id in self.evicted_upto:
            self.evicted_upto[child.seq_id] = self.evicted_upto[parent.seq_id]
        if self.groups is not None:
            self.groups.fork(parent, child)

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks that became full (and computed) so later requests can hit them."""
        if self.groups is not None:
            self.groups.cache_blocks(seq)
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self.registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._ensure_hashes(seq, num_full)
        for i in range(start, num_full):
            h, b = hashes[i], seq.block_table[i]
            if b == EVICTED:
                continue
            # A duplicate of an already-registered block stays unhashed and is freed, not cached.
            if h not in self.hash_to_block and self.block_hash[b] is None:
                self.hash_to_block[h] = b
                self.block_hash[b] = h
        self.registered[seq.seq_id] = num_full

    def take_copies(self) -> list[tuple[int, int]]:
        """Hand the owed copy-on-write copies to the runner."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached (unreferenced) block, e.g. between benchmark runs."""
        for b in list(self.evictable):
            del self.hash_to_block[self.block_hash[b]]  # type: ignore[arg-type]
            self.block_hash[b] = None
            self.free_ids.append(b)
        self.evictable.clear()

    # ---- invariants ----------------------------------------------------------------------------
    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Assert the accounting is consistent with the live sequences' block tables."""
        refs = Counter(b for s in live for b in s.block_table if b != EVICTED)
        used = sum(1 for r in self.ref_counts if r > 0)
        assert used == self.num_used, (used, self.num_used)
        assert len(self.free_ids) + len(self.evictable) + used == self.num_blocks, \
            (len(self.free_ids), len(self.evictable), used, self.num_blocks)
        for b in range(self.num_blocks):
            assert self.ref_counts[b] == refs.get(b, 0), f"block {b}: ref {self.ref_counts[b]} != {refs.get(b, 0)}"
        assert not set(self.free_ids) & set(self.evictable)
        assert all(self.ref_counts[b] == 0 and self.block_hash[b] is not None for b in self.evictable)
        assert all(self.ref_counts[b] == 0 and self.block_hash[b] is None for b in self.free_ids)
        assert all(self.block_hash[b] == h for h, b in self.hash_to_block.items())
        if self.groups is not None:
            self.groups.check_invariants(live)

    def check_writable(self, seq: Sequence, num_new_tokens: int) -> None:
        """Assert the blocks seq will write this step are not shared (copy-on-write happened)."""
        bs = self.block_size
        first, last = seq.num_computed_tokens // bs, (seq.num_computed_tokens + num_new_tokens - 1) // bs
        for b in seq.block_table[first:last + 1]:
            assert b != EVICTED, f"{seq.request_id}: writing an evicted block"
            assert self.ref_counts[b] == 1, f"{seq.request_id}: writing shared block {b} (ref {self.ref_counts[b]})"
            assert self.block_hash[b] is None, f"{seq.request_id}: writing cached block {b}"
        if self.groups is not None:
            self.groups.check_writable(seq, num_new_tokens)
