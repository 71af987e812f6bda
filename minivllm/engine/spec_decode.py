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


class NgramSpeculator:
    """Proposes for the running sequences before a step, verifies their chunks after it."""

    def __init__(self, k: int, n_min: int, n_max: int, max_model_len: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(accepted_per_position=[0] * k)

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
        for seq in running:
            if not self.eligible(seq):
                continue
            p = seq.sampling_params
            room = self.max_model_len - seq.num_tokens
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)  # the target adds one token anyway
            k = min(self.k, room)
            if k > 0:
                seq.spec_token_ids = ngram_propose(seq.token_ids, k, self.n_min, self.n_max)
                if seq.spec_token_ids:
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
            st.num_drafts += 1
            st.num_draft_tokens += len(proposed)
            st.num_accepted_tokens += j
            for i in range(j):
                st.accepted_per_position[i] += 1
        return proposed[:j] + [target[j]]
