"""How the one-token GEMV of float (f32, bf16) and W8A8 weights streams its weight rows, chosen at start-up by timing
both ways on the model's own layers (csrc/gemv_m1.h, gemv_m1_sequential).

M1_ROWS rows a pass share each load of x but read as many interleaved streams; row by row reads one sequential stream
per thread. Which streams faster is the memory system's business, not the ISA's: on a 2-vCPU AVX2 EPYC four rows a pass
streamed 1.2x one row; on a 2-vCPU Zen 4 EPYC (AVX-512) row by row decoded a 135M model's layers 1.34-1.40x as fast and
a 1B model's 1.19x, bf16 rows streamed 1.2-1.8x as fast, and W8A8's decode stacks ran 1.71x (135M) and 1.33x (1B). So
neither is hard-coded: both are timed on the first layers the kernel plan times (the same TIMED_WEIGHTS: past the
last-level cache), alternating, before the plan times the native kernel against oneDNN. The choice is process-wide (one
flag in the library); a second engine of the same layers in this process reuses the first one's timings.

W4A8's one-token rows (csrc/gemv_w4a8.c: four a pass with a prefetch two passes ahead, or one by one) depend on the
row's length as well: on that Zen 4 one by one read 4-8 KiB rows 1.4-1.6x as fast, tied at 1 KiB and lost below. So
its choice is a length (gemv_w4a8_seq_bytes: rows at least that long go one by one), timed per row length of the
model's W4A8 layers from the longest down, as long as one by one keeps winning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import Kernel, PlannedLinear, best_time, first_layers

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


@dataclass(frozen=True, slots=True)
class W4A8RowOrder:
    """Row length (weight bytes) from which W4A8's one-token rows go one by one (NEVER: none), and per row length
    timed, longest first, the seconds each order took (best round): (bytes, four a pass, one by one)."""

    seq_bytes: int
    timings: tuple[tuple[int, float, float], ...]


NEVER = (1 << 63) - 1  # csrc/gemv_w4a8.c's INT64_MAX: no W4A8 row one by one
_KEPT: dict[tuple[object, ...], RowOrder | W4A8RowOrder] = {}
_SEQUENTIAL = [False]  # the library's flag as last set here (it starts at 0)
_W4A8_SEQ_BYTES = [NEVER]  # gemv_w4a8_seq_bytes as last set here


def set_sequential(on: bool) -> None:
    """The one-token float and W8A8 rows streamed one by one (True) or several a pass (csrc/gemv_m1.h)."""
    lib = cpu_kernels.load_library()
    assert lib is not None
    lib.set_gemv_m1_sequential(int(on))
    _SEQUENTIAL[0] = bool(on)


def set_w4a8_seq_bytes(n: int) -> None:
    """W4A8's one-token rows of at least n weight bytes streamed one by one, the others four a pass."""
    lib = cpu_kernels.load_library()
    assert lib is not None
    lib.set_gemv_w4a8_seq_bytes(n)
    _W4A8_SEQ_BYTES[0] = n


def state() -> tuple[bool, int]:
    """Both choices as last set here (what native timings were made under; what a draft model restores)."""
    return _SEQUENTIAL[0], _W4A8_SEQ_BYTES[0]


def restore(saved: tuple[bool, int]) -> None:
    set_sequential(saved[0])
    set_w4a8_seq_bytes(saved[1])


def w8a8_ordered() -> bool:
    """Whether W8A8's one-token rows follow the order on this CPU (the AVX-512 VNNI path)."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.gemv_w8a8_rows_ordered())


def w4a8_ordered() -> bool:
    """Whether W4A8's one-token rows follow the row length set here (the AVX-512 VNNI path)."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.gemv_w4a8_rows_ordered())


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
    if not isinstance(kept, RowOrder):
        kernels = [(q.candidates()["native"], torch.randn(1, q.in_features, dtype=dtype)) for q in timed]
        best = _time_both(kernels, set_sequential)
        kept = RowOrder(best[True] < MARGIN * best[False], best[False], best[True])
        _KEPT[key] = kept
        logger.info("one-token GEMV rows: %s (row by row %.1f ms, interleaved passes %.1f ms, over %d layers)",
                    "row by row" if kept.sequential else "interleaved", kept.sequential_s * 1e3,
                    kept.interleaved_s * 1e3, len(timed))
    set_sequential(kept.sequential)
    return kept


