"""Suffix decoding (vLLM's `suffix` method, after SuffixDecoding, arXiv 2411.04975): proposals from what followed
the sequence's longest matching suffix, in its own tokens (prompt and output so far) and in the outputs of earlier
requests (the global cache). Where several earlier occurrences match, the proposal follows their most frequent
continuation while its estimated probability (the share of occurrences that agree, multiplied along the path) stays
at or above min_token_prob, and proposes at most max_spec_factor x the match length tokens: a long match speculates
far, a one-token match little. Of the two sources, the one whose proposal scores higher (the sum of its tokens'
probabilities) is taken. It costs no model, and it guesses agentic and repeated-output traffic that n-gram lookup
in the prompt alone cannot.

The reference keeps suffix trees; here each source is a token buffer searched with a few vectorized gathers: the
occurrences of the last token (the global cache keeps a sorted index of its tokens, rebuilt as it grows by a
quarter; newer outputs wait in a small tail searched directly), extended backwards in doubling chunks up to the
tree depth while any occurrence still matches. A Python suffix tree would hold a node per token and depth (24 per
token), about 300 bytes each; the buffers hold 4 to 12 bytes per token."""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from minivllm.engine.sequence import Sequence
from minivllm.spec_decode.cost import LookupCost

_NONE = -1  # pads the buffers and separates requests: no token equals it, so no match or continuation crosses it


class Corpus:
    """Token segments in one padded buffer: `depth` pads before (a match looks back at most that far), a separator
    after each segment, `ahead` pads at the end (a continuation reads at most that far). Indexed: the positions of
    each token come from a sorted index, else from a scan."""

    __slots__ = ("buf", "order", "keys", "size", "starts", "live_from")

    def __init__(self, segments: list[np.ndarray], depth: int, ahead: int, indexed: bool) -> None:
        parts = [np.full(depth, _NONE, np.int32)]
        for s in segments:
            parts += [s, np.full(1, _NONE, np.int32)]
        parts.append(np.full(ahead, _NONE, np.int32))
        self.buf = np.concatenate(parts)
        self.size = sum(len(s) for s in segments)
        self.starts = np.cumsum([depth] + [len(s) + 1 for s in segments])  # where each segment begins (and the end)
        self.live_from = depth  # segments before this position were evicted: no longer matched
        self.order: np.ndarray | None = None
        self.keys: np.ndarray | None = None
        if indexed:
            self.order = np.argsort(self.buf, kind="stable")
            self.keys = self.buf[self.order]

    def positions(self, token: int) -> np.ndarray:
        """Where token occurs in the live segments."""
        if self.order is None or self.keys is None:
            pos = np.flatnonzero(self.buf == token)
        else:
            lo, hi = np.searchsorted(self.keys, (token, token + 1))
            pos = self.order[lo:hi]
        return pos[pos >= self.live_from] if self.live_from > self.starts[0] else pos

    def evict_first(self, n: int) -> None:
        """The first n segments leave (a match may still look back into them: their tokens precede the live ones
        only across a separator)."""
        self.live_from = int(self.starts[min(n, len(self.starts) - 1)])


def longest_match(buf: np.ndarray, pos: np.ndarray, pattern: np.ndarray) -> tuple[np.ndarray, int]:
    """Of the positions pos (where pattern[0] occurs in buf), those preceded by the longest run of pattern[1:]
    (pattern: the context's last tokens, newest first; buf padded by len(pattern) before), and that run's length
    + 1. Extends in doubling chunks, one gather each, while every token so far matched somewhere."""
    length, cap = 1, len(pattern)
    while pos.size and length < cap:
        w = min(length, cap - length)
        same = buf[pos[:, None] - np.arange(length, length + w)] == pattern[length:length + w]
        run = np.logical_and.accumulate(same, axis=1).sum(axis=1)
        best = int(run.max())
        if best < w:  # no occurrence matched the whole chunk: the longest end inside it
            return pos[run == best], length + best
        pos, length = pos[run == w], length + w
    return pos, length


def walk(parts: list[tuple[np.ndarray, np.ndarray]], k: int, min_prob: float) -> tuple[list[int], float]:
    """Up to k tokens after the matched occurrences ((buffer, positions) per corpus, one match): each step the most
    frequent next token, its probability the share of occurrences still followed that agree, times the last; stops
    below min_prob or where no occurrence goes on. Returns the tokens and their summed probabilities."""
    out: list[int] = []
    prob, score = 1.0, 0.0
    total = sum(p.size for _, p in parts)
    for i in range(1, k + 1):
        if total == 1:  # one occurrence left (a long match, the usual case): its continuation, each certain
            buf, p = next((b, q) for b, q in parts if q.size)
            rest = buf[int(p[0]) + i:int(p[0]) + k + 1]
            stop = np.flatnonzero(rest == _NONE)
            rest = rest[:stop[0]] if stop.size else rest
            return out + rest.tolist(), score + prob * len(rest)
        nxt = [buf[p + i] for buf, p in parts]
        vals, counts = np.unique(np.concatenate(nxt), return_counts=True)
        if vals[0] == _NONE:  # occurrences that end here weigh in the share, but are not a proposal
            vals, counts = vals[1:], counts[1:]
        if not vals.size:
            break
        j = int(counts.argmax())
        prob *= counts[j] / total
        if prob < min_prob:
            break
        tok = int(vals[j])
        out.append(tok)
        score += prob
        parts = [(buf, p[n == tok]) for (buf, p), n in zip(parts, nxt, strict=True)]
        total = int(counts[j])
    return out, score


