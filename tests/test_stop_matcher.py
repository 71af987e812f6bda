"""The stop-string automaton against the direct rule it replaces: the first-starting stop among the matches that
end in the new text (the first listed on a tie), and the longest tail that is a proper prefix of a stop."""

from __future__ import annotations

import random

from minivllm.engine.stop_matcher import StopMatcher


def _direct_match(text: str, new_from: int, stops: list[str]) -> tuple[int, int]:
    best, best_at = -1, len(text)
    for i, s in enumerate(stops):
        at = text.find(s, max(0, new_from - len(s) + 1))
        if at != -1 and at < best_at:
            best, best_at = i, at
    return (best, best_at) if best != -1 else (-1, -1)


def _direct_holdback(text: str, stops: list[str]) -> int:
    longest = max(map(len, stops))
    for k in range(min(longest - 1, len(text)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


def test_matches_and_holdback_equal_the_direct_rule_on_random_text():
    rng = random.Random(0)
    checked = matched = 0
    for _ in range(2000):
        alphabet = rng.choice(["ab", "abc", "a😀b"])
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        matcher, text, state = StopMatcher(stops), "", 0
        for _ in range(12):
            piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            new_from = len(text)
            text += piece
            state, index, at = matcher.feed(state, piece, new_from)
            assert (index, at) == _direct_match(text, new_from, stops), (stops, text, new_from)
            checked += 1
            if index != -1:
                matched += 1
                break
            assert matcher.holdback(state) == _direct_holdback(text, stops), (stops, text)
    assert checked > 5000 and matched > 1000


def test_overlapping_and_nested_stops():
    m = StopMatcher(["abcd", "bc", "c"])
    assert m.feed(0, "xabcd", 0)[1:] == (0, 1)  # "abcd" starts first, though "bc" and "c" end first
    m = StopMatcher(["bc", "b"])
    assert m.feed(0, "abc", 0)[1:] == (0, 1)  # same start: the first listed
    state, index, _ = m.feed(0, "ab", 0)
    assert index == 1
    m = StopMatcher(["<|end|>"])
    state, index, _ = m.feed(0, "text <|e", 0)
    assert index == -1 and m.holdback(state) == 3
    state, index, at = m.feed(state, "nd|> more", 8)
    assert (index, at) == (0, 5)


def test_many_long_stops_build_a_bounded_automaton():
    """The server's limits (64 stops of 1024 characters): one node per distinct prefix, and a step reads each new
    character once (a text of 20,000 characters with no stop in it leaves the state at a real prefix)."""
    rng = random.Random(1)
    stops = ["".join(rng.choice("abcdefgh") for _ in range(1024)) for _ in range(64)]
    m = StopMatcher(stops)
    assert len(m.goto) <= 64 * 1024 + 1
    text = "".join(rng.choice("abcdefgh") for _ in range(20_000))
    state, index, _ = m.feed(0, text, 0)
    assert index == -1 and m.holdback(state) == _direct_holdback(text[-1100:], stops)
