"""The runner's inputs: per step, one SequenceInput per scheduled sequence (plain data: the model knows no requests;
the engine knows from each how many logits rows the runner returns for it); persistent, the per-slot sampling state,
the sampler's half of vLLM v1's input batch (InputBatch).

A sequence takes a slot the first time it is sampled and keeps it (across preemptions) until it
finishes. Its settings are written once; per step only what changed is written: the sampled token of
each penalty row (appended to that row's token store, so penalty counts are never rebuilt from the
sequence) and the countdown of rows that ban EOS / stop ids before min_tokens. A step names its rows as
a list of slots; the settings of those rows are read with one gather per field, and that view is kept
while the step's slots and the batch stay the same (a steady decode rebuilds nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(slots=True)
class SequenceInput:
    """What the runner needs of one scheduled sequence (plain data; the model knows no requests)."""

    token_ids: list[int]  # tokens to compute this step
    start_pos: int  # position of token_ids[0] == tokens already in the cache
    block_table: list[int]  # covers start_pos + len(token_ids) tokens
    sample: bool  # whether the logits of the last token are wanted
    all_logits: bool = False  # logits of every token of the chunk (prompt logprobs), not just the last
    lora: int = -1  # LoRA slot of its adapter (-1: the base model)
    group_tables: tuple[list[int], ...] = ()  # its block tables in the window KV groups after the first

    @property
    def num_logits_rows(self) -> int:
        """The logits rows execute returns for it: every token's (all_logits), the last one's (sample), or none."""
        return len(self.token_ids) if self.all_logits else int(self.sample)


@dataclass(slots=True)
class SlotParams:
    """What the sampler needs of one sequence (plain data; the model layer knows no requests)."""

    temperature: float = 0.0  # 0 → greedy
    top_k: int = -1  # -1 → off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    num_logprobs: int | None = None  # top-N to report, None → no logprobs
    min_tokens: int = 0
    early_banned: tuple[int, ...] = ()  # ids the row may not produce before min_tokens outputs (EOS, stop ids)
    generator: torch.Generator | None = None  # the sequence's own seeded stream, else the sampler's

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(slots=True)
class StepRows:
    """One step's rows as the sampler reads them: per-row settings as tensors, and the few row lists
    that need Python (seeded generators, logprob counts)."""

    slots: torch.Tensor  # [R] the rows' slots
    temperature: torch.Tensor  # [R] float32, 0 for greedy rows
    top_k: torch.Tensor  # [R] int64
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    random_rows: list[int]  # rows with temperature > 0
    seeded: list[tuple[int, torch.Generator]]  # (row, its generator), rows among random_rows
    logprob_rows: list[int]
    logprob_nums: list[int]
    penalty_rows: torch.Tensor  # [P] rows with a penalty
    penalty_store: torch.Tensor  # [P] their rows in the penalty token store
    presence: torch.Tensor  # [R] float32 (read at penalty rows only)
    frequency: torch.Tensor
    repetition: torch.Tensor
    any_repetition: bool
    early: list[tuple[int, int]]  # (row, slot) of rows that ban ids this step (filled per step)


@dataclass(slots=True)
class VerifySettings:
    """A slot's settings as speculative verification reads them (one sequence, a few rows)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    # (output-token counts [V], prompt tokens seen [V] bool, repetition, frequency, presence), or None: no penalties
    penalties: tuple[torch.Tensor, torch.Tensor, float, float, float] | None


