"""Per-shape kernel choice for the projection layers, made by timing on this machine at start-up.

What is fastest differs by CPU (oneDNN's prepacked GEMM wins at many tokens; a plain weight streamed
by csrc/gemv.c wins at one), so no choice is hard-coded: every layer type offers the kernels that
compute its math (`candidates()`), and `plan_kernels` times each on the model's own layers for each
shape class and binds the fastest to every layer (`kernels`, one per class).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

Kernel = Callable[[torch.Tensor], torch.Tensor]
# Shape classes by tokens in the matmul: one decode; a handful (a batch-1 speculative verification of
# k + 1 rows, tiny batches), where a streamed weight still wins clearly (on an EPYC: native 4.3 ms vs
# oneDNN 5.4 ms for 5 rows of the embedded model, a tie at 8); a few (small batches); many (batches,
# prefill). (largest M of the class, M timed for it).
SHAPE_CLASSES = ((1, 1), (6, 4), (16, 10), (1 << 62, 64))
FEW = SHAPE_CLASSES[2][0]


def shape_class(m: int) -> int:
    """Index into SHAPE_CLASSES (and a layer's `kernels`) of a matmul over m tokens."""
    return 0 if m <= 1 else 1 if m <= 6 else 2 if m <= FEW else 3


class PlannedLinear(nn.Module):
    """A projection with several kernels for its math; forward runs the one planned for the input's M.

    `kernels` holds the methods' plain functions, not bound methods: a bound method references its
    module, and that cycle would keep every model (and the KV pool its layers view) alive until the
    cyclic garbage collector happens to run."""

    in_features: int
    out_features: int
    kernels: tuple[Callable[..., torch.Tensor], ...]
    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # LoRA slots (model/lora.py), if on

    def candidates(self) -> dict[str, Kernel]:
        """Kernel name → bound method, for every kernel that computes this layer's math here."""
        raise NotImplementedError

    def eligible(self, name: str, largest_m: int) -> bool:
        """Whether kernel `name` may run matmuls of the shape class whose largest M is largest_m."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernels[shape_class(x.shape[0])](self, x)
        return out if self.lora is None else self.lora(x, out)


def best_time(fn: Callable[[], object], reps: int = 3) -> float:
    """Fastest of `reps` timed calls after one warm-up call (seconds)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _timed_or_refused(fn: Callable[[], object], name: str, what: str, m: int) -> float:
    """best_time, or inf where the kernel refuses this shape on this device (CUDA's torch._int_mm wants M > 16)."""
    try:
        return best_time(fn)
    except RuntimeError as e:
        logger.info("%s, %d tokens: %s refused (%s)", what, m, name, str(e).splitlines()[0][:200])
        return float("inf")


# Timing covers the first layers up to this many weights (all of them for a small model): well past the
# last-level cache, so the times are the streaming ones, without timing a 1B model three times over.
TIMED_WEIGHTS = 64 * 2**20


@torch.no_grad()
def plan_kernels(layers: Sequence[PlannedLinear], kernel: str = "auto", what: str = "linear",
                 dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Time every candidate over the model's own layers (the first TIMED_WEIGHTS weights of them) for each
    shape class, on activations of `dtype`, and bind the fastest to all `layers`, or force one by name.
    Returns shape class → kernel name."""
    if not layers:
        return {}
    names = list(layers[0].candidates())
    if kernel != "auto":
        if kernel not in names:
            raise ValueError(f"{what}: {kernel!r} has no kernel here; choose auto or one of {', '.join(names)}")
        names = [kernel]
    elif "onednn" in names and "torch" in names:
        names.remove("torch")  # aten's path ran 2.1-2.5x slower than oneDNN at every M measured; never timed
    timed, total = [], 0
    for q in layers:
        timed.append(q)
        total += q.in_features * q.out_features
        if total >= TIMED_WEIGHTS:
            break
    first = next(iter(layers[0].buffers()), next(iter(layers[0].parameters()), None))
    device = first.device if first is not None else torch.device("cpu")
    chosen: list[str] = []
    plan: dict[str, str] = {}

    def run_timed(name: str, xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Every timed layer through its kernel `name`."""
        return [q.candidates()[name](xs[q.in_features]) for q in timed]

    every = list(layers[0].candidates())
    for largest, m in SHAPE_CLASSES:
        fits = [n for n in names if layers[0].eligible(n, largest)]
        # (a kernel forced by name where it may not run: the native kernel there, else the portable one)
        fits = fits or [next(n for n in ("native", "reference") if n in every and layers[0].eligible(n, largest))]
        best = fits[0]
        if len(fits) > 1:
            xs = {k: torch.randn(m, k, device=device, dtype=dtype) for k in {q.in_features for q in timed}}
            timings = {n: _timed_or_refused(functools.partial(run_timed, n, xs), n, what, m) for n in fits}
            best = min(timings, key=timings.__getitem__)
            logger.info("%s, %d tokens: %s", what, m, ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in timings.items()))
        chosen.append(best)
        plan[f"m<={largest}" if largest < 1 << 62 else f"m>{FEW}"] = best
    for q in layers:
        candidates = q.candidates()
        q.kernels = tuple(candidates[n].__func__ for n in chosen)  # type: ignore[attr-defined]
    return plan
