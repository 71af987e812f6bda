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


@dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # sequences that proposed at least one token, per step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose proposal i was accepted


class StepCostModel:
    """The forward's measured cost as a + b * tokens, least squares over the recent steps: a is what a
    step costs whatever it holds (reading the weights), b what each more token adds (its FLOPs)."""

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
        if x.max() - x.min() < 2:
            return None
        b = float(np.cov(x, y, bias=True)[0, 1] / x.var())
        b = max(b, 0.0)
        return max(float(y.mean() - b * x.mean()), 0.0), b


class NgramSpeculator:
    """Proposes for the running sequences before a step, verifies their chunks after it.

    Adaptive: a sequence's proposals go into the step only when they are expected to save more time than
    they add, by the measured step cost: E accepted tokens would otherwise take E more steps' worth of
    its share of the step, (a + b * tokens) / sequences each, while verifying k proposals adds b * k now.
    E comes from the sequence's own acceptance once it has a history (so a request whose proposals keep
    failing stops proposing), else from all drafts so far. At batch 1 the step is mostly a (the weights
    are read once however many tokens ride along) and speculation pays; in a large batch a is shared by
    many sequences and b * k dominates, and speculation switches itself off."""

    def __init__(self, k: int, n_min: int, n_max: int, max_model_len: int, adaptive: bool = True) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.adaptive = adaptive
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(accepted_per_position=[0] * k)
        self.cost = StepCostModel()
        self.num_skipped = 0  # proposals withheld because they were not expected to pay

    def expected_accepted(self, seq: Sequence, k: int) -> float:
        """Expected accepted tokens of a k-token proposal for seq (Laplace-smoothed rates)."""
        if seq.spec_drafts >= 4:
            return k * (seq.spec_accepted + 1) / (seq.spec_drafts * self.k + 2)
        st = self.stats
        return sum((st.accepted_per_position[i] + 1) / (st.num_drafts + 2) for i in range(k))

    def pays(self, seq: Sequence, k: int, num_seqs: int, num_tokens: int) -> bool:
        """Whether k proposals for seq are expected to save time in a step of num_seqs sequences and
        num_tokens tokens (always, until the cost model has seen enough steps)."""
        fit = self.cost.fit()
        if fit is None:
            return True
        a, b = fit
        per_token = (a + b * num_tokens) / max(num_seqs, 1)
        return self.expected_accepted(seq, k) * per_token > b * k

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
        """Set spec_token_ids of every eligible running sequence (never past max_tokens or the context);
        returns those that got proposals (the engine clears them after the step)."""
        proposed = []
        # The step as it would be without proposals: every running sequence computes what it lacks.
        num_tokens = sum(s.num_tokens - s.num_computed_tokens for s in running)
        for seq in running:
            if not self.eligible(seq):
                continue
            p = seq.sampling_params
            room = self.max_model_len - seq.num_tokens
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)  # the target adds one token anyway
            k = min(self.k, room)
            if k <= 0:
                continue
            spec = ngram_propose(seq.token_ids, k, self.n_min, self.n_max)
            if spec and self.adaptive and not self.pays(seq, len(spec), len(running), num_tokens):
                self.num_skipped += 1
                continue
            seq.spec_token_ids = spec
            if spec:
                proposed.append(seq)
        return proposed

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
