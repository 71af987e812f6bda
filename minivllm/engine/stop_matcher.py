"""Stop strings matched in time proportional to the new text (an Aho-Corasick automaton over a request's stops).

Checking every stop string against the tail of the text after each token costs (number of stops) x (their
length) per token per sequence; with many long stops that froze the engine thread. The automaton reads each new
character once: its state is the longest suffix of the text that is a prefix of some stop, which is both what a
match is found from and the tail a stream must hold back (it could still grow into a stop). Built once per
request, shared by its samples; each detokenizer keeps only its state (an int).
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    """The automaton of one request's stop strings (immutable once built)."""

    __slots__ = ("stops", "goto", "fail", "depth", "out", "out_link", "max_len")

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.max_len = max((len(s) for s in stops), default=0)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        out = [-1]  # the first listed stop that ends at this node (is its whole path), else -1
        for i, s in enumerate(stops):
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = goto[node][ch] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    out.append(-1)
                node = nxt
            if out[node] == -1 and s:
                out[node] = i
        fail = [0] * len(goto)
        out_link = [-1] * len(goto)  # the nearest node down the failure chain where a stop ends
        queue = deque(goto[0].values())
        while queue:  # breadth first: a node's failure target is shallower, so already final
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                target = goto[f].get(ch, 0)
                fail[child] = target if target != child else 0
                out_link[child] = target if out[target] != -1 else out_link[target]
                queue.append(child)
        self.goto, self.fail, self.depth, self.out, self.out_link = goto, fail, depth, out, out_link

    def feed(self, state: int, text: str, offset: int) -> tuple[int, int, int]:
        """Read `text`, which starts at character `offset` of the whole text, from `state`.

        Returns (state after it, index of the stop matched, where that match starts): of the matches that end
        inside `text`, the one that starts first (the first listed on a tie); (state, -1, -1) when none."""
        goto, fail, out, out_link, depth = self.goto, self.fail, self.out, self.out_link, self.depth
        best, best_at = -1, -1
        for j, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            node = state if out[state] != -1 else out_link[state]
            while node > 0:  # every stop ending here (deepest first: they start earliest)
                at = offset + j + 1 - depth[node]
                if best == -1 or at < best_at or (at == best_at and out[node] < best):
                    best, best_at = out[node], at
                node = out_link[node]
        return state, best, best_at

    def holdback(self, state: int) -> int:
        """Characters at the end of the text that are a proper prefix of some stop string (held back while
        streaming, since they could still become one)."""
        while self.depth[state] >= self.max_len:  # a whole longest stop is not a proper prefix of one
            state = self.fail[state]
        return self.depth[state]
