"""SwapManager: block accounting of the host tier that preemption by swap uses (vLLM v0's swap space).

Every host block is free, held by exactly one swapped sequence, or being read by a swap-in of the step
being scheduled (freed once the step's moves are taken): free + held + releasing == num_blocks. A
sequence swapped out keeps its num_computed_tokens; its computed blocks are copied to the host and its
device blocks released as on any free, so those with a prefix hash stay cached (their hashes survive, and
so does seq.block_hashes). On swap-in, the full blocks still cached on device are reused by hash and only
the rest are copied back (BlockManager.restore).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.engine.block_manager import EVICTED, BlockManager
from minivllm.engine.hooks import StepHook
from minivllm.engine.sequence import Sequence
from minivllm.engine_config import CacheSettings

if TYPE_CHECKING:
    from minivllm.engine.scheduler import SchedulerOutput
    from minivllm.model.runner import ModelRunner


_WINDOW = 32  # recent observations each estimate is the median of


@dataclass(slots=True)
class PreemptionCosts:
    """preemption_mode=auto's two estimates: medians of the last steps' measurements. A median, not a moving
    average: a host block's first use faults its pages in (a swap 10x its usual time was seen), and one such
    step must not make swaps look dear for the next dozens of decisions."""

    prefill_s_per_token: float | None = None
    swap_s_per_block: float | None = None
    _prefill: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    _swap: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))

    def observe(self, swap_seconds: float, swap_blocks: int, forward_seconds: float, num_tokens: int,
                num_seqs: int) -> None:
        """One step: its swap copies (out and in together) and its forward. Only prefill-heavy forwards count:
        a recompute is a prefill, and a decode step's tokens cost several times a prefill's each (the weights
        are read for few tokens)."""
        if swap_blocks:
            self._swap.append(swap_seconds / swap_blocks)
            self.swap_s_per_block = statistics.median(self._swap)
        if num_tokens >= 2 * num_seqs > 0:
            self._prefill.append(forward_seconds / num_tokens)
            self.prefill_s_per_token = statistics.median(self._prefill)

    def swap_is_cheaper(self, recompute_tokens: int, swap_blocks: int) -> bool:
        """A swap is paid twice (out now, in at resume); a recompute once, as a prefill of what is lost. Until
        a prefill is measured, swap: it keeps the work done."""
        if self.prefill_s_per_token is None or self.swap_s_per_block is None:
            return True
        return 2 * swap_blocks * self.swap_s_per_block <= recompute_tokens * self.prefill_s_per_token


class SwapManager:
    """Host blocks: who holds which, and the copies owed to the runner before the next forward."""

    def __init__(self, num_blocks: int, block_bytes: int, block_manager: BlockManager) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.bm = block_manager
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        # seq_id → host block of each block of its computed tokens, in order (EVICTED: released by sink-window
        # eviction before the swap, so not moved).
        self.tables: dict[int, list[int]] = {}
        self.pending_out: list[tuple[int, int]] = []  # (device block, host block)
        self.pending_in: list[tuple[int, int]] = []  # (host block, device block)
        # Host blocks this step's swap-ins read: a swap-out later in the same schedule must not take them,
        # since the runner runs every swap-out of a step before its swap-ins.
        self.releasing: list[int] = []
        self.costs = PreemptionCosts()

    @property
    def num_used(self) -> int:
        """Host blocks held by swapped sequences."""
        return self.num_blocks - len(self.free_ids) - len(self.releasing)

    def blocks_of(self, seq: Sequence) -> int:
        """Host blocks a swap of seq takes: its blocks up to its computed tokens (later ones hold nothing kept),
        less any that sink-window eviction released."""
        return sum(1 for b in seq.block_table[:self.bm.blocks_needed(seq.num_computed_tokens)] if b != EVICTED)

    def can_swap_out(self, seq: Sequence) -> bool:
        """Whether seq has computed KV and the tier has room for all of it."""
        return 0 < self.blocks_of(seq) <= len(self.free_ids)

    def prefers_swap(self, seq: Sequence) -> bool:
        """preemption_mode=auto: whether swapping seq out and back costs less than recomputing it."""
        bs, refs, hashes = self.bm.block_size, self.bm.ref_counts, self.bm.block_hash
        # Its leading blocks that other sequences hold stay on device: readmission hits them, uncomputed.
        kept = 0
        for b in seq.block_table[:seq.num_computed_tokens // bs]:
            if b == EVICTED or refs[b] < 2 or hashes[b] is None:
                break
            kept += 1
        return self.costs.swap_is_cheaper(seq.num_computed_tokens - kept * bs, self.blocks_of(seq))

    def swap_out(self, seq: Sequence) -> None:
        """Copy seq's computed blocks to the host and release its device blocks."""
        if self.bm.sink_window is not None and seq.num_computed_tokens:
            # A victim preempted before its own allocation this step still holds blocks its window has left:
            # released now, they are neither copied out nor given fresh blocks at swap-in.
            self.bm.evict_outside_window(seq)
        table = []
        for b in seq.block_table[:self.bm.blocks_needed(seq.num_computed_tokens)]:
            table.append(EVICTED if b == EVICTED else self.free_ids.pop())
            if b != EVICTED:
                self.pending_out.append((b, table[-1]))
        self.tables[seq.seq_id] = table
        self.bm.free(seq)

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq device blocks for its computed tokens and num_new_tokens more, copying back those not
        still cached; False, changing nothing, when the pool cannot supply them."""
        host = self.tables[seq.seq_id]
        moves = self.bm.restore(seq, len(host), num_new_tokens, {i for i, h in enumerate(host) if h == EVICTED})
        if moves is None:
            return False
        self.pending_in += [(host[i], b) for i, b in moves]
        self.releasing += [h for h in self.tables.pop(seq.seq_id) if h != EVICTED]
        return True

    def free(self, seq: Sequence) -> None:
        """seq finished or was aborted while swapped: its host blocks go back."""
        self.free_ids += [h for h in self.tables.pop(seq.seq_id) if h != EVICTED]

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Hand the step's swap-outs and swap-ins to the runner; the host blocks swapped in are free after."""
        out, into = self.pending_out, self.pending_in
        self.pending_out, self.pending_in = [], []
        self.free_ids += self.releasing
        self.releasing = []
        return out, into

    def take_groups(self) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
        """The window KV groups' swaps of the step (none: one group)."""
        return []

    def check_invariants(self, swapped: Iterable[Sequence]) -> None:
        """Assert the host accounting agrees with the swapped sequences."""
        swapped = list(swapped)
        held = [b for table in self.tables.values() for b in table if b != EVICTED]
        assert len(set(held)) == len(held), "a host block held twice"
        assert not set(held) & set(self.free_ids) and not set(self.releasing) & set(self.free_ids)
        assert len(self.free_ids) + len(held) + len(self.releasing) == self.num_blocks, \
            (len(self.free_ids), len(held), len(self.releasing), self.num_blocks)
        assert set(self.tables) == {s.seq_id for s in swapped}, (sorted(self.tables), [s.seq_id for s in swapped])
        for s in swapped:
            assert not s.block_table and len(self.tables[s.seq_id]) == self.bm.blocks_needed(s.num_computed_tokens), s


