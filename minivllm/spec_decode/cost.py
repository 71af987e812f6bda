"""Measured step costs for speculative decoding's adaptive rule: StepCostTable (all-decode steps by rows),
ProposerCostModel (a + b * forwards + c * rows: a draft model's round), LookupCost (a lookup proposer's round: seconds
per sequence looked up) and Payoff (whole steps' tokens per second, with and without proposals)."""

from __future__ import annotations

import bisect
import statistics
from collections import deque

import numpy as np

from minivllm.model.kernel_plan import shape_class


class ProposerCostModel:
    """A proposer's measured time per round as a + b * forwards + c * rows, least squares over recent rounds:
    a draft model's round is its forwards back to back (one per proposal position, the longest proposal
    sets how many), each costing more with the rows in it; a is the round's fixed part."""

    # Refit after this many new rounds: a fit costs tens of microseconds, and estimates are read several times
    # a step (refitting every step cost 10-20% of a small model's decode throughput).
    REFIT_EVERY = 16
    # Once fitted, a round is counted at most this many times its estimate. A one-off stall (a collection, a
    # neighbour's burst) is one sample of the window, but least squares spreads it over every estimate: on a
    # Sapphire Rapids-class Xeon a draft whose rounds took ~0.9 ms was priced at 30.7 ms, so its proposals were
    # withheld, few new rounds came to push the stall out of the window, and k=4 drafting ran 0.94-1.06x where the
    # same engine alone ran 1.7-1.9x. A sustained slowdown still raises the estimate (each round up to this much).
    OUTLIER = 3.0

    def __init__(self, window: int = 128) -> None:
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float, float] | None = None
        self._since = 0  # rounds observed since the last fit
        self._rows_known = False  # whether the rounds fitted tell a row's price from a forward's (see estimate)

    def observe(self, forwards: int, rows: int, seconds: float) -> None:
        """One round: forwards run, rows computed over them (proposals of every sequence), seconds taken (at most
        OUTLIER x the current estimate for such a round)."""
        if self.fit() is not None:
            seconds = min(seconds, self.OUTLIER * max(self.estimate(forwards, rows), 1e-6))
        self.samples.append((forwards, rows, seconds))
        self._since += 1

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None before 8 rounds were seen."""
        if len(self.samples) < 8:
            return None
        if self._fit is None or self._since >= self.REFIT_EVERY:
            self._fit, self._since = self._refit(), 0
        return self._fit

    def estimate(self, forwards: int, rows: int) -> float:
        """Seconds of a round of `forwards` forwards over `rows` rows; 0 before anything was measured, and before a fit
        each row at the lowest price per row a round has had: priced at nothing until the fit, a fresh engine's first
        8 rounds at 8 streams had every sequence propose its k tokens (a draft's rounds 1-4 ms against a 4 ms step:
        1174-2300 tokens/s against 2013 plain). Priced by rows, many sequences' rounds come out dear (a batched
        forward costs less than a row's price per row), so proposals there wait for the fit; the lowest price, not the
        mean, so one stalled round among the first cannot hold proposals back until the fit."""
        fit = self.fit()
        if fit is None:
            return min((s / max(r, 1) for _, r, s in self.samples), default=0.0) * rows
        if not self._rows_known and rows > forwards:
            # Rounds of one sequence each (rows == forwards) cannot tell a row's price from a forward's: the fit put
            # it all in the forwards, so a round of 8 sequences came out at one sequence's price (the draft: 0.64 ms
            # where it took 1.5-1.7; its proposals at 8 streams then ran 0.89x plain until the payoff stopped them).
            # Until rounds of several sequences are seen, a row beyond one a forward costs what a forward does (a
            # forward of two rows costs less than two forwards): a bound proposals must pay against.
            unit = fit[1] if fit[1] > 0 else fit[0] / max(forwards, 1)
            return fit[0] + fit[1] * forwards + unit * (rows - forwards)
        return fit[0] + fit[1] * forwards + fit[2] * rows

    def _refit(self) -> tuple[float, float, float]:
        x = np.array([(1.0, f, r) for f, r, _ in self.samples], dtype=np.float64)
        y = np.array([s for *_, s in self.samples], dtype=np.float64)
        # Only the terms the rounds seen can tell apart: at batch 1 rows == forwards (one term for both),
        # and a proposer that always runs the same round has its whole cost as the fixed part.
        keep = [0]
        for j in (1, 2):
            if np.linalg.matrix_rank(x[:, keep + [j]]) == len(keep) + 1:
                keep.append(j)
        self._rows_known = bool((x[:, 2] > x[:, 1]).any())  # a round of several sequences seen (see estimate)
        coef = [0.0, 0.0, 0.0]
        for j, c in zip(keep, np.linalg.lstsq(x[:, keep], y, rcond=None)[0], strict=True):
            coef[j] = float(c)
        b, c = max(coef[1], 0.0), max(coef[2], 0.0)
        mean = x.mean(axis=0)
        return max(float(y.mean() - b * mean[1] - c * mean[2]), 0.0), b, c


class LookupCost:
    """A lookup proposer's (n-gram, suffix) measured seconds per sequence looked up, the median of its last WINDOW
    rounds (a round that stalled is one sample, not the price). Priced at nothing, n-gram lookups took ~0.5 ms of a
    2.5 ms verification step at 8 streams on a Xeon (2026-12-06; 18 us a 250-token sequence since, 67 before): at 64
    sequences still over a millisecond a step that the adaptive rule did not weigh. In the step a round has a fixed part
    too (the forward leaves the interpreter's code and data cold: a round's first lookups ran 3.6x slower than the same
    lookups again, Zen 4), which a price per sequence spreads over small rounds' sequences, so large rounds come out
    dear. Fitted as a fixed part plus a part per sequence (Theil-Sen), n-gram's 64-sequence runs read 0.94-0.99x their
    plain engine in five bench runs (pooled pairs) against 0.99x in the one run priced per sequence, suffix 0.95-0.97x
    either way (2026-12-06, the Zen 4): too few runs to call a gain, so the dearer price stays."""

    WINDOW = 64
    REFIT_EVERY = 8  # rounds between medians (a median of 64 is microseconds: not every step)

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=self.WINDOW)
        self.per_seq = 0.0  # seconds a sequence, as of the last median; 0 before any round
        self._since = 0

    def observe(self, seqs: int, seconds: float) -> None:
        """One round: seqs sequences looked up in seconds."""
        if seqs <= 0:
            return
        self.samples.append(seconds / seqs)
        self._since += 1
        if self._since >= self.REFIT_EVERY or len(self.samples) <= self.REFIT_EVERY:
            self.per_seq, self._since = statistics.median(self.samples), 0

    def estimate(self, seqs: int) -> float:
        """Seconds a round looking up seqs sequences is expected to take."""
        return self.per_seq * seqs


class StepCostTable:
    """Measured forward seconds of all-decode steps by their rows (a verification step is one too: its
    proposals are decode rows). Each size keeps the median of its last few steps, and the sizes together are
    fitted by a non-decreasing curve (isotonic regression, pool adjacent violators, weighted by samples):
    a step never costs less with more rows, and step times here spread by half from one step to the next
    (62 rows measured 44 ms once, 64 rows 35 ms, 65 rows 22 ms), so a size's own few samples can be a slow
    outlier against which proposals look free, or a fast one against which they look hopeless. A step's
    cost is not one line in its rows: kernels change with the shape (one row streams each weight once with
    a GEMV, a handful more still does, many take a GEMM), so a size never measured is priced at the next
    measured size above it, or past the largest along the line from the smallest to it."""

    def __init__(self, keep: int = 5) -> None:
        self.samples: dict[int, deque[float]] = {}
        self.keep = keep
        # sizes whose one sample is a runner's first step of that size → that step's seconds as measured
        self._provisional: dict[int, float] = {}
        # by shape class (kernel_plan.shape_class: the kernels differ): what first steps took over their size's next
        self._setup: dict[int, deque[float]] = {}
        self._sizes: list[int] = []  # measured sizes, ascending
        self._median: dict[int, float] = {}  # per size, as of the last _medians
        self._stale: set[int] = set()  # sizes observed since
        self._fit: dict[int, float] | None = None  # the monotone fit, recomputed when read after an observe

    def observe(self, rows: int, seconds: float, first: bool = False) -> None:
        """One all-decode step of `rows` rows took `seconds` in the model; first: the runner's first step of that
        size, which set up its shapes (oneDNN's primitives: 1.4-3.4 ms more than the size's next step on the embedded
        model, 3-6 ms steps). Such a step prices its size, less the set-up that first steps of its shape class have
        measured (setup), until the size's next step replaces it. Dropped, a size seen once went unpriced and
        proposals past the largest size measured were priced along the line of the small ones (a GEMV's rows, far
        cheaper a row than a GEMM's), too cheap; kept whole, a size's first proposals, catch-ups paid, priced it so
        high that its next steps proposed nothing (a draft at 8 streams: one step of 11.8 ms of catch-ups a run)."""
        d = self.samples.get(rows)
        if d is None:
            d = self.samples[rows] = deque(maxlen=self.keep)
            bisect.insort(self._sizes, rows)
        if first and d:
            return  # (a set-up step where real ones priced the size: not its price)
        raw = self._provisional.pop(rows, None)
        if raw is not None:
            d.clear()
            self._setup.setdefault(shape_class(rows), deque(maxlen=16)).append(raw - seconds)
        if first:
            self._provisional[rows] = seconds
            # (never below a smaller size's price: that pools the smaller sizes' warm prices down with it)
            medians = self._medians()
            below = max((medians[s] for s in self._sizes if s < rows and s not in self._provisional), default=0.0)
            seconds = max(seconds - self.setup(rows), below)
        d.append(seconds)
        self._stale.add(rows)  # (its median when next read: most steps' observations are never read before the next)
        self._fit = None

    def _medians(self) -> dict[int, float]:
        """Each size's median, brought up to date."""
        for rows in self._stale:
            ordered = sorted(self.samples[rows])
            mid = len(ordered) // 2
            self._median[rows] = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        self._stale.clear()
        return self._median

    def setup(self, rows: int) -> float:
        """What a runner's first step of `rows` rows is measured to cost over the size's next one: the median over the
        sizes of its shape class seen twice (0 before any)."""
        d = self._setup.get(shape_class(rows))
        return max(statistics.median(d), 0.0) if d else 0.0

    def _fitted(self) -> dict[int, float]:
        """Pool adjacent violators over the sizes' medians: O(sizes), read many times between observes."""
        if self._fit is None:
            medians = self._medians()
            blocks: list[list[float]] = []  # [value, weight, sizes pooled]
            for size in self._sizes:
                blocks.append([medians[size], float(len(self.samples[size])), 1.0])
                while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                    v2, w2, n2 = blocks.pop()
                    v1, w1, n1 = blocks[-1]
                    blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
            values = [v for v, _, n in blocks for _ in range(int(n))]
            self._fit = dict(zip(self._sizes, values, strict=True))
        return self._fit

    def estimate(self, rows: int) -> float | None:
        """Seconds of an all-decode step of `rows` rows; None until two sizes (or this one) were measured.
        Between measured sizes, the next larger one's cost: the cost rises in jumps (measured here: 64 rows
        16.5 ms, 70-78 rows 17.8-26 ms, 151 rows 31.5 ms), which a straight line between 64 and 151 would
        price far too low. Past the largest size, along the line from the smallest measured size to the
        largest: each row adds the average a row added so far (at batch 1, with 1 and 2 rows measured, 6
        rows come out near their measured cost, where pricing in proportion to 2 rows' cost would price
        them at 3x theirs and keep longer proposals from ever being tried)."""
        fit = self._fitted()
        if rows in fit:
            return fit[rows]
        sizes = self._sizes
        if len(sizes) < 2:
            return None
        i = bisect.bisect_left(sizes, rows)
        if i < len(sizes):
            return fit[sizes[i]]
        lo, hi = sizes[0], sizes[-1]
        return fit[hi] + (fit[hi] - fit[lo]) / (hi - lo) * (rows - hi)

    def measured(self, rows: int) -> float | None:
        """A plain step of `rows` rows on the fitted curve, None if no step of exactly that size was seen."""
        return self._fitted()[rows] if rows in self.samples else None


class Payoff:
    """Tokens per second of whole pure-decode steps, with and without proposals, by the step's number of sequences:
    the medians of each kind's last WINDOW steps. A step with proposals counts the tokens its proposals were expected
    to yield (at the acceptance that chose them), not those they did: the verdict judges what proposals cost, which
    the cost model predicted; how well a sequence's proposals hold is its record's business (Speculator._factor).
    Counted as yielded, one request's poor guesses stopped the next one's good ones at batch 1 (the size's window
    mixes them): a draft lost a fifth of the tokens per second speculating every step gave.

    Where proposals are predicted to pay, every step of a size would speculate and its plain rate would never be
    measured (one plain step, the first, before any step cost was known) and the verdict never came. So once a size
    has speculated, every FIRST_EVERY-th of its steps goes plain until MIN_SAMPLES plain ones were seen, and one in
    every PLAIN_EVERY after that (at a 2.5x gain, 1.2% of the tokens): one plain step at a time, so a draft model
    falls one token behind, which its next round catches up on the decode stack."""

    WINDOW = 16
    MIN_SAMPLES = 6  # of each kind before a verdict (a step's time spreads widely from one to the next)
    FIRST_EVERY, PLAIN_EVERY = 4, 64

    def __init__(self) -> None:
        self.rates: dict[tuple[int, bool], deque[float]] = {}  # (sequences, with proposals) → tokens / s
        self.since_plain: dict[int, int] = {}  # sequences → steps that speculated since the last plain one

    def observe(self, num_seqs: int, speculated: bool, tokens: float, seconds: float) -> None:
        d = self.rates.setdefault((num_seqs, speculated), deque(maxlen=self.WINDOW))
        d.append(tokens / max(seconds, 1e-9))
        self.since_plain[num_seqs] = self.since_plain.get(num_seqs, 0) + 1 if speculated else 0

    def wants_plain(self, num_seqs: int) -> bool:
        """Whether the next step of num_seqs sequences should go without proposals, to measure the plain rate."""
        if (num_seqs, True) not in self.rates:
            return False  # (nothing to compare yet)
        plain = self.rates.get((num_seqs, False))
        every = self.FIRST_EVERY if plain is None or len(plain) < self.MIN_SAMPLES else self.PLAIN_EVERY
        return self.since_plain[num_seqs] >= every - 1

    def loses(self, num_seqs: int) -> bool:
        """Whether steps of num_seqs sequences have yielded less with proposals than without."""
        spec, plain = self.rates.get((num_seqs, True)), self.rates.get((num_seqs, False))
        if spec is None or plain is None or min(len(spec), len(plain)) < self.MIN_SAMPLES:
            return False
        return statistics.median(spec) < statistics.median(plain)
