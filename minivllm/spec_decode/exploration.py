"""When the adaptive speculation rule tries proposals that its measurements say would not pay: one exploration
clock per batch size, whose wait doubles after explorations that found nothing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ExploreClock:
    """One batch size's exploration clock: the steps of that size seen, the count at its last step that speculated,
    and how many steps of that size without speculation it waits before the next exploration."""

    wait: int
    steps: int = 0
    last: int = 0


class Exploration:
    """Every EXPLORE_EVERY steps of a batch size without speculation, the best proposal goes through anyway, so one
    unlucky measurement cannot switch speculation off for good.

    An exploration that proposals do not follow (the next steps again find they would not pay) doubles the wait for
    the next one, up to EXPLORE_MAX; a step that speculates on its own merits resets it. An exploration costs a draft
    model a catch-up on everything it skipped (~220 tokens of one sequence through its prefill path, 5-8 ms: 1.5-2% of
    a 128-token run at 8 streams, where the draft never pays). Each batch size keeps its own clock (steps of that
    size): with one clock for all, a request alone, where the draft pays every step, started the wait at 8 streams
    over at 128, so every 8-stream run of the speculation bench (a 1-stream run between each) paid an exploration and
    lost 2-2.5% to its attached draft (2026-12-05)."""

    EXPLORE_EVERY = 128
    EXPLORE_MAX = 1024

    __slots__ = ("clocks",)

    def __init__(self) -> None:
        self.clocks: dict[int, ExploreClock] = {}  # batch size → its clock

    def clock(self, num_seqs: int) -> ExploreClock:
        c = self.clocks.get(num_seqs)
        if c is None:
            c = self.clocks[num_seqs] = ExploreClock(wait=self.EXPLORE_EVERY)
        return c

    def tick(self, num_seqs: int) -> None:
        """A step of num_seqs sequences begins."""
        self.clock(num_seqs).steps += 1

    def due(self, num_seqs: int) -> bool:
        """Whether steps of num_seqs sequences have gone without speculation long enough to try proposals anyway."""
        c = self.clocks.get(num_seqs)
        return c is not None and c.steps - c.last >= c.wait

    def skipped(self, num_seqs: int) -> None:
        """An exploration of num_seqs sequences was due but had nothing to try cheaply (Speculator.FORCED_CATCH_UP):
        the wait doubles as after an exploration that found nothing."""
        self.speculated(num_seqs, True)

    def speculated(self, num_seqs: int, exploring: bool) -> None:
        """This step of num_seqs sequences speculates: an exploration lengthens that size's wait for the next one, any
        other step resets it."""
        c = self.clock(num_seqs)
        c.wait = min(2 * c.wait, self.EXPLORE_MAX) if exploring else self.EXPLORE_EVERY
        c.last = c.steps
