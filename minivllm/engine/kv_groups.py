"""KV cache groups: the layers of one attention window share a block table and a pool.

A model whose layers all see the whole context (Llama) has one group. One whose layers all have one window
(Mistral) has one group whose blocks go as the window passes them (the BlockManager's window rule). A model that
mixes them (Gemma 2: alternating; Gemma 3: five sliding-window layers to one global) has a group per window: the
global layers keep every block, the sliding-window layers keep only their window, so a long Gemma 3 sequence
holds what its global layers need and a window's worth for the rest (vLLM's hybrid KV cache manager, with a pool
per group as llama.cpp's separate SWA cache has).

The primary group (the full-attention layers') is the engine's BlockManager as before; the other groups are
BlockManagers of their own, kept in step by it through `WindowGroups`: every allocation, prefix hit, fork, free
and invariant check of a sequence applies to each group's table of that sequence (a GroupView). A prefix hit is
as long as every group can serve: the window groups need only the blocks the next token still attends to.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence
from minivllm.engine_config import EngineConfig
from minivllm.model.models import attention_windows, kv_windows


class GroupView:
    """A sequence as one window group's BlockManager sees it: a block table of its own, the rest the sequence's."""

    __slots__ = ("seq", "block_table")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.block_table: list[int] = []

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def block_hashes(self) -> list[bytes]:
        return self.seq.block_hashes  # the same content hashes in every group

    @property
    def cache_salt(self) -> bytes:
        return self.seq.cache_salt


class WindowGroups:
    """The window groups beside the primary BlockManager (see the module doc)."""

    def __init__(self, managers: list[BlockManager]) -> None:
        self.managers = managers
        self._hits: dict[int, list[list[int]]] = {}  # seq_id → each group's prefix hit, for the allocation after

    def views(self, seq: Sequence) -> tuple[Any, ...]:
        """seq's table in each group (made on first use): GroupViews, which a group's BlockManager takes where it
        takes a Sequence (duck-typed: it reads only what a GroupView forwards, hence `Any`)."""
        if not seq.kv_views:
            seq.kv_views = tuple(GroupView(seq) for _ in self.managers)
        return seq.kv_views

    def tables(self, seq: Sequence) -> tuple[list[int], ...]:
        """seq's block table in each group, for the runner."""
        return tuple(v.block_table for v in self.views(seq))

    def computed_blocks(self, seq: Sequence, limit: int) -> int:
        """How many of the primary group's prefix-hit blocks every group can serve as well (at most limit); each
        group's hit is kept for the allocation that follows."""
        n = limit
        while True:
            hits = [bm.get_computed_blocks(v, limit=n) for bm, v in zip(self.managers, self.views(seq), strict=True)]
            shortest = min(len(h) for h in hits)
            if shortest == n:
                self._hits[seq.seq_id] = hits
                return n
            n = shortest  # a shorter hit needs other window blocks: ask every group again

    def _group_hits(self, seq: Sequence, num_hit_blocks: int) -> list[list[int]]:
        if not num_hit_blocks:
            return [[] for _ in self.managers]
        hits = self._hits[seq.seq_id]
        assert all(len(h) >= num_hit_blocks for h in hits), "a prefix hit the window groups were not asked about"
        return [h[:num_hit_blocks] for h in hits]

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int) -> bool:
        """Whether every group can supply what seq's allocation needs."""
        hits = self._group_hits(seq, num_hit_blocks)
        return all(bm.can_allocate(v, num_new_tokens, h)
                   for bm, v, h in zip(self.managers, self.views(seq), hits, strict=True))

    def allocate(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int) -> None:
        """seq's allocation in every group (can_allocate said they all fit)."""
        hits = self._group_hits(seq, num_hit_blocks)
        self._hits.pop(seq.seq_id, None)
        for bm, v, h in zip(self.managers, self.views(seq), hits, strict=True):
            ok = bm.allocate_slots(v, num_new_tokens, h)
            assert ok

    def free(self, seq: Sequence) -> None:
        self._hits.pop(seq.seq_id, None)
        for bm, v in zip(self.managers, self.views(seq), strict=True):
            bm.free(v)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for bm, p, c in zip(self.managers, self.views(parent), self.views(child), strict=True):
            bm.fork(p, c)

    def cache_blocks(self, seq: Sequence) -> None:
        for bm, v in zip(self.managers, self.views(seq), strict=True):
            bm.cache_blocks(v)

    def take_copies(self) -> list[list[tuple[int, int]]]:
        """Each group's owed copy-on-write copies."""
        return [bm.take_copies() for bm in self.managers]

    def check_writable(self, seq: Sequence, num_new_tokens: int) -> None:
        for bm, v in zip(self.managers, self.views(seq), strict=True):
            bm.check_writable(v, num_new_tokens)

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        seqs = list(live)
        for g, bm in enumerate(self.managers):
            bm.check_invariants([self.views(s)[g] for s in seqs])

    @property
    def num_used(self) -> int:
        """Blocks in use across the groups."""
        return sum(bm.num_used for bm in self.managers)