class SuffixCache:
    """The outputs of the last max_requests finished requests, searchable by suffix: a sorted-index corpus of
    most, and a tail of the newest searched directly until it grows to a quarter of the rest (then the index is
    rebuilt over the cached outputs). An evicted output leaves the index at once (its positions are no longer
    matched) and its memory at the next rebuild."""

    MIN_TAIL = 4096  # tokens the tail may hold before a rebuild, however small the index

    def __init__(self, max_requests: int, depth: int, ahead: int) -> None:
        self.depth, self.ahead = depth, ahead
        self.outputs: deque[np.ndarray] = deque(maxlen=max_requests)
        self.pending: list[np.ndarray] = []  # the newest outputs (the tail's), not in the index yet
        self.num_evicted = 0  # indexed outputs evicted since the index was built
        self.reindex()

    def add(self, tokens: list[int]) -> None:
        if not tokens or self.outputs.maxlen == 0:
            return
        if len(self.outputs) == self.outputs.maxlen:  # the oldest leaves: from the index, or else the tail
            if len(self.pending) == len(self.outputs):
                self.pending.pop(0)
            else:
                self.num_evicted += 1
                self.indexed.evict_first(self.num_evicted)
        out = np.asarray(tokens, dtype=np.int32)
        self.outputs.append(out)
        self.pending.append(out)
        if sum(len(t) for t in self.pending) > max(self.MIN_TAIL, self.indexed.size // 4):
            self.reindex()
        else:
            self.tail = Corpus(self.pending, self.depth, self.ahead, False)

    def reindex(self) -> None:
        """Every cached output into the sorted index (the evicted ones' memory freed), the tail empty."""
        self.indexed = Corpus(list(self.outputs), self.depth, self.ahead, True)
        self.tail = Corpus([], self.depth, self.ahead, False)
        self.pending.clear()
        self.num_evicted = 0

    def clear(self) -> None:
        self.outputs.clear()
        self.reindex()

    @property
    def num_tail(self) -> int:
        return len(self.pending)

    @property
    def num_tokens(self) -> int:
        return self.indexed.size + self.tail.size


class SuffixProposer:
    """Proposals from the longest suffix match in the sequence's own tokens or in earlier requests' outputs; each
    a given token (a point mass to rejection sampling), whatever the request's sampling settings."""

    def __init__(self, k: int, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.depth, self.spec_factor, self.min_prob = max_tree_depth, max_spec_factor, min_token_prob
        self.ahead = k + 1
        self.cache = SuffixCache(max_cached_requests, max_tree_depth, self.ahead)
        self.local: dict[int, tuple[np.ndarray, int]] = {}  # seq_id → (padded buffer of its tokens, how many)
        self.cost = LookupCost()

    def _own(self, seq: Sequence) -> tuple[np.ndarray, int]:
        """seq's tokens as a padded buffer, grown by what it added since the last step."""
        toks = seq.token_ids
        buf, n = self.local.get(seq.seq_id, (np.full(self.depth, _NONE, np.int32), 0))
        if len(toks) > n:
            need = self.depth + len(toks) + self.ahead
            if need > len(buf):
                grown = np.full(max(need, 2 * len(buf)), _NONE, np.int32)
                grown[:self.depth + n] = buf[:self.depth + n]
                buf = grown
            buf[self.depth + n:self.depth + len(toks)] = toks[n:]
            n = len(toks)
            self.local[seq.seq_id] = (buf, n)
        return buf, n

    def speculate(self, seq: Sequence, k: int) -> list[int]:
        """Up to k proposals for seq (fewer for a short match or an uncertain continuation)."""
        buf, n = self._own(seq)
        pattern = buf[self.depth + n - min(n, self.depth):self.depth + n][::-1]  # newest first
        last = int(pattern[0])
        own = np.flatnonzero(buf[self.depth:self.depth + n - 1] == last) + self.depth  # not the last token itself
        best: tuple[list[int], float] = ([], 0.0)
        for source in ([(buf, own)], [(c.buf, c.positions(last)) for c in (self.cache.indexed, self.cache.tail)]):
            matched = [(b, *longest_match(b, p, pattern)) for b, p in source if p.size]
            if not matched:
                continue
            length = max(m for _, _, m in matched)
            limit = min(k, int(self.spec_factor * length))
            if best[1] >= limit:
                continue  # cannot score higher (each token's probability is at most 1)
            spec = walk([(b, p) for b, p, m in matched if m == length], limit, self.min_prob)
            if spec[1] > best[1]:
                best = spec
        return best[0]

    def propose(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, list[int], torch.Tensor | None]]:
        """(sequence, up to k proposals, None) for each (sequence, k) with a match."""
        t = time.perf_counter()
        out: list[tuple[Sequence, list[int], torch.Tensor | None]] = []
        for seq, k in batch:
            if spec := self.speculate(seq, k):
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
        """After a step: nothing to roll back (each step re-reads the sequence's tokens)."""

    def release(self, seq: Sequence) -> None:
        """seq finished (its output joins the cache), was aborted or was preempted (its buffer is rebuilt when it
        resumes)."""
        self.local.pop(seq.seq_id, None)
        if seq.status.finished:
            self.cache.add(seq.output_token_ids)

    def check_invariants(self) -> None:
        """Each buffer's pads intact (a match never looks before them)."""
        for buf, _ in self.local.values():
            assert (buf[:self.depth] == _NONE).all()