class GroupedSwap(SwapManager):
    """The host tier of a model with window KV groups (kv_groups.py): this manager holds the primary group's blocks
    and one SwapManager per window group holds that group's, each with a host tier of its own; a sequence's
    blocks in every group move out and back together, or not at all."""

    def __init__(self, num_blocks: int, block_bytes: int, block_manager: BlockManager,
                 group_managers: list[SwapManager]) -> None:
        super().__init__(num_blocks, block_bytes, block_manager)
        assert block_manager.groups is not None
        self.windows = block_manager.groups
        self.group_managers = group_managers

    def _group_views(self, seq: Sequence) -> list[tuple[SwapManager, Sequence]]:
        views = self.windows.views(seq)
        return list(zip(self.group_managers, views, strict=True))  # (GroupViews, taken where a Sequence is)

    def can_swap_out(self, seq: Sequence) -> bool:
        return super().can_swap_out(seq) and all(m.blocks_of(v) <= len(m.free_ids) for m, v in self._group_views(seq))

    def swap_out(self, seq: Sequence) -> None:
        for m, v in self._group_views(seq):  # first: the primary's free releases every group's table
            m.swap_out(v)
        super().swap_out(seq)

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        pairs = [(self, seq), *self._group_views(seq)]
        for m, v in pairs:
            host = m.tables[v.seq_id]
            evicted = {i for i, h in enumerate(host) if h == EVICTED}
            if not m.bm.can_restore(v, len(host), num_new_tokens, evicted):
                return False
        for m, v in reversed(pairs):  # the groups first: the primary's restore then finds their room allocated
            ok = m.swap_in(v, num_new_tokens) if m is not self else super().swap_in(v, num_new_tokens)
            assert ok
        return True

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        for m, v in self._group_views(seq):
            m.free(v)

    def take_groups(self) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
        return [m.take() for m in self.group_managers]

    def check_invariants(self, swapped: Iterable[Sequence]) -> None:
        seqs = list(swapped)
        super().check_invariants(seqs)
        for g, m in enumerate(self.group_managers):
            m.check_invariants([self.windows.views(s)[g] for s in seqs])


