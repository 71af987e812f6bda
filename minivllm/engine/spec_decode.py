"""Speculative decoding inside continuous batching: the n-gram (prompt lookup) proposer and greedy
verification.

Before a step, each eligible decoding sequence gets up to k proposed tokens (`seq.spec_token_ids`): the
tokens that followed the latest earlier occurrence of its last n tokens (n from prompt_lookup_max down
to prompt_lookup_min), which costs no model. The scheduler then schedules the sequence's last token
plus its proposals as one chunk of the step's flat forward, and the runner returns logits for every
position of it. Verification keeps the longest run of proposals equal to the target's argmax, plus the
target's own token after it, so a greedy request's output is exactly what it would be without
speculation. The KV written for rejected proposals lies beyond the sequence's computed tokens: it is
never read, later tokens overwrite it, and prefix caching hashes only computed blocks.

Eligible: greedy requests without penalties, logprobs or pending min_tokens, and not beam search;
sampled requests decode as usual (rejection sampling is not implemented yet).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.engine.sequence import Sequence
from minivllm.model.runner import SequenceInput


def ngram_propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens of token_ids,
    trying the longest n first; [] when no suffix of length n_min..n_max occurred before."""
    length = len(token_ids)
    if length < n_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows that start before the suffix itself and leave at least one token after them.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start:start + k]
    return []


def verify_rows(seq: Sequence, n: int) -> list[SequenceInput]:
    """The runner inputs of a speculating sequence's n scheduled tokens (its last token, then proposals):
    one single-token row each, at consecutive positions over the same block table. A step's rows write
    their K/V before any row attends, and each attends up to its own position, so this is the chunk's
    causal attention, and a verification step stays an all-decode step (on CPU, the native decode stack
    rather than the module path that multi-token chunks take)."""
    start = seq.num_computed_tokens
    toks = (seq.token_ids[start:] + seq.spec_token_ids)[:n]
    return [SequenceInput([t], start + i, seq.block_table, True) for i, t in enumerate(toks)]


@dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # sequences that proposed at least one token, per step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose proposal i was accepted