class InputBatch:
    """Per-slot sampling settings and penalty token stores, grown on demand and updated by diffs."""

    def __init__(self, initial_slots: int = 64) -> None:
        self._cap = 0
        self._free: list[int] = []
        self._generators: list[torch.Generator | None] = []
        self._num_logprobs: list[int | None] = []
        self._store_row: list[int] = []  # slot → row in the penalty token store, -1 if none
        self._early: dict[int, list] = {}  # slot → [outputs left before min_tokens, banned ids]
        self._floats = torch.zeros(len(_FLOATS), 0)
        self._top_k = torch.zeros(0, dtype=torch.int64)
        # Penalty token store: prompt then output ids of each penalised sequence, row-major.
        self._tokens = torch.zeros(0, 256, dtype=torch.int64)
        self._len = torch.zeros(0, dtype=torch.int64)
        self._prompt_len = torch.zeros(0, dtype=torch.int64)
        self._store_free: list[int] = []
        self.version = 0  # bumped by add/remove: cached step views are valid for one version
        self._view_key: tuple[int, tuple[int, ...]] | None = None
        self._view: StepRows | None = None
        self._grow(initial_slots)

    # ---- membership ----------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        """Slots in use."""
        return self._cap - len(self._free)

    def add(self, params: SlotParams, prompt_ids: list[int], output_ids: list[int]) -> int:
        """Give a sequence a slot with its settings (and its tokens so far, if it is penalised)."""
        if not self._free:
            self._grow(2 * self._cap)
        slot = self._free.pop()
        for f, name in enumerate(_FLOATS):
            self._floats[f, slot] = getattr(params, name)
        self._top_k[slot] = params.top_k
        self._generators[slot] = params.generator
        self._num_logprobs[slot] = params.num_logprobs
        if params.min_tokens > len(output_ids) and params.early_banned:
            self._early[slot] = [params.min_tokens - len(output_ids), list(params.early_banned)]
        self._store_row[slot] = self._store(prompt_ids, output_ids) if params.has_penalties else -1
        self.version += 1
        return slot

    def remove(self, slot: int) -> None:
        """Free a finished sequence's slot."""
        row = self._store_row[slot]
        if row >= 0:
            self._store_free.append(row)
            self._store_row[slot] = -1
        self._generators[slot] = None
        self._early.pop(slot, None)
        self._free.append(slot)
        self.version += 1

    def _grow(self, cap: int) -> None:
        extra = cap - self._cap
        self._floats = torch.cat([self._floats, torch.zeros(len(_FLOATS), extra)], 1)
        self._top_k = torch.cat([self._top_k, torch.full((extra,), -1, dtype=torch.int64)])
        self._generators += [None] * extra
        self._num_logprobs += [None] * extra
        self._store_row += [-1] * extra
        self._free += range(cap - 1, self._cap - 1, -1)  # lowest slot handed out first
        self._cap = cap

    def _store(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        """A penalty store row holding prompt_ids + output_ids."""
        if not self._store_free:
            n, m = self._tokens.shape
            grow = max(n, 8)
            self._tokens = torch.cat([self._tokens, torch.zeros(grow, m, dtype=torch.int64)])
            self._len = torch.cat([self._len, torch.zeros(grow, dtype=torch.int64)])
            self._prompt_len = torch.cat([self._prompt_len, torch.zeros(grow, dtype=torch.int64)])
            self._store_free += range(n + grow - 1, n - 1, -1)
        row = self._store_free.pop()
        ids = prompt_ids + output_ids
        self._reserve(len(ids) + 1)
        self._tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        self._len[row] = len(ids)
        self._prompt_len[row] = len(prompt_ids)
        return row

    def _reserve(self, width: int) -> None:
        n, m = self._tokens.shape
        if width > m:
            self._tokens = torch.cat([self._tokens, torch.zeros(n, max(width, 2 * m) - m, dtype=torch.int64)], 1)

    # ---- one step ------------------------------------------------------------------------------
    def rows(self, slots: list[int]) -> StepRows:
        """The settings of a step's rows (slots in row order); the per-step part (min_tokens bans) fresh."""
        key = (self.version, tuple(slots))
        view = self._view
        if view is None or key != self._view_key:
            view = self._view = self._gather(slots)
            self._view_key = key
        if self._early:
            early = self._early
            view.early = [(j, s) for j, s in enumerate(slots) if s in early]
        else:
            view.early = []
        return view

    def _gather(self, slots: list[int]) -> StepRows:
        idx = torch.tensor(slots, dtype=torch.int64)
        f = self._floats[:, idx]
        temp = f[0]
        random_rows = (temp > 0).nonzero().flatten().tolist()
        gens = self._generators
        seeded = [(j, g) for j in random_rows if (g := gens[slots[j]]) is not None]
        nums = self._num_logprobs
        lp_rows = [j for j, s in enumerate(slots) if nums[s] is not None]
        store = torch.tensor([self._store_row[s] for s in slots], dtype=torch.int64)
        pen_rows = (store >= 0).nonzero().flatten()
        rep = f[5]
        return StepRows(idx, temp.contiguous(), self._top_k[idx], f[1].contiguous(), f[2].contiguous(), random_rows,
                        seeded, lp_rows, [nums[slots[j]] or 0 for j in lp_rows], pen_rows, store[pen_rows],
                        f[3].contiguous(), f[4].contiguous(), rep.contiguous(), bool((rep[pen_rows] != 1).any()), [])

    def banned(self, rows: StepRows) -> list[tuple[int, list[int]]]:
        """(row, ids) each row may not produce this step."""
        return [(j, self._early[s][1]) for j, s in rows.early]

    def apply_penalties(self, x: torch.Tensor, rows: StepRows) -> None:
        """Repetition (prompt and output tokens, HF's rule), then frequency and presence (output tokens,
        OpenAI's rule), in place on the penalised rows of x [R, V]. Sparse: only the entries of tokens a
        row has seen are read and written, from its token store (no [rows, vocab] count tensor)."""
        if not len(rows.penalty_rows):
            return
        vocab, dev = x.shape[1], x.device
        store = rows.penalty_store
        lens, plen = self._len[store], self._prompt_len[store]
        width = int(lens.max())
        toks = self._tokens[store, :width]
        pos = torch.arange(width)[None, :]
        flat = rows.penalty_rows[:, None] * vocab + toks
        xf = x.view(-1)
        if rows.any_repetition:
            seen = torch.unique(flat[pos < lens[:, None]]).to(dev)
            rep = rows.repetition.to(dev)[seen // vocab]
            v = xf[seen]
            xf[seen] = torch.where(v > 0, v / rep, v * rep)
        out = flat[(pos >= plen[:, None]) & (pos < lens[:, None])]
        if out.numel():
            ids, counts = torch.unique(out, return_counts=True)
            ids, row = ids.to(dev), (ids // vocab).to(dev)
            xf[ids] = xf[ids] - rows.frequency.to(dev)[row] * counts.to(dev, torch.float32) - rows.presence.to(dev)[row]

    def greedy_unpenalized(self, slots: list[int]) -> list[bool]:
        """For each slot: whether its verification is a plain greedy comparison (temperature 0, no penalties), which
        StepSampler runs for all such slots in one argmax."""
        temps = self._floats[0, slots].tolist()
        return [t == 0.0 and self._store_row[s] < 0 for t, s in zip(temps, slots, strict=True)]

    def verify_settings(self, slot: int, vocab: int) -> VerifySettings:
        """What verifying a slot's proposals needs: its sampling settings and, if penalised, its token counts."""
        temp, top_p, min_p, presence, frequency, repetition = self._floats[:, slot].tolist()
        penalties = None
        row = self._store_row[slot]
        if row >= 0:
            n, plen = int(self._len[row]), int(self._prompt_len[row])
            toks = self._tokens[row, :n]
            counts = torch.bincount(toks[plen:], minlength=vocab)[:vocab].float()
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[toks[:plen]] = True
            penalties = (counts, seen, repetition, frequency, presence)
        return VerifySettings(temp, int(self._top_k[slot]), top_p, min_p, penalties)

    def generator(self, slot: int) -> torch.Generator | None:
        """The slot's own seeded generator, if its request has a seed."""
        return self._generators[slot]

    def extend(self, slot: int, tokens: list[int]) -> None:
        """Record tokens a sequence gained outside sampling (accepted speculative proposals) where a later
        step's penalties read them."""
        row = self._store_row[slot]
        if row < 0 or not tokens:
            return
        n = int(self._len[row])
        self._reserve(n + len(tokens) + 1)
        self._tokens[row, n:n + len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        self._len[row] = n + len(tokens)

    def append(self, rows: StepRows, tokens: torch.Tensor) -> None:
        """Record each row's sampled token (tokens [R], CPU int64) where a later step reads it."""
        if len(rows.penalty_rows):
            store = rows.penalty_store
            lens = self._len[store]
            self._reserve(int(lens.max()) + 2)
            self._tokens[store, lens] = tokens[rows.penalty_rows]
            self._len[store] = lens + 1
        for _, s in rows.early:
            left = self._early[s]
            left[0] -= 1
            if left[0] <= 0:
                del self._early[s]