def build_swap_manager(cache: CacheSettings, runner: ModelRunner, block_manager: BlockManager) -> SwapManager | None:
    """The host tier for preemption_mode swap or auto (None with recompute), sized from swap_space (split among
    the KV groups in proportion to their pools)."""
    if cache.preemption_mode == "recompute":
        return None
    swap_bytes = cache.swap_space
    groups = runner.num_kv_groups
    pool_bytes = [runner.group_block_bytes(g) * runner.group_pools[g][0].shape[2] for g in range(groups)]
    tiers = []
    for g in range(groups):
        block_bytes = runner.group_block_bytes(g)
        num_blocks = int(swap_bytes * pool_bytes[g] / sum(pool_bytes)) // block_bytes
        if num_blocks < 1:
            where = f" of KV group {g} (one per attention window)" if groups > 1 else ""
            raise ValueError(f"swap_space: {swap_bytes} bytes cannot hold one KV block{where} ("
                             f"{block_bytes} bytes: {block_manager.block_size} tokens of K and V); raise it")
        tiers.append((num_blocks, block_bytes, runner.init_swap(num_blocks, cache.swap_dir, g)))
    (num_blocks, block_bytes, seconds_per_block), *rest = tiers
    if block_manager.groups is None:
        swap = SwapManager(num_blocks, block_bytes, block_manager)
    else:
        swap = GroupedSwap(num_blocks, block_bytes, block_manager,
                           [SwapManager(n, b, bm) for (n, b, _), bm in zip(rest, block_manager.groups.managers,
                                                                            strict=True)])
    swap.costs.observe(seconds_per_block, 1, 0.0, 0, 0)
    return swap


class SwapCostHook(StepHook):
    """preemption_mode auto's cost model learns from every measured step (engine/hooks.py): the step's swap time
    per block moved and its forward time per token."""

    def __init__(self, swap: SwapManager) -> None:
        self.swap = swap

    def after_forward(self, sched: SchedulerOutput, forward_s: float, moves_s: float, first: bool) -> None:
        # (first steps too: nearly every prefill step is the first of its size, and the model learns from those)
        self.swap.costs.observe(moves_s, len(sched.swap_out) + len(sched.swap_in), forward_s,
                                sched.num_batched_tokens, len(sched.scheduled))
