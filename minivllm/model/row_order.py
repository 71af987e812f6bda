"""How the one-token GEMV rows stream their weights, chosen at start-up by timing each way on the model's own layers.

Float (f32, bf16) and W8A8 rows (csrc/gemv_m1.h, gemv_m1_order): M1_ROWS rows a pass share each load of x but read as
many interleaved streams; row by row reads one sequential stream per thread; pairs read two rows a pass, their loads
alternating cache line by cache line. GGUF's Q8_0, Q4_K and Q6_K rows against x in blocks go two a pass in pairs, one
by one otherwise. Which streams fastest is the memory system's business, not the ISA's: on a
2-vCPU AVX2 EPYC four rows a pass streamed 1.2x one row; on a 2-vCPU Zen 4 EPYC (AVX-512) row by row decoded a 135M
model's layers 1.34-1.40x as fast and a 1B model's 1.19x, bf16 rows streamed 1.2-1.8x as fast, and W8A8's decode
stacks ran 1.71x (135M) and 1.33x (1B); on a 2-vCPU Sapphire Rapids-class Xeon those two tied and pairs decoded a
135M model's f32 layers 1.11-1.125x as fast, a 1B model's W8A8 layers 1.08x. So none is hard-coded: each is timed
on the model's first layers, alternating, before the plan times the native kernel against oneDNN; the passes stay
unless another beats them by MARGIN. The choice is process-wide (one setting in the library); a second engine of the
same layers in this process reuses the first one's timings.

W4A8's one-token rows (csrc/gemv_w4a8.c: four or two rows a pass with a prefetch two passes ahead, or one by one)
depend on the row's length as well: on that Zen 4 one by one read 4-8 KiB rows 1.4-1.6x as fast, tied at 1 KiB and
lost below; on that Xeon two rows a pass decoded a 1B model 1.19x as fast as four, at every length. So its choice is
the rows a pass (gemv_w4a8_pass_rows), then a length (gemv_w4a8_seq_bytes: rows at least that long go one by one),
from the longest of the model's lengths down as long as one by one keeps winning. int4's rows against a bfloat16
model's x (AVX512-BF16's dot product, csrc/gemv_int4_bf16dot.h) or x as int16 (a float32 x by AVX512-VNNI's,
csrc/gemv_int4_int16dot.h; any x by AVX2's, csrc/gemv_avx2.h) read the same layout the same way and follow the same
choice, timed on them in such a model.

With the order, a prefetch into L2 some bytes ahead of each load (none, PREFETCH_BYTES; W4A8: its prefetch two passes
ahead into L2 rather than L1): on that Xeon the hardware prefetcher alone left the rows' loads waiting (a 1B model's
W8A8 decode 1.12x as fast with 8 KiB ahead, bf16 1.04x with 4 KiB, W4A8 1.04x into L2), while f32 lost 0.97-0.99x.
Each order is timed at each distance, the pair kept only where it beats the passes without one by MARGIN: timed the
order first (without a prefetch), then the distance in it, a 1B bf16 model on another Xeon (family 6 model 207) kept
the passes without one (23.6 ms over its timed layers), where rows read one by one, slowest alone (27.2 ms), were
fastest prefetched 4-8 KiB ahead (20.7 ms; its decode 1.13x as fast).

Float rows at a few tokens (2..4, csrc/gemv_avx512.h's FEW_ROWS_MAX_M: a verification's rows, a few sequences' decode)
read 8, 5 or 4 rows a pass; short rows read one by one instead streamed 1.24-1.35x as fast at 384 floats on that
Zen 4, tied at 1024 and lost from 1536 (gemv_few_rows_k: rows of at most that many weights go one by one). Timed
like W4A8's length: from the model's shortest row length up, as long as one by one keeps winning.

The timings read at least TIMED_LLC times the last-level cache's bytes of weights in the model's order (all of a
smaller model), as a decode step streams them (model/timed_layers.py says why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import Kernel, PlannedLinear, best_time
from minivllm.model.timed_layers import timed_layers

logger = logging.getLogger(__name__)
T = TypeVar("T")

ROUNDS = 3  # alternating rounds per order; each order's best round counts
MARGIN = 0.97  # another order must be this much faster than the passes to be chosen (the passes stay where they tie)
FLOATS = (torch.float32, torch.bfloat16)  # the weights (and activations) csrc/gemv_m1.h's rows take
# csrc/gemv_m1.h's orders, by their values there (M1_PASS, M1_ONE, M1_PAIRS)
PASS, ONE, PAIRS = 0, 1, 2
ORDERS = (PASS, ONE, PAIRS)
ORDER_NAMES = {PASS: "interleaved passes", ONE: "row by row", PAIRS: "pairs"}
NEVER = (1 << 63) - 1  # csrc/gemv_w4a8.c's INT64_MAX: no W4A8 row one by one
PREFETCH_BYTES = (0, 4096, 8192)  # the float and W8A8 rows' prefetch distances timed (0: none, the default)
FEW_TOKENS = 3  # tokens the few-token rows are timed at (csrc/gemv_avx512.h's FEW_ROWS_MAX_M: 2..4 take the setting)


@dataclass(frozen=True, slots=True)
class RowOrder:
    """The chosen order and prefetch distance, and the seconds each (order, distance) took over the timed layers (best
    round), every order at each of PREFETCH_BYTES in turn."""

    order: int
    prefetch: int
    timings: tuple[tuple[tuple[int, int], float], ...]


@dataclass(frozen=True, slots=True)
class W4A8RowOrder:
    """W4A8's one-token rows: pass_rows (4, or 2) a pass where shorter than seq_bytes weight bytes, one by one from
    there (NEVER: none); and each configuration timed, in the order timed, with its best round's seconds:
    ((pass_rows, seq_bytes), seconds); then whether the passes prefetch into L2 (else L1) and the seconds of each
    (L1, L2) in the chosen configuration."""

    pass_rows: int
    seq_bytes: int
    timings: tuple[tuple[tuple[int, int], float], ...]
    l2: bool = False
    l2_seconds: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class FewRows:
    """Float rows of at most `k` weights go one by one at a few tokens (0: none); each length timed, in the order
    timed, with its best round's seconds (the first: none one by one)."""

    k: int
    timings: tuple[tuple[int, float], ...]


