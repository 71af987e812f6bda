"""StepCostModel: a step's measured cost as a + b * size, for speculative decoding's adaptive rule."""

from __future__ import annotations

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
