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
    handful more still does, many take a GEMM), so sizes never measured are interpolated between their
    measured neighbours, or extrapolated from the two largest (smallest) sizes seen."""

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

    def _at(self, rows: int) -> float:
        return self._median[rows]

    def estimate(self, rows: int) -> float | None:
        """Seconds of an all-decode step of `rows` rows; None until two sizes (or this one) were measured."""
        if rows in self.samples:
            return self._at(rows)
        sizes = self._sizes
        if len(sizes) < 2:
            return None
        i = bisect.bisect_left(sizes, rows)
        lo, hi = (sizes[i - 1], sizes[i]) if 0 < i < len(sizes) else (sizes[-2], sizes[-1]) if i else (sizes[0],
                                                                                                        sizes[1])
        c_lo, c_hi = self._at(lo), self._at(hi)
        slope = max((c_hi - c_lo) / (hi - lo), 0.0)  # more rows never cost less
        return max(c_lo + slope * (rows - lo), 0.0) if rows > lo else max(c_lo - slope * (lo - rows), 0.0)
