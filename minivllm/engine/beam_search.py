"""Beam search inside the engine: one step, following HF transformers' (vectorised, >= 4.50) beam search exactly.

Per step: add each live beam's score to its next-token log-probs, keep the top
K = max(2, 1 + #eos) * width continuations over all beams; those among the first `width` that end in
EOS (or reach max_tokens) become finished hypotheses scored sum_logprobs / generated_len **
length_penalty; the best `width` continuations that did not finish become the next live beams. The
search ends when early stopping says no running beam can beat the finished ones (HF's heuristic and
its early_stopping True / False / "never"), or when max_tokens is reached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minivllm.engine.sequence import BeamState, Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from minivllm.engine.scheduler import Scheduler
    from minivllm.engine.stats import StatsRecorder

NEG = -1.0e9  # HF's "cannot be chosen" score


def beam_step(state: BeamState, logprobs: torch.Tensor, eos_ids: frozenset[int]) -> list[tuple[int, int, float]]:
    """Advance the search by one token. logprobs [len(state.live), vocab] are the live beams' next-token
    log-probs. Updates state.finished / improvable / num_generated; returns the next live beams as
    (index of the parent in state.live, token, score), best first. An empty list means the search is over."""
    width, vocab = state.width, logprobs.shape[1]
    # float32 sums, as HF keeps them, so the candidate order matches theirs.
    acc = (logprobs.float() + torch.tensor(state.scores, dtype=torch.float32)[:, None]).flatten()
    k = min(max(2, 1 + len(eos_ids)) * width, acc.numel())
    top_scores, top_idx = acc.topk(k)
    parents = (top_idx // vocab).tolist()
    tokens = (top_idx % vocab).tolist()
    scores = top_scores.tolist()
    at_max = state.num_generated + 1 >= state.max_tokens
    hits = [at_max or t in eos_ids for t in tokens]

    # Finished hypotheses: only continuations among the first `width` count (the rest are spares).
    full = len(state.finished) == width and state.early_stopping is True
    if state.improvable and not full:
        norm = (state.num_generated + 1) ** state.length_penalty
        for j in range(min(width, k)):
            if hits[j]:
                ids = state.live[parents[j]].output_token_ids + [tokens[j]]
                state.finished.append((scores[j] / norm, ids, scores[j]))
        state.finished.sort(key=lambda h: h[0], reverse=True)
        del state.finished[width:]

    # Next live beams: the best continuations that did not just finish.
    order = sorted(range(k), key=lambda j: scores[j] + (NEG if hits[j] else 0.0), reverse=True)[:width]
    nxt = [(parents[j], tokens[j], scores[j] + (NEG if hits[j] else 0.0)) for j in order]
    state.num_generated += 1

    # HF's early-stop heuristic: can the best running beam still beat the worst finished hypothesis?
    if state.early_stopping == "never" and state.length_penalty > 0.0:
        best_len = state.max_tokens
    else:
        best_len = state.num_generated
    best_possible = nxt[0][2] / best_len**state.length_penalty if nxt else NEG
    worst_finished = min(h[0] for h in state.finished) if len(state.finished) == width else NEG
    state.improvable = state.improvable and best_possible > worst_finished
    over = (not state.improvable or (len(state.finished) == width and state.early_stopping is True)
            or all(hits))
    return [] if over else nxt


class BeamSearcher:
    """The engine's beam groups: collects each live beam's next-token log-probs from the step's logits,
    and once a group has all of them runs beam_step, forking the chosen parents (KV shared,
    copy-on-write) and retiring pruned beams at once."""

    def __init__(self, scheduler: Scheduler, recorder: StatsRecorder, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        # No reference back to the engine: a cycle would keep a dropped engine's weights and KV pool alive
        # until the cyclic collector runs.
        self.scheduler, self.recorder = scheduler, recorder
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len

    def step(self, logprobs: torch.Tensor, beams: list[Sequence], touched: dict[str, SequenceGroup]) -> None:
        """Take the live beams' next-token log-probs of this step (logprobs [len(beams), V], the runner's); a group
        whose live beams all have theirs advances (and is added to touched)."""
        for seq, lp in zip(beams, logprobs, strict=True):
            group = seq.group
            assert group is not None and group.beam is not None
            group.beam.pending[seq.seq_id] = lp
            if all(b.seq_id in group.beam.pending for b in group.beam.live):
                self._advance(group)
                touched.setdefault(group.request_id, group)

    def _advance(self, group: SequenceGroup) -> None:
        """Run one beam step for group: fork selected parents, free pruned beams at once."""
        state = group.beam
        assert state is not None
        eos = self.eos_token_ids if not group.params.ignore_eos else frozenset()
        lp = torch.stack([state.pending.pop(b.seq_id) for b in state.live])
        if len(group.prompt_token_ids) + state.num_generated + 1 >= self.max_model_len:
            state.max_tokens = min(state.max_tokens, state.num_generated + 1)  # the context is full
        nxt = beam_step(state, lp, eos)
        self.recorder.generated(group.request_id, len(nxt))
        uses: dict[int, int] = {}
        new_live, scores = [], []
        for parent_idx, token, score in nxt:
            parent = state.live[parent_idx]
            if parent_idx not in uses:
                uses[parent_idx] = 0
                beam = parent
            else:
                beam = Sequence(group.request_id, group.prompt_token_ids, group.params, parent.arrival_index,
                                parent.priority, group, 0)
                self.scheduler.fork(parent, beam)
            uses[parent_idx] += 1
            new_live.append((beam, token))
            scores.append(score)
        # Forks copied the parents' tokens above; now every beam gets its own new token.
        for beam, token in new_live:
            beam.token_ids.append(token)
        for i, parent in enumerate(state.live):
            if i not in uses:
                assert parent.slot < 0  # beams are scored here, never by the sampler: no sampling slot to free
                self.scheduler.finish(parent, SequenceStatus.FINISHED_ABORTED)
        state.live = [b for b, _ in new_live]
        state.scores = scores