_KEPT: dict[tuple[object, ...], RowOrder | W4A8RowOrder | FewRows] = {}
_ORDER = [PASS]  # the library's order as last set here (it starts at M1_PASS)
_W4A8 = [(4, NEVER)]  # gemv_w4a8_pass_rows and gemv_w4a8_seq_bytes as last set here
_PREFETCH = [0, False]  # gemv_m1_prefetch and gemv_w4a8_prefetch_l2 as last set here
_FEW = [0]  # gemv_few_rows_k as last set here


def set_order(order: int) -> None:
    """The order the one-token float and W8A8 rows stream in (csrc/gemv_m1.h): PASS, ONE or PAIRS."""
    assert order in ORDERS, order
    lib = cpu_kernels.load_library()
    assert lib is not None
    lib.set_gemv_m1_order(order)
    _ORDER[0] = order


def set_w4a8_rows(pass_rows: int, seq_bytes: int) -> None:
    """W4A8's one-token rows of at least seq_bytes weight bytes streamed one by one, the others pass_rows a pass."""
    assert pass_rows in (2, 4), pass_rows
    lib = cpu_kernels.load_library()
    assert lib is not None
    lib.set_gemv_w4a8_pass_rows(pass_rows)
    lib.set_gemv_w4a8_seq_bytes(seq_bytes)
    _W4A8[0] = (pass_rows, seq_bytes)


def set_prefetch(nbytes: int) -> None:
    """Bytes ahead of each load the one-token float and W8A8 rows prefetch into L2 (0: none); the same bits."""
    assert nbytes >= 0, nbytes
    lib = cpu_kernels.load_library()
    assert lib is not None
    lib.set_gemv_m1_prefetch(nbytes)
    _PREFETCH[0] = nbytes