class StepCostModel:
    """The forward's measured cost as a + b * tokens, least squares over recent steps of one kind: a is
    what a step costs whatever it holds (reading the weights), b what each more token adds (its FLOPs)."""

    def __init__(self, window: int = 128) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, tokens: int, seconds: float) -> None:
        """One step: tokens computed, forward seconds."""
        self.samples.append((tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until the steps seen differ enough in size to tell them apart."""
        if len(self.samples) < 8:
            return None
        x = np.array([t for t, _ in self.samples], dtype=np.float64)
        y = np.array([s for _, s in self.samples], dtype=np.float64)
        if x.max() - x.min() < 2:  # steps of one size (a batch-1 decode): its cost, at that size
            return float(y.mean()), 0.0
        b = float(np.cov(x, y, bias=True)[0, 1] / x.var())
        b = max(b, 0.0)
        return max(float(y.mean() - b * x.mean()), 0.0), b


class NgramSpeculator:
    """Proposes for the running sequences before a step, verifies their chunks after it.

    Adaptive (--speculative-adaptive): proposals go into a step only when the measured step costs say the
    step then yields tokens faster. Two cost models, because a step of one-token decodes runs its own
    (native, much cheaper) path on CPU: `decode_cost` over such steps, `cost` over decode steps that
    verify proposals (prefill steps fit neither).
    When the step would otherwise be a pure decode, the proposals (best expected yield first) are added
    while (n + expected accepted) / cost(n + proposed tokens) beats n / decode_cost(n): at batch 1 the
    weights dominate both and speculation pays, in a large batch the extra tokens' FLOPs do not. When the
    step has other multi-token work anyway, a proposal is kept if its expected tokens are worth more of
    the step than the b * k it adds. Expected accepted tokens come from the sequence's own history once
    it has one (a request whose proposals keep failing stops proposing), else from all drafts so far.
    Before a model has data, the step that would measure it is taken."""

    def __init__(self, k: int, n_min: int, n_max: int, max_model_len: int, adaptive: bool = True) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.adaptive = adaptive
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(accepted_per_position=[0] * k)
        self.cost = StepCostModel()  # decode steps that verify proposals
        self.decode_cost = StepCostModel()  # steps of one-token decodes only
        self.num_skipped = 0  # proposals withheld because they were not expected to pay

    def observe(self, scheduled: list[tuple[Sequence, int]], seconds: float) -> None:
        """One step's forward time, by kind: one-token decodes only, or decodes with verification chunks.
        Steps with prefill chunks are left out: their cost (long chunks' attention) is another shape."""
        tokens = sum(n for _, n in scheduled)
        if tokens == len(scheduled):
            self.decode_cost.observe(tokens, seconds)
        elif all(n == 1 or seq.spec_token_ids for seq, n in scheduled):
            self.cost.observe(tokens, seconds)

    def expected_accepted(self, seq: Sequence, k: int) -> float:
        """Expected accepted tokens of a k-token proposal for seq (Laplace-smoothed rates)."""
        if seq.spec_drafts >= 4:
            return k * (seq.spec_accepted + 1) / (seq.spec_drafts * self.k + 2)
        return self._batch_expected(k)

    def _batch_expected(self, k: int) -> float:
        """Expected accepted tokens of a k-token proposal at the acceptance of all drafts so far."""
        st = self.stats
        return sum((st.accepted_per_position[i] + 1) / (st.num_drafts + 2) for i in range(k))

    def _may_pay(self, num_seqs: int, num_tokens: int, pure_decode: bool) -> bool:
        """Whether k-token proposals at the batch's usual acceptance could pay for one sequence or for all
        of them (the yield per second is monotone in how many speculate, so the ends decide); a cheap
        check before any lookup."""
        multi = self.cost.fit()
        if multi is None:
            return True
        a, b = multi
        k = self.k
        e = self._batch_expected(k)
        if not pure_decode:
            return e * (a + b * num_tokens) / max(num_seqs, 1) > b * k
        plain = self.decode_cost.fit()
        if plain is None:
            return False
        rate = num_seqs / max(plain[0] + plain[1] * num_seqs, 1e-9)
        return any((num_seqs + m * e) / max(a + b * (num_tokens + m * k), 1e-9) > rate for m in (1, num_seqs))

    def worth(self, candidates: list[tuple[Sequence, list[int]]], num_seqs: int, num_tokens: int,
              pure_decode: bool) -> list[tuple[Sequence, list[int]]]:
        """The candidates (sequence, proposal) worth verifying in a step of num_seqs sequences and
        num_tokens tokens without them (pure_decode: every one of those a one-token decode)."""
        multi = self.cost.fit()
        if multi is None:
            return candidates  # measure multi-token steps first
        a, b = multi
        gains = [(self.expected_accepted(seq, len(spec)), seq, spec) for seq, spec in candidates]
        if not pure_decode:
            per_token = (a + b * num_tokens) / max(num_seqs, 1)
            return [(seq, spec) for e, seq, spec in gains if e * per_token > b * len(spec)]
        plain = self.decode_cost.fit()
        if plain is None:
            return []  # measure the plain decode step first
        best_rate, best_len = num_seqs / max(plain[0] + plain[1] * num_seqs, 1e-9), 0
        gains.sort(key=lambda g: g[0] / len(g[2]), reverse=True)
        gained = extra = 0.0
        for i, (e, _, spec) in enumerate(gains):
            gained, extra = gained + e, extra + len(spec)
            rate = (num_seqs + gained) / max(a + b * (num_tokens + extra), 1e-9)
            if rate > best_rate:
                best_rate, best_len = rate, i + 1
        return [(seq, spec) for _, seq, spec in gains[:best_len]]

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Whether seq's next tokens may be proposed: a greedy decode whose tokens depend on nothing but
        the target's argmax."""
        group = seq.group
        p = seq.sampling_params
        return (group is not None and group.beam is None and p.greedy and not p.has_penalties
                and p.logprobs is None and seq.num_output_tokens >= p.min_tokens
                and seq.num_computed_tokens == seq.num_tokens - 1)

    def propose(self, running: list[Sequence]) -> list[Sequence]:
        """Set spec_token_ids of the eligible running sequences whose proposals are worth it (never past
        max_tokens or the context); returns those (the engine clears them after the step)."""
        for seq in running:
            if seq.spec_token_ids:  # left by a step that raised before the engine cleared them
                seq.spec_token_ids = []
        lacking = [s.num_tokens - s.num_computed_tokens for s in running]
        pure_decode = all(n <= 1 for n in lacking)
        if self.adaptive and not self._may_pay(len(running), sum(lacking), pure_decode):
            return []  # not even typical proposals for everyone would pay: skip the lookups too
        candidates = []
        for seq in running:
            if not self.eligible(seq):
                continue
            p = seq.sampling_params
            room = self.max_model_len - seq.num_tokens
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)  # the target adds one token anyway
            k = min(self.k, room)
            if k > 0 and (spec := ngram_propose(seq.token_ids, k, self.n_min, self.n_max)):
                candidates.append((seq, spec))
        if self.adaptive and candidates:
            # The step as it would be without proposals: every running sequence computes what it lacks.
            kept = self.worth(candidates, len(running), sum(lacking), pure_decode)
            self.num_skipped += len(candidates) - len(kept)
            candidates = kept
        for seq, spec in candidates:
            seq.spec_token_ids = spec
        return [seq for seq, _ in candidates]

    def verify(self, seq: Sequence, logits: torch.Tensor, num_scheduled: int) -> list[int]:
        """The tokens seq gains this step: logits [num_scheduled, V] are the target's at its last token and
        at the proposals scheduled after it (the step budget may have cut some off)."""
        proposed = seq.spec_token_ids[:num_scheduled - 1]
        target = logits.argmax(dim=-1).tolist()
        j = 0
        while j < len(proposed) and proposed[j] == target[j]:
            j += 1
        st = self.stats
        if proposed:
            seq.spec_drafts += 1
            seq.spec_accepted += j
            st.num_drafts += 1
            st.num_draft_tokens += len(proposed)
            st.num_accepted_tokens += j
            for i in range(j):
                st.accepted_per_position[i] += 1
        return proposed[:j] + [target[j]]
