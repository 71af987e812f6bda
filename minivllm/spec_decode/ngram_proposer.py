"""The n-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min). It costs no model: a few
vectorized comparisons over the sequence's own tokens."""

from __future__ import annotations

import time

import numpy as np
import torch

from minivllm.engine.sequence import Sequence
from minivllm.spec_decode.cost import LookupCost


def ngram_propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """k tokens that followed the latest earlier occurrence of the last n tokens of token_ids (continued
    periodically past the end), trying the longest n first; [] when no suffix of length n_min..n_max
    occurred before."""
    length = len(token_ids)
    if length < n_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    # A match of any length ends at an earlier position holding the last token, with at least one token after it:
    # those few candidates are checked a token further back per length, rather than every window compared whole
    # (sliding windows cost ~60 us a sequence in an 8-stream step here, 0.5 ms of a 2.5 ms step), each length's
    # survivors from the one before (trying each length afresh repeated the shorter lengths' comparisons).
    cand = np.flatnonzero(arr[:length - 1] == arr[length - 1])
    best, n = (cand[-1] if cand.size else -1), 1  # the latest match of n tokens (-1: none)
    while cand.size and n < n_max:
        cand = cand[cand >= n]  # (a match of n + 1 tokens starts at cand - n >= 0)
        cand = cand[arr[cand - n] == arr[length - 1 - n]]
        if cand.size:
            best, n = cand[-1], n + 1
    if best < 0 or n < n_min:
        return []
    # What followed the match, continued through the proposals themselves where it runs into the end: a loop of
    # period p then proposes k tokens, not just p.
    start = int(best) + 1
    out = token_ids[start:start + k]
    while len(out) < k:  # out holds all length - start tokens after the match: copy at that lag
        out.append(out[len(out) - (length - start)])
    return out


class NgramProposer:
    """Proposals looked up in the sequence itself: each is a given token (a point mass to rejection
    sampling), whatever the request's sampling settings."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.cost = LookupCost()

    def propose(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, list[int], torch.Tensor | None]]:
        """(sequence, up to k proposals, None) for each (sequence, k) whose suffix occurred before."""
        t = time.perf_counter()
        out: list[tuple[Sequence, list[int], torch.Tensor | None]] = []
        for seq, k in batch:
            if spec := ngram_propose(seq.token_ids, k, self.n_min, self.n_max):
                out.append((seq, spec, None))
        self.cost.observe(len(batch), time.perf_counter() - t)
        return out

    def overhead(self, longest: int, tokens: int, seqs: int) -> float:
        """Seconds a round looking up `seqs` sequences adds to a step, as measured (LookupCost)."""
        return self.cost.estimate(seqs)

    def catch_up_cost(self, seq: Sequence) -> float:
        """Seconds proposing for seq would first spend catching up: none (no model to catch up)."""
        return 0.0

    def settle(self) -> None:
        """After a step: nothing to roll back."""

    def release(self, seq: Sequence) -> None:
        """seq finished or was preempted: nothing held."""

    def check_invariants(self) -> None:
        """No pool of its own."""