def set_w4a8_prefetch_l2(l2: bool) -> None:
    """Whether W4A8's one-token passes prefetch two passes ahead into L2 (else L1); the same bits."""
    lib = cpu_kernels.load_library()
    assert lib is not None
    lib.set_gemv_w4a8_prefetch_l2(int(l2))
    _PREFETCH[1] = bool(l2)


def set_few_rows_k(k: int) -> None:
    """Float rows of at most k weights streamed one by one at a few tokens (0: none); the same sums, another order."""
    assert k >= 0, k
    lib = cpu_kernels.load_library()
    assert lib is not None
    lib.set_gemv_few_rows_k(k)
    _FEW[0] = k


State = tuple[int, tuple[int, int], int, bool, int]


# The library's settings before anything is set (and what tests put back): the passes, W4A8's four a pass and never one
# by one, no prefetch, W4A8's prefetch into L1, no few-token rows one by one.
DEFAULT: State = (PASS, (4, NEVER), 0, False, 0)


def state() -> State:
    """Every choice as last set here (what native timings were made under; what a draft model restores): the order,
    W4A8's (pass_rows, seq_bytes), the prefetch distance, W4A8's prefetch into L2, the few-token rows' length."""
    return _ORDER[0], _W4A8[0], int(_PREFETCH[0]), bool(_PREFETCH[1]), _FEW[0]


def restore(saved: State) -> None:
    set_order(saved[0])
    set_w4a8_rows(*saved[1])
    set_prefetch(saved[2])
    set_w4a8_prefetch_l2(saved[3])
    set_few_rows_k(saved[4])


def w8a8_ordered() -> bool:
    """Whether W8A8's one-token rows follow the order on this CPU (the AVX-512 VNNI path, and AVX2's for W4A8)."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.gemv_w8a8_rows_ordered())


def w4a8_ordered() -> bool:
    """Whether W4A8's one-token rows follow the choice made here (the AVX-512 VNNI path, and AVX2's for W4A8)."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.gemv_w4a8_rows_ordered())


def few_rows_ordered() -> bool:
    """Whether the few-token float rows follow gemv_few_rows_k on this CPU (the AVX-512 rows)."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.gemv_few_rows_ordered())


def one_by_one(row_bytes: int) -> bool:
    """Whether the library streams one-token W4A8 rows of row_bytes weight bytes one by one (its own test)."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.gemv_w4a8_one_by_one(row_bytes))


def _streams_rows(q: PlannedLinear) -> bool:
    """Whether q's native one-token kernel reads its rows in the order set here: float weights, or int8 codes against
    int8 x where AVX-512 VNNI's rows run (W8A8's per-channel rows in every order; GGUF's Q8_0, Q4_K and Q6_K blocks
    against x in blocks, two a pass in pairs and one by one otherwise)."""
    if "native" not in q.candidates():
        return False
    if isinstance(getattr(q, "weight", None), torch.Tensor):
        return _float_rows(q)
    return getattr(q, "method", None) == "w8a8" and w8a8_ordered()


def _float_rows(q: PlannedLinear) -> bool:
    """Whether q's native kernel reads float (f32, bf16) weight rows."""
    w = getattr(q, "weight", None)
    return isinstance(w, torch.Tensor) and w.dtype in FLOATS and "native" in q.candidates()


def _time_each(kernels: Sequence[tuple[Kernel, torch.Tensor]], configs: Sequence[T],
               set_config: Callable[[T], None]) -> dict[T, float]:
    """Best round's seconds over `kernels` (each on its x) with each of `configs` set, their order reversed every
    other round (a burst of load skews them all alike)."""

    def run() -> None:
        for kernel, x in kernels:
            kernel(x)

    best = {c: float("inf") for c in configs}
    for r in range(ROUNDS):
        for c in (configs if r % 2 == 0 else configs[::-1]):
            set_config(c)
            best[c] = min(best[c], best_time(run, reps=2))
    return best


