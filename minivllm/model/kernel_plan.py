"""Per-shape kernel choice for the projection layers, made by timing on this machine at start-up.

What is fastest differs by CPU (oneDNN's prepacked GEMM wins at many tokens; a plain weight streamed
by csrc/gemv.c wins at one), so no choice is hard-coded: every layer type offers the kernels that
compute its math (`candidates()`), and `plan_kernels` times each on the model's own layers for each
shape class and binds the fastest to every layer (`kernels`, one per class).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

Kernel = Callable[[torch.Tensor], torch.Tensor]
# Shape classes by tokens in the matmul: one decode; a few (small batches, speculative checks); many
# (batches, prefill). (largest M of the class, M timed for it).
SHAPE_CLASSES = ((1, 1), (16, 8), (1 << 62, 64))
FEW = SHAPE_CLASSES[1][0]


class PlannedLinear(nn.Module):
    """A projection with several kernels for its math; forward runs the one planned for the input's M."""

    kernels: tuple[Kernel, Kernel, Kernel]

    def candidates(self) -> dict[str, Kernel]:
        """Kernel name → callable, for every kernel that computes this layer's math here."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        return (self.kernels[0] if m <= 1 else self.kernels[1] if m <= FEW else self.kernels[2])(x)


def _time(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.no_grad()
def plan_kernels(layers: list[PlannedLinear], kernel: str = "auto", what: str = "linear",
                 dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Time every candidate over all `layers` (so the time covers the real weight bytes) for each shape
    class, on activations of `dtype`, and bind the fastest, or force one by name. Returns shape class →
    kernel name."""
    if not layers:
        return {}
    names = list(layers[0].candidates())
    if kernel != "auto":
        if kernel not in names:
            raise ValueError(f"{what}: {kernel!r} has no kernel here; choose auto or one of {', '.join(names)}")
        names = [kernel]
    device = next(iter(layers[0].buffers()), next(iter(layers[0].parameters()), None))
    device = device.device if device is not None else torch.device("cpu")
    chosen: list[str] = []
    plan: dict[str, str] = {}
    for largest, m in SHAPE_CLASSES:
        best = names[0]
        if len(names) > 1:
            xs = {k: torch.randn(m, k, device=device, dtype=dtype) for k in {q.in_features for q in layers}}
            timings = {n: _time(lambda n=n, xs=xs: [q.candidates()[n](xs[q.in_features]) for q in layers])
                       for n in names}
            best = min(timings, key=timings.__getitem__)
            logger.info("%s, %d tokens: %s", what, m, ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in timings.items()))
        chosen.append(best)
        plan[f"m<={largest}" if largest < 1 << 62 else f"m>{FEW}"] = best
    for q in layers:
        candidates = q.candidates()
        q.kernels = tuple(candidates[n] for n in chosen)  # type: ignore[assignment]
    return plan