def _time_both(kernels: Sequence[tuple[Kernel, torch.Tensor]], set_order: Callable[[bool], None]
               ) -> dict[bool, float]:
    """Best round's seconds over `kernels` (each on its x) with the order set each way (one by one: True),
    alternating which goes first (a burst of load skews both alike)."""

    def run() -> None:
        for kernel, x in kernels:
            kernel(x)

    best = {False: float("inf"), True: float("inf")}
    for r in range(ROUNDS):
        for seq in ((False, True) if r % 2 == 0 else (True, False)):
            set_order(seq)
            best[seq] = min(best[seq], best_time(run, reps=2))
    return best


def _w4a8_kernel(q: PlannedLinear) -> Kernel | None:
    """q's one-token kernel where it is csrc/gemv_w4a8.c's rows and they follow the length here: a W4A8 layer's
    native one (GGUF's Q4_0 / Q4_1 files by default too); None for any other layer (int4's native_a8 never runs a
    single token: QuantizedLinear.eligible)."""
    if getattr(q, "method", None) != "w4a8" or not w4a8_ordered():
        return None
    return q.candidates().get("native")


def _row_bytes(q: PlannedLinear) -> int:
    """Weight bytes of one of q's int4 rows (K rounded up to whole groups, two weights a byte)."""
    group = int(getattr(q, "group_size", 32))
    return -(-q.in_features // group) * group // 2


def _w4a8_order(n: int, one_by_one: bool) -> None:
    set_w4a8_seq_bytes(n if one_by_one else NEVER)


def one_by_one(row_bytes: int) -> bool:
    """Whether the library streams one-token W4A8 rows of row_bytes weight bytes one by one (its own test)."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.gemv_w4a8_one_by_one(row_bytes))


def choose_w4a8_rows(layers: Sequence[PlannedLinear]) -> W4A8RowOrder | None:
    """Time W4A8's one-token rows both ways per row length of the model's W4A8 layers (the first TIMED_WEIGHTS of
    each), longest first, and set the shortest length from which one by one wins at every longer one; None where
    no layer runs them here."""
    w4 = [q for q in layers if _w4a8_kernel(q) is not None]
    if not w4 or not cpu_kernels.available():
        return None
    by_length = {n: first_layers([q for q in w4 if _row_bytes(q) == n]) for n in
                 sorted({_row_bytes(q) for q in w4}, reverse=True)}
    key = ("w4a8", *(q.timing_key() for timed in by_length.values() for q in timed))
    kept = _KEPT.get(key)
    if not isinstance(kept, W4A8RowOrder):
        timings, seq_bytes = [], NEVER
        for n, timed in by_length.items():
            kernels = [(k, torch.randn(1, q.in_features)) for q in timed if (k := _w4a8_kernel(q)) is not None]
            best = _time_both(kernels, functools.partial(_w4a8_order, n))
            timings.append((n, best[False], best[True]))
            if not best[True] < MARGIN * best[False]:
                break
            seq_bytes = n
        kept = W4A8RowOrder(seq_bytes, tuple(timings))
        _KEPT[key] = kept
        logger.info("W4A8 one-token rows: %s (%s)", "four a pass" if seq_bytes == NEVER else
                    f"one by one from {seq_bytes} bytes", ", ".join(
                        f"{n} B rows: one by one {s * 1e3:.1f} ms, four a pass {i * 1e3:.1f} ms"
                        for n, i, s in timings))
    set_w4a8_seq_bytes(kept.seq_bytes)
    return kept
