"""Measured step costs for speculative decoding's adaptive rule: StepCostTable (all-decode steps by rows)
and StepCostModel (a + b * size: a proposer's own cost by sequences)."""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np


class StepCostModel:
    """The forward's measured cost as a + b * tokens, least squares over recent steps of one kind: a is
    what a step costs whatever it holds (reading the weights), b what each more token adds (its FLOPs)."""

    # Refit after this many new steps: a fit costs tens of microseconds, several are read per step, and a
    # step of a small model costs ~2 ms (refitting every step cost 10-20% of decode throughput).
    REFIT_EVERY = 16

    def __init__(self, window: int = 128) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._since = 0  # steps observed since the last fit

    def observe(self, tokens: int, seconds: float) -> None:
        """One step: tokens computed, forward seconds."""
        self.samples.append((tokens, seconds))
        self._since += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until the steps seen differ enough in size to tell them apart."""
        if len(self.samples) < 8:
            return None
        if self._fit is None or self._since >= self.REFIT_EVERY:
            self._fit, self._since = self._refit(), 0
        return self._fit

    def _refit(self) -> tuple[float, float]:
        x = np.array([t for t, _ in self.samples], dtype=np.float64)
        y = np.array([s for _, s in self.samples], dtype=np.float64)
        if x.max() - x.min() < 2:  # steps of one size (a batch-1 decode): its cost, at that size
            return float(y.mean()), 0.0
        b = float(np.cov(x, y, bias=True)[0, 1] / x.var())
        b = max(b, 0.0)
        return max(float(y.mean() - b * x.mean()), 0.0), b


class StepCostTable:
    """Measured forward seconds of all-decode steps by their rows (a verification step is one too: its
    proposals are decode rows), the median of the last few steps of each size. A step's cost is not one
    line in its rows: kernels change with the shape (one row streams each weight once with a GEMV, a
    handful more still does, many take a GEMM), so a size never measured is priced at the next measured
    size above it, or past the largest in proportion to it."""

    def __init__(self, keep: int = 5) -> None:
        self.samples: dict[int, deque[float]] = {}
        self.keep = keep
        self._sizes: list[int] = []  # measured sizes, ascending
        self._median: dict[int, float] = {}  # kept current by observe: estimates are read many times a step

    def observe(self, rows: int, seconds: float) -> None:
        """One all-decode step of `rows` rows took `seconds` in the model."""
        d = self.samples.get(rows)
        if d is None:
            d = self.samples[rows] = deque(maxlen=self.keep)
            bisect.insort(self._sizes, rows)
        d.append(seconds)
        ordered = sorted(d)
        mid = len(ordered) // 2
        self._median[rows] = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    def estimate(self, rows: int) -> float | None:
        """Seconds of an all-decode step of `rows` rows; None until two sizes (or this one) were measured.
        Between measured sizes, the next larger one's cost: a step never costs less with more rows, and the
        cost rises in jumps (measured here: 64 rows 16.5 ms, 70-78 rows 17.8-26 ms, 151 rows 31.5 ms), which a
        straight line between 64 and 151 would price far too low. Past the largest size, proportionally to
        the largest's cost per row (no fixed part assumed: an upper bound while the fixed part is real)."""
        if rows in self._median:
            return self._median[rows]
        sizes = self._sizes
        if len(sizes) < 2:
            return None
        i = bisect.bisect_left(sizes, rows)
        if i < len(sizes):
            return self._median[sizes[i]]
        hi = sizes[-1]
        return self._median[hi] * rows / hi

    def measured(self, rows: int) -> float | None:
        """The median of steps of exactly `rows` rows, None if none was seen."""
        return self._median.get(rows)