def _set_order_prefetch(config: tuple[int, int]) -> None:
    set_order(config[0])
    set_prefetch(config[1])


def choose_row_order(layers: Sequence[PlannedLinear], dtype: torch.dtype) -> RowOrder | None:
    """Time the native one-token kernel over the first float layers in each order (activations of `dtype`) and set
    the fastest; None where no float32, bfloat16 or W8A8 layer runs natively here (nothing to choose)."""
    if dtype not in FLOATS or not cpu_kernels.available():
        return None
    timed = timed_layers([q for q in layers if _streams_rows(q)])
    if not timed:
        return None
    key = (dtype, *(q.timing_key() for q in timed))
    kept = _KEPT.get(key)
    if not isinstance(kept, RowOrder):
        kernels = [(q.candidates()["native"], torch.randn(1, q.in_features, dtype=dtype)) for q in timed]
        configs = [(o, b) for o in ORDERS for b in PREFETCH_BYTES]
        best = _time_each(kernels, configs, _set_order_prefetch)
        fastest = min(configs, key=lambda c: best[c])
        order, ahead = fastest if best[fastest] < MARGIN * best[(PASS, 0)] else (PASS, 0)
        kept = RowOrder(order, ahead, tuple((c, best[c]) for c in configs))
        _KEPT[key] = kept
        logger.info("one-token GEMV rows: %s, prefetch %s (%s ms at %s B ahead; over %d layers)",
                    ORDER_NAMES[kept.order], f"{kept.prefetch} B ahead" if kept.prefetch else "none",
                    ", ".join(f"{ORDER_NAMES[o]} " + "/".join(f"{best[(o, b)] * 1e3:.1f}" for b in PREFETCH_BYTES)
                              for o in ORDERS), "/".join(map(str, PREFETCH_BYTES)), len(timed))
    set_order(kept.order)
    set_prefetch(kept.prefetch)
    return kept


def int4_bf16dot() -> bool:
    """Whether int4's one-token rows take a bf16 x by AVX512-BF16's dot product here (csrc/gemv_int4_bf16dot.h),
    in W4A8's order."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.gemv_int4_bf16dot())


def int4_int16_ordered() -> bool:
    """Whether int4's one-token rows take x as int16 in W4A8's order here: a float32 x by AVX512-VNNI's vpdpwssd
    (csrc/gemv_int4_int16dot.h), or any x by AVX2's vpmaddwd (csrc/gemv_avx2.h)."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.gemv_int4_int16_ordered())


def _w4a8_kernel(q: PlannedLinear, dtype: torch.dtype) -> Kernel | None:
    """q's one-token kernel where it is csrc/gemv_w4a8.c's rows and they follow the choice here: a W4A8 layer's
    native one (GGUF's Q4_0 / Q4_1 files by default too), or an int4 layer's where its rows follow W4A8's order (a
    bf16 x by AVX512-BF16's dot product, any other x as int16 by AVX512-VNNI's); None for any other layer (int4's
    native_a8 never runs a single token: QuantizedLinear.eligible)."""
    method = getattr(q, "method", None)
    ordered_int4 = method == "int4" and ((dtype == torch.bfloat16 and int4_bf16dot()) or int4_int16_ordered())
    if not ordered_int4 and (method != "w4a8" or not w4a8_ordered()):
        return None
    return q.candidates().get("native")


