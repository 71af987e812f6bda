"""How the one-token GEMV of float (f32, bf16) and W8A8 weights streams its weight rows, chosen at start-up by timing
both ways on the model's own layers (csrc/gemv_m1.h, gemv_m1_sequential).

M1_ROWS rows a pass share each load of x but read as many interleaved streams; row by row reads one sequential stream
per thread. Which streams faster is the memory system's business, not the ISA's: on a 2-vCPU AVX2 EPYC four rows a pass
streamed 1.2x one row; on a 2-vCPU Zen 4 EPYC (AVX-512) row by row decoded a 135M model's layers 1.34-1.40x as fast and
a 1B model's 1.19x, bf16 rows streamed 1.2-1.8x as fast, and W8A8's decode stacks ran 1.71x (135M) and 1.33x (1B). So
neither is hard-coded: both are timed on the first layers the kernel plan times (the same TIMED_WEIGHTS: past the
last-level cache), alternating, before the plan times the native kernel against oneDNN. The choice is process-wide (one
flag in the library); a second engine of the same layers in this process reuses the first one's timings.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import PlannedLinear, best_time, first_layers

logger = logging.getLogger(__name__)

ROUNDS = 3  # alternating rounds per order; each order's best round counts
MARGIN = 0.97  # row by row must be this much faster to be chosen (interleaved stays where they tie)
FLOATS = (torch.float32, torch.bfloat16)  # the weights (and activations) csrc/gemv_m1.h's rows take


@dataclass(frozen=True, slots=True)
class RowOrder:
    """The choice and the seconds each order took over the timed layers (best round)."""

    sequential: bool
    interleaved_s: float
    sequential_s: float


_KEPT: dict[tuple[object, ...], RowOrder] = {}
_SEQUENTIAL = [False]  # the library's flag as last set here (it starts at 0)


def set_sequential(on: bool) -> None:
    """The one-token float and W8A8 rows streamed one by one (True) or several a pass (csrc/gemv_m1.h)."""
    lib = cpu_kernels.load_library()
    assert lib is not None
    lib.set_gemv_m1_sequential(int(on))
    _SEQUENTIAL[0] = bool(on)


def sequential() -> bool:
    """The order set_sequential last set (what the kernel plan's native timings were made under)."""
    return _SEQUENTIAL[0]


def w8a8_ordered() -> bool:
    """Whether W8A8's one-token rows follow the order on this CPU (the AVX-512 VNNI path)."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.gemv_w8a8_rows_ordered())


def _streams_rows(q: PlannedLinear) -> bool:
    """Whether q's native one-token kernel reads the rows the flag orders: float weights, or W8A8's per-channel
    int8 where its AVX-512 VNNI rows run (not GGUF's Q8_0 blocks, read row by row always)."""
    if "native" not in q.candidates():
        return False
    w = getattr(q, "weight", None)
    if isinstance(w, torch.Tensor):
        return w.dtype in FLOATS
    return getattr(q, "method", None) == "w8a8" and not getattr(q, "blocked", True) and w8a8_ordered()


def choose_row_order(layers: Sequence[PlannedLinear], dtype: torch.dtype) -> RowOrder | None:
    """Time the native one-token kernel over the first float layers both ways (activations of `dtype`) and set the
    faster; None where no float32, bfloat16 or W8A8 layer runs natively here (nothing to choose)."""
    if dtype not in FLOATS or not cpu_kernels.available():
        return None
    timed = first_layers([q for q in layers if _streams_rows(q)])
    if not timed:
        return None
    key = (dtype, *(q.timing_key() for q in timed))
    kept = _KEPT.get(key)
    if kept is None:
        xs = {k: torch.randn(1, k, dtype=dtype) for k in {q.in_features for q in timed}}

        def run() -> None:
            for q in timed:
                q.candidates()["native"](xs[q.in_features])

        best = {False: float("inf"), True: float("inf")}
        for r in range(ROUNDS):
            for seq in ((False, True) if r % 2 == 0 else (True, False)):
                set_sequential(seq)
                best[seq] = min(best[seq], best_time(run, reps=2))
        kept = RowOrder(best[True] < MARGIN * best[False], best[False], best[True])
        _KEPT[key] = kept
        logger.info("one-token GEMV rows: %s (row by row %.1f ms, interleaved passes %.1f ms, over %d layers)",
                    "row by row" if kept.sequential else "interleaved", kept.sequential_s * 1e3,
                    kept.interleaved_s * 1e3, len(timed))
    set_sequential(kept.sequential)
    return kept