@dataclass(frozen=True, slots=True)
class KVGroupsPlan:
    """The KV groups of a model: per group its window (None: full attention), layers and pool size in blocks.
    Group 0 is the primary group (the full-attention layers', or the one window's)."""

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]
    num_blocks: tuple[int, ...]

    @property
    def group_blocks(self) -> tuple[int, ...] | None:
        """The runner's pools per group (None: one pool for every layer)."""
        return self.num_blocks if len(self.windows) > 1 else None

    def primary_window(self, sink_window: tuple[int, int] | None) -> tuple[int, int] | None:
        """(sinks, window) of the primary group's blocks: sink-window eviction's, or the window every layer has."""
        return sink_window or ((0, self.windows[0]) if self.windows[0] is not None else None)

    def block_manager(self, block_size: int, prefix_caching: bool, sink_window: tuple[int, int] | None
                      ) -> BlockManager:
        """The engine's BlockManager (the primary group's), with the window groups beside it."""
        bm = BlockManager(self.num_blocks[0], block_size, prefix_caching, self.primary_window(sink_window))
        if len(self.windows) > 1:
            bm.groups = WindowGroups([BlockManager(nb, block_size, prefix_caching, (0, w))  # type: ignore[arg-type]
                                      for w, nb in zip(self.windows[1:], self.num_blocks[1:], strict=True)])
        return bm

    def sequence_block_cap(self, sink_window: tuple[int, int] | None, token_budget: int, block_size: int
                           ) -> int | None:
        """With a window on every layer (sink-window eviction, or a model whose layers all slide), the most
        blocks one sequence holds at once: its sink blocks, and its window plus a step's chunk (which may
        straddle one more block); None otherwise (it holds all its tokens)."""
        window = self.primary_window(sink_window)
        if window is None:
            return None
        sinks, size = window
        return -(-sinks // block_size) + -(-(size - 1 + token_budget) // block_size) + 1

    def tokens_held(self, seq_len: int, block_size: int) -> dict[str, Any]:
        """KV tokens one sequence of seq_len tokens holds, layer by layer, against full attention in every layer."""
        held = sum(len(layers) * (seq_len if w is None else min(seq_len, block_size * (-(-(w - 1) // block_size) + 1)))
                   for w, layers in zip(self.windows, self.layers, strict=True))
        full = seq_len * sum(len(layers) for layers in self.layers)
        return {"layer_tokens_held": held, "layer_tokens_full_attention": full, "ratio": held / full}


def plan_for_engine(config: EngineConfig) -> KVGroupsPlan:
    """The engine's KV groups: the model's windows (or sink-window eviction's on every layer; none for the ablation
    baselines, which keep whole sequences; none where a window is no shorter than max_model_len), its budget split
    among them."""
    mc, c = config.model_config, config.cache
    windows = attention_windows(mc) if c.sink_window is None else (c.sink_window[1],) * mc.num_layers
    windows = kv_windows(windows, config.model.max_model_len)
    if c.kv_cache_mode != "paged":
        windows = (None,) * mc.num_layers
    per_token = mc.kv_bytes_per_token(config.model.dtype, config.parallel.size, c.kv_cache_dtype)  # one rank's
    return plan_kv_groups(windows, c.kv_cache_bytes, c.block_size, per_token // mc.num_layers,
                          config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens, c.num_kv_blocks)


def plan_kv_groups(layer_windows: tuple[int | None, ...], budget_bytes: int, block_size: int,
                   bytes_per_layer_token: int, max_num_seqs: int, token_budget: int,
                   num_kv_blocks: int | None = None) -> KVGroupsPlan:
    """Split the KV budget into per-window pools.

    With one group, every block is the budget over its bytes. With window groups beside the full one, the window
    pools are sized for S sequences, each holding its window (plus a block being written), and a step's prefill
    chunk on top; S is where both kinds of pool run out together for sequences as long as the largest window
    (at most max_num_seqs). Past that length a sequence's window blocks stay put while its full-attention blocks
    grow, which is the memory the groups save. With num_kv_blocks (tests) the primary pool has that many blocks.
    """
    windows = list(dict.fromkeys(layer_windows))
    windows.sort(key=lambda w: (w is not None, w or 0))  # full attention first
    layers = tuple(tuple(i for i, w in enumerate(layer_windows) if w == g) for g in windows)
    block_bytes = [block_size * bytes_per_layer_token * len(ls) for ls in layers]
    if len(windows) == 1:
        nb = num_kv_blocks if num_kv_blocks else budget_bytes // block_bytes[0]
        return KVGroupsPlan(tuple(windows), layers, (_at_least_one(nb, budget_bytes, block_bytes[0]),))
    window_caps = [-(-(w - 1) // block_size) + 2 for w in windows[1:]]  # type: ignore[operator]
    slack = -(-token_budget // block_size) + 1  # a step's prefill chunk beyond the window, straddling a block
    longest = max(w for w in windows if w is not None)
    primary_per_seq = -(-longest // block_size)
    if num_kv_blocks:
        seqs = max(1, min(max_num_seqs, num_kv_blocks // primary_per_seq))
        extra = [seqs * cap + slack for cap in window_caps]
        return KVGroupsPlan(tuple(windows), layers, (num_kv_blocks, *extra))
    per_seq = primary_per_seq * block_bytes[0] + sum(c * b for c, b in zip(window_caps, block_bytes[1:], strict=True))
    fixed = slack * sum(block_bytes[1:])
    seqs = max(1, min(max_num_seqs, (budget_bytes - fixed) // per_seq))
    extra = [seqs * cap + slack for cap in window_caps]
    rest = budget_bytes - sum(n * b for n, b in zip(extra, block_bytes[1:], strict=True))
    return KVGroupsPlan(tuple(windows), layers, (_at_least_one(rest // block_bytes[0], budget_bytes, block_bytes[0]),
                                                 *extra))


def _at_least_one(num_blocks: int, budget_bytes: int, block_bytes: int) -> int:
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory: {budget_bytes} bytes hold no block of {block_bytes} bytes (all layers' K "
                         "and V for block_size tokens); raise kv_cache_memory or lower block_size")
    return int(num_blocks)