def _row_bytes(q: PlannedLinear) -> int:
    """Weight bytes of one of q's int4 rows (K rounded up to whole groups, two weights a byte)."""
    group = int(getattr(q, "group_size", 32))
    return -(-q.in_features // group) * group // 2


def _set_w4a8(config: tuple[int, int]) -> None:
    set_w4a8_rows(*config)


def choose_w4a8_rows(layers: Sequence[PlannedLinear], dtype: torch.dtype = torch.float32) -> W4A8RowOrder | None:
    """Time W4A8's one-token rows over the model's W4A8 layers (or its int4 layers where their rows
    follow W4A8's order), x as the model's activations round it: four against two rows a pass, then one by one from
    each of their row lengths, longest first, while it wins; set the fastest. None where no layer runs them here."""
    w4 = [q for q in layers if _w4a8_kernel(q, dtype) is not None]
    if not w4 or not cpu_kernels.available():
        return None
    timed = timed_layers(w4)
    key = ("w4a8", dtype, *(q.timing_key() for q in timed))
    kept = _KEPT.get(key)
    if not isinstance(kept, W4A8RowOrder):
        kernels = [(k, torch.randn(1, q.in_features).to(dtype).float()) for q in timed
                   if (k := _w4a8_kernel(q, dtype)) is not None]
        set_w4a8_prefetch_l2(False)
        best = _time_each(kernels, [(4, NEVER), (2, NEVER)], _set_w4a8)
        current = (2, NEVER) if best[(2, NEVER)] < MARGIN * best[(4, NEVER)] else (4, NEVER)
        timings = list(best.items())
        for n in sorted({_row_bytes(q) for q in timed}, reverse=True):
            trial = (current[0], n)
            best = _time_each(kernels, [current, trial], _set_w4a8)
            timings.append((trial, best[trial]))
            if not best[trial] < MARGIN * best[current]:
                break
            current = trial
        set_w4a8_rows(*current)
        into = _time_each(kernels, (False, True), set_w4a8_prefetch_l2)
        kept = W4A8RowOrder(current[0], current[1], tuple(timings), into[True] < MARGIN * into[False],
                            (into[False], into[True]))
        _KEPT[key] = kept
        logger.info("W4A8 one-token rows: %d a pass%s, prefetch into %s (%s; L1 %.1f ms, L2 %.1f ms, over %d layers)",
                    kept.pass_rows, "" if kept.seq_bytes == NEVER else f", one by one from {kept.seq_bytes} bytes",
                    "L2" if kept.l2 else "L1",
                    ", ".join(f"{r} a pass{'' if b == NEVER else f' + one by one from {b} B'} {s * 1e3:.1f} ms"
                              for (r, b), s in timings), into[False] * 1e3, into[True] * 1e3, len(timed))
    set_w4a8_rows(kept.pass_rows, kept.seq_bytes)
    set_w4a8_prefetch_l2(kept.l2)
    return kept


def choose_few_rows(layers: Sequence[PlannedLinear], dtype: torch.dtype) -> FewRows | None:
    """Time the native kernel at FEW_TOKENS tokens over the first float layers (activations of `dtype`): one by one up
    to each of their row lengths, shortest first, while it beats the passes; set the longest that did. None where no
    float layer's few-token rows run natively here."""
    if dtype not in FLOATS or not few_rows_ordered():
        return None
    timed = timed_layers([q for q in layers if _float_rows(q)])
    if not timed:
        return None
    key = ("few", dtype, *(q.timing_key() for q in timed))
    kept = _KEPT.get(key)
    if not isinstance(kept, FewRows):
        kernels = [(q.candidates()["native"], torch.randn(FEW_TOKENS, q.in_features, dtype=dtype)) for q in timed]
        current, timings = 0, list[tuple[int, float]]()
        for k in sorted({q.in_features for q in timed}):
            best = _time_each(kernels, [current, k], set_few_rows_k)
            if not timings:
                timings.append((current, best[current]))
            timings.append((k, best[k]))
            if not best[k] < MARGIN * best[current]:
                break
            current = k
        kept = FewRows(current, tuple(timings))
        _KEPT[key] = kept
        logger.info("%d-token float rows: %s (%s; over %d layers)", FEW_TOKENS,
                    f"one by one up to {current} weights" if current else "several a pass",
                    ", ".join(f"one by one up to {k}: {t * 1e3:.1f} ms" if k else f"passes {t * 1e3:.1f} ms"
                              for k, t in timings), len(timed))
    set_few_rows_k(kept.k)
    return kept
