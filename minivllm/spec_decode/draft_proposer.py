"""The draft-model proposer: a small model with the target's tokenizer, run inside the same engine on its
own paged KV pool, proposes k tokens autoregressively for each speculating sequence.

Each target sequence has a shadow Sequence on the draft's side: the same token list (shared, so it grows
with the target's), its own block table, and `num_computed_tokens` counting only positions whose draft
K/V belongs to the sequence's real tokens. Proposing catches the draft up on what it has not seen (the
whole prompt the first time, from prefix-cache hits in the draft's own pool; usually the one or two tokens
the last step added) in one batched forward whose last rows give the first proposals, then runs k - 1
one-row-per-sequence forwards (for greedy requests the whole round is one native call, model/greedy_loop.py;
sampled ones draw from Python with the engine's generators). After the target's step, the shadow keeps the
proposals the target accepted (their K/V is right: same tokens, same positions) and forgets the rest, which
later writes overwrite; full blocks of real tokens are registered for prefix caching, as the target's are. A
target sequence that finishes, is aborted or is preempted gives its draft blocks back.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import deque

import numpy as np
import torch

from minivllm.config import ModelConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.engine_config import EngineConfig
from minivllm.model import cpu_kernels, row_order
from minivllm.model.greedy_loop import GreedyLoop
from minivllm.model.runner import ModelRunner, SequenceInput
from minivllm.model.sampler import draw_from, processed_probs
from minivllm.spec_decode.cost import ProposerCostModel


def load_draft_config(path: str, target: ModelConfig, target_tokenizer: object) -> ModelConfig:
    """The draft's config, checked against the target: a model directory, the same vocabulary size and
    the same tokenizer (proposals are token ids the target must read the same way)."""
    try:
        mc = ModelConfig.from_pretrained(path)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"speculative_model: {path!r} is not a usable draft model directory ({e})") from None
    if mc.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_model: the draft's vocabulary ({mc.vocab_size} tokens, {path}) differs from "
                         f"the target's ({target.vocab_size}); a draft must share the target's tokenizer")
    try:
        tok = get_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - any failure to load means no usable tokenizer
        raise ValueError(f"speculative_model: no tokenizer in {path!r} ({e})") from None
    if tok.get_vocab() != target_tokenizer.get_vocab():  # type: ignore[attr-defined]
        raise ValueError(f"speculative_model: the draft's tokenizer ({path}) differs from the target's (same size, "
                         "different tokens); a draft must share the target's tokenizer")
    return mc


# A catch-up this short (the usual one: the token the target's last step added, or that and the last
# accepted proposal) goes in as single-token rows, as a verification does (spec_decode.proposer.verify_rows): a
# 2-token chunk would take the module path, 0.66 ms for this draft against 0.15 ms for a decode step.
SHORT_CATCH_UP = 4


class DraftModelProposer:
    """Owns the draft's runner and KV pool; proposes for a batch of sequences, rolls back after the step."""

    CATCH_UP_ROUNDS = 16

    def __init__(self, mc: ModelConfig, runner: ModelRunner, block_manager: BlockManager,
                 generator: torch.Generator) -> None:
        self.mc, self.runner, self.block_manager = mc, runner, block_manager
        self.max_len = mc.max_position_embeddings
        self.generator = generator  # the engine's stream, for requests without a seed
        self.shadows: dict[int, Sequence] = {}  # target seq_id → its draft-side sequence
        self.pending: list[tuple[Sequence, Sequence, int, list[int]]] = []  # (target, shadow, T, proposals)
        self.cost = ProposerCostModel()  # a round's seconds by forwards and rows
        # Seconds a token of a long catch-up costs (a prompt through the draft's prefill path), beyond the round it
        # came in: per round that had one, the median of the last CATCH_UP_ROUNDS (catch_up_cost; 0.0 before one).
        self._catch_up: deque[float] = deque(maxlen=self.CATCH_UP_ROUNDS)
        self.catch_up_price = 0.0
        # Greedy rounds in one native call where the draft's forwards all run on its decode stack.
        self.loop = GreedyLoop.build(runner.model, runner.sink_tokens)

    @classmethod
    def build(cls, path: str, target: EngineConfig, target_tokenizer: object, num_blocks: int, prefix_caching: bool,
              generator: torch.Generator) -> DraftModelProposer:
        """Check the draft against the target, load it (the target's dtype, device and kernels), and give it a pool
        of num_blocks blocks."""
        mc = load_draft_config(path, target.model_config, target_tokenizer)
        order = row_order.state()
        runner = ModelRunner(target.for_draft(mc), num_blocks)
        # The process's one-token row orders stay the target's (model/row_order.py: process-wide), timed on the weights
        # that dominate a step; a small draft's timing may even run from cache.
        if cpu_kernels.available():
            row_order.restore(order)
        return cls(mc, runner, BlockManager(num_blocks, target.cache.block_size, prefix_caching), generator)

    def _shadow(self, seq: Sequence) -> Sequence:
        sh = self.shadows.get(seq.seq_id)
        if sh is None:
            sh = Sequence(seq.request_id, [], seq.sampling_params, 0)
            sh.token_ids, sh.num_prompt_tokens = seq.token_ids, seq.num_prompt_tokens  # shared: grows with seq
            self.shadows[seq.seq_id] = sh
        return sh

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, list[int], torch.Tensor | None]]:
        """(sequence, k proposals, the distributions they were drawn from or None for greedy ones) for each
        (sequence, k) whose draft blocks could be had."""
        t0 = time.perf_counter()
        bm, bs = self.block_manager, self.block_manager.block_size
        rows: list[tuple[Sequence, Sequence, int, int]] = []  # (target, shadow, T, k)
        starts: list[int] = []  # per row: the first position the draft has not seen
        prompt = False  # some sequence's catch-up is its whole prompt: a one-off per request, not timed
        behind = 0  # tokens of long catch-ups (each past SHORT_CATCH_UP) in this round
        for seq, k in batch:
            total = seq.num_tokens
            k = min(k, self.max_len - total + 1)
            if k < 1:
                continue
            sh = self._shadow(seq)
            prompt |= not sh.block_table
            hits = bm.get_computed_blocks(sh) if not sh.block_table else []
            done = sh.num_computed_tokens + len(hits) * bs
            if done >= total:
                # The draft has seen the last token already (the target's last step added nothing to this
                # sequence: not scheduled, or the step raised), and its logits are gone: no proposal this time.
                continue
            if not bm.allocate_slots(sh, total + k - 1 - done, hits):
                continue  # the draft pool is full: this sequence decodes without proposals this step
            sh.num_computed_tokens = done
            behind += total - done if total - done > SHORT_CATCH_UP else 0
            rows.append((seq, sh, total, k))
            starts.append(done)
        if not rows:
            return []
        self.runner.copy_blocks(bm.take_copies())
        native = self._greedy_round(rows, starts) if self.loop is not None else None
        proposals, dists = (native, [[] for _ in rows]) if native is not None else self._loop(rows, starts)
        out = []
        for (seq, sh, total, _), spec, seq_dists in zip(rows, proposals, dists, strict=True):
            sh.num_computed_tokens = total  # the proposals' K/V counts once the target accepts them
            bm.cache_blocks(sh)
            self.pending.append((seq, sh, total, spec))
            out.append((seq, spec, torch.stack(seq_dists) if seq_dists else None))
        longest, tokens, took = max(k for *_, k in rows), sum(k for *_, k in rows), time.perf_counter() - t0
        if not prompt:
            # A round's cost by what the adaptive rule decides (positions and proposed tokens), catch-ups
            # included: a sequence that skipped steps catches up on them in its next round (at 8 streams,
            # leaving them out priced rounds at half their cost and drafting lost 5-20%); the draft's prefill
            # of a prompt is paid once per request and left out.
            self.cost.observe(longest, tokens, took)
        elif behind:  # ... and priced per token instead (catch_up_cost)
            self._catch_up.append(max(took - self.cost.estimate(longest, tokens), 0.0) / behind)
            self.catch_up_price = statistics.median(self._catch_up)
        return out

    def _greedy_round(self, rows: list[tuple[Sequence, Sequence, int, int]], starts: list[int]
                      ) -> list[list[int]] | None:
        """Every row's proposals from one native round (model/greedy_loop.py), or None where it does not apply:
        a sampling request (its draws stay in Python, with the engine's generators), a catch-up longer than
        SHORT_CATCH_UP (a prompt: the module path's prefill), row counts the decode stack would not run, or a draft
        with LoRA adapters (their deltas are added by the projections' Python path)."""
        assert self.loop is not None
        if self.runner.lora is not None or any(not seq.sampling_params.greedy or total - done > SHORT_CATCH_UP
                                               for (seq, _, total, _), done in zip(rows, starts, strict=True)):
            return None
        order = sorted(range(len(rows)), key=lambda r: -rows[r][3])  # longest proposals first: a prefix proposes
        steps = np.fromiter((rows[r][3] for r in order), np.int64, len(order))
        lens = np.fromiter((rows[r][2] - starts[r] for r in order), np.int64, len(order))
        counts = [int(lens.sum())] + [int((steps > i).sum()) for i in range(int(steps[0]))]
        if not self.loop.runs(counts):
            return None
        tokens = np.fromiter(itertools.chain.from_iterable(rows[r][0].token_ids[starts[r]:rows[r][2]] for r in order),
                             np.int64, counts[0])
        ends = np.cumsum(lens)
        positions = np.arange(counts[0], dtype=np.int64) + np.repeat(
            np.fromiter((starts[r] for r in order), np.int64, len(order)) - (ends - lens), lens)
        tables = self._tables([rows[r][1].block_table for r in order])
        out = self.loop.round(tokens, positions, tables[torch.from_numpy(np.repeat(np.arange(len(order)), lens))],
                              ends - 1, steps, tables)
        proposals: list[list[int]] = [[] for _ in rows]
        for j, r in enumerate(order):
            proposals[r] = out[j, :rows[r][3]].tolist()
        return proposals

    def _loop(self, rows: list[tuple[Sequence, Sequence, int, int]], starts: list[int]
              ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Proposals and (for sampling requests) their distributions, one forward per position from Python: the
        catch-ups as one batched forward, then one row per sequence still proposing."""
        inputs: list[SequenceInput] = []
        for (seq, sh, total, _), done in zip(rows, starts, strict=True):
            chunk = seq.token_ids[done:total]
            if len(chunk) <= SHORT_CATCH_UP:  # one decode row per token: the step stays on the decode stack
                inputs += [SequenceInput([t], done + i, sh.block_table, i == len(chunk) - 1)
                           for i, t in enumerate(chunk)]
            else:
                inputs.append(SequenceInput(chunk, done, sh.block_table, True))
        proposals: list[list[int]] = [[] for _ in rows]
        dists: list[list[torch.Tensor]] = [[] for _ in rows]
        live = list(range(len(rows)))
        logits = self.runner.execute(inputs)  # catch-up chunks; their last rows give the first proposals
        tables = positions = None
        for i in range(max(k for *_, k in rows)):
            if i:
                now = [r for r in live if rows[r][3] > i]
                if tables is None or len(now) < len(live):  # the tables are packed once for the k - 1 forwards
                    tables = self._tables([rows[r][1].block_table for r in now])
                    positions = torch.tensor([rows[r][2] + i - 2 for r in now], device=tables.device)
                live = now
                assert positions is not None  # packed with the tables on the first of these forwards
                positions = positions + 1
                ids = torch.tensor([proposals[r][-1] for r in live], device=tables.device)
                logits = self.runner.execute_decodes(ids, positions, tables)
            for r, tok, dist in zip(live, *self._draw(logits, [rows[r][0] for r in live]), strict=True):
                proposals[r].append(tok)
                if dist is not None:
                    dists[r].append(dist)
        return proposals, dists

    def _tables(self, block_tables: list[list[int]]) -> torch.Tensor:
        """Block tables as one [M, B] int64 tensor on the draft's device (rows padded with block 0)."""
        width = max(len(t) for t in block_tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64,
                            device=self.runner.device)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
        """One token per row: the argmax for greedy requests, else a draw from the draft's distribution
        under the request's own temperature, top-k, top-p and min-p (kept for rejection sampling)."""
        tokens = logits.argmax(dim=-1).tolist()
        dists: list[torch.Tensor | None] = [None] * len(seqs)
        for j, seq in enumerate(seqs):
            p = seq.sampling_params
            if p.greedy:
                continue
            q = processed_probs(logits[j:j + 1], torch.tensor([p.temperature]), torch.tensor([p.top_k]),
                                torch.tensor([p.top_p]), torch.tensor([p.min_p]))
            g = seq.generator or self.generator
            u = torch.rand(1, generator=g, device=g.device, dtype=torch.float64)
            tokens[j] = int(draw_from(q, u).item())
            dists[j] = q[0]
        return tokens, dists

    def overhead(self, longest: int, tokens: int, seqs: int) -> float:
        """Seconds a round proposing `tokens` tokens in all, at most `longest` for one sequence, is expected to
        add to a step (measured: one forward per position of the longest proposal, its rows; not by sequences)."""
        return self.cost.estimate(longest, tokens)

    def catch_up_cost(self, seq: Sequence) -> float:
        """Seconds proposing for seq would spend first on catching the draft up, where that is more than a round's
        usual one or two tokens: the whole prompt and output so far for a sequence that never proposed (at the tail of
        a 64-sequence batch, rounds for 28-49 such sequences took 25-53 ms of a 1.3 s run)."""
        sh = self.shadows.get(seq.seq_id)
        behind = seq.num_tokens - (sh.num_computed_tokens if sh is not None else 0)
        return behind * self.catch_up_price if behind > SHORT_CATCH_UP else 0.0

    def settle(self) -> None:
        """After the target's step: each shadow keeps the K/V of the proposals the target accepted."""
        for seq, sh, total, spec in self.pending:
            if self.shadows.get(seq.seq_id) is not sh:
                continue  # released meanwhile (finished, aborted or preempted)
            kept = 0
            tail = seq.token_ids[total:total + len(spec) - 1]  # only the first k - 1 proposals were computed
            while kept < len(tail) and tail[kept] == spec[kept]:
                kept += 1
            sh.num_computed_tokens = total + kept
            self.block_manager.cache_blocks(sh)
        self.pending.clear()

    def release(self, seq: Sequence) -> None:
        """seq finished, was aborted or was preempted: its draft blocks go back to the draft's pool."""
        sh = self.shadows.pop(seq.seq_id, None)
        if sh is not None:
            self.block_manager.free(sh)

    def check_invariants(self) -> None:
        """The draft pool's accounting agrees with the shadows' block tables."""
        self.block_manager.check_invariants(self.shadows.values())
