"""Per-shape kernel choice for the projection layers, made by timing on this machine at start-up, and re-checked
where steps later run faster than those timings allow (PlanCheck: the start-up timing was distorted by load).

What is fastest differs by CPU (oneDNN's prepacked GEMM wins at many tokens; a plain weight streamed
by csrc/gemv.c wins at one), so no choice is hard-coded: every layer type offers the kernels that
compute its math (`candidates()`), and `plan_kernels` times each on the model's own layers for each
shape class and binds the fastest to every layer (`kernels`, one per class). Timings are kept per process by
what was timed (layer types, shapes, formats, candidates, activation dtype, tokens): a second engine of the same
shapes in one process (a notebook, a test suite: ~1 s of start-up each) reuses them; a re-check times afresh.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
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


def _label(c: int) -> str:
    """Shape class c as the plan reports it (m<=1, m<=6, m<=16, m>16)."""
    largest = SHAPE_CLASSES[c][0]
    return f"m<={largest}" if largest < 1 << 62 else f"m>{FEW}"


class PlannedLinear(nn.Module):
    """A projection with several kernels for its math; forward runs the one planned for the input's M.

    `kernels` holds the methods' plain functions, not bound methods: a bound method references its
    module, and that cycle would keep every model (and the KV pool its layers view) alive until the
    cyclic garbage collector happens to run."""

    in_features: int
    out_features: int
    kernels: tuple[Callable[..., torch.Tensor], ...]
    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # LoRA slots (model/lora.py), if on
    # An expert's projection (model/moe.py): it runs only for the tokens routed to it, so a step's lower bound
    # (KernelPlan.lower_bound) leaves it out: counting every expert, a mixture's steps all looked "too fast".
    routed: bool = False

    def candidates(self) -> dict[str, Kernel]:
        """Kernel name → bound method, for every kernel that computes this layer's math here."""
        raise NotImplementedError

    def eligible(self, name: str, largest_m: int) -> bool:
        """Whether kernel `name` may run matmuls of the shape class whose largest M is largest_m."""
        return True

    def native_rows(self, largest_m: int) -> bool:
        """Whether the native kernel at up to largest_m tokens is csrc/gemv.c's rows, which the decode stack
        (model/decode_stack.py) also runs, and not another native kernel of its own."""
        return True

    def plan_kind(self) -> str:
        """Layers of one kind share a plan (the same candidates); a model may hold several kinds."""
        return type(self).__name__

    def timing_key(self) -> tuple[object, ...]:
        """What a kernel's time on this layer depends on: its type and format attributes, and its tensors'
        names, dtypes, shapes and devices (the layouts held: plain, packed, quantized)."""
        tensors = [*self.named_parameters(recurse=False), *self.named_buffers(recurse=False)]
        return (type(self).__name__, self.in_features, self.out_features,
                tuple(getattr(self, a, None) for a in ("method", "group_size", "blocked", "symmetric", "grouped")),
                tuple((n, t.dtype, tuple(t.shape), t.device.type) for n, t in tensors if t is not None),
                tuple(sorted(n for n, v in vars(self).items() if isinstance(v, torch.Tensor))))

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

# Start-up timings made in this process, by KernelPlan._timing_key (most recent last; at most _MAX_KEPT).
_KEPT_TIMINGS: dict[tuple[object, ...], dict[str, float]] = {}
_MAX_KEPT = 256
# Decisions made by timing whole steps (KernelPlan.keep_choice), by the same key plus the measure's name.
_KEPT_CHOICES: dict[tuple[object, ...], object] = {}


class KernelPlan:
    """The kernel bound to each shape class of `layers`, with the timings that chose it (seconds over the timed
    layers, per candidate; None for a class with one candidate) and what those timings predict for a step: at
    least `scale` (all layers' weights over the timed ones') x the chosen kernel's time, scaled down by tokens for
    a step smaller than the class's timed one (a matmul's time is concave in its tokens)."""

    # Below this per layer, a timing is mostly the Python call around the kernel, which the native decode stack
    # does not pay: such a timing bounds nothing.
    MIN_LAYER_S = 20e-6

    def __init__(self, layers: Sequence[PlannedLinear], timed: list[PlannedLinear], what: str, dtype: torch.dtype
                 ) -> None:
        self.layers, self.timed, self.what, self.dtype = layers, timed, what, dtype
        total = sum(q.in_features * q.out_features for q in layers if not q.routed)  # (what every token runs)
        self.scale = total / max(sum(q.in_features * q.out_features for q in timed), 1)
        self.names: dict[str, str] = {}  # shape class label → kernel (what the engine logs and reports)
        self.chosen: list[str] = [""] * len(SHAPE_CLASSES)
        self.timings: list[dict[str, float] | None] = [None] * len(SHAPE_CLASSES)
        self.rechecks: list[tuple[int, str, str]] = []  # (shape class, kernel before, kernel after)

    def lower_bound(self, m: int) -> float | None:
        """Seconds the planned kernels must take over all layers for an m-token matmul, by the plan's timings."""
        c = shape_class(m)
        t = self.timings[c]
        if t is None or t[self.chosen[c]] < self.MIN_LAYER_S * len(self.timed):
            return None  # (layers so small that the timing measured calls, not kernels: no bound)
        return self.scale * t[self.chosen[c]] * min(1.0, m / SHAPE_CLASSES[c][1])

    def _timing_key(self, c: int, names: list[str]) -> tuple[object, ...]:
        # (the one-token row order too: native timings made under one order say little of the other)
        from minivllm.model.row_order import state  # (it imports this module)

        return (self.what, self.dtype, SHAPE_CLASSES[c][1], tuple(names), tuple(q.timing_key() for q in self.timed),
                state())

    def time_class(self, c: int, names: list[str], reuse: bool = False) -> str:
        """Time `names` for shape class c on the timed layers (interleaved rounds: a burst of load skews all
        alike), record the timings, bind the fastest to every layer's class c; returns it. With `reuse`, timings
        an earlier plan of this process made of the same layers stand in for timing them again."""
        key = self._timing_key(c, names)
        kept = _KEPT_TIMINGS.get(key) if reuse else None
        if kept is not None:
            self.timings[c] = dict(kept)
            best = min(kept, key=kept.__getitem__)
            logger.info("%s, %d tokens: %s (timed earlier in this process)", self.what, SHAPE_CLASSES[c][1], best)
            self.bind(c, best)
            return best
        m = SHAPE_CLASSES[c][1]
        first = next(iter(self.layers[0].buffers()), next(iter(self.layers[0].parameters()), None))
        dev = first.device if first is not None else torch.device("cpu")
        xs = {k: torch.randn(m, k, device=dev, dtype=self.dtype) for k in {q.in_features for q in self.timed}}

        def run_timed(name: str) -> list[torch.Tensor]:
            return [q.candidates()[name](xs[q.in_features]) for q in self.timed]

        timings = {n: _timed_or_refused(functools.partial(run_timed, n), n, self.what, m) for n in names}
        for n in names:  # a second round, in the other order: the better of the two rounds counts
            if timings[n] != float("inf"):
                timings[n] = min(timings[n], best_time(functools.partial(run_timed, n), reps=1))
        best = min(timings, key=timings.__getitem__)
        logger.info("%s, %d tokens: %s", self.what, m, ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in timings.items()))
        self.timings[c] = timings
        _KEPT_TIMINGS.pop(key, None)
        _KEPT_TIMINGS[key] = dict(timings)  # (a re-check's timings replace the start-up ones it found wrong)
        while len(_KEPT_TIMINGS) > _MAX_KEPT:
            del _KEPT_TIMINGS[next(iter(_KEPT_TIMINGS))]
        self.bind(c, best)
        return best

    def _choice_key(self, c: int, measure: str) -> tuple[object, ...]:
        return (*self._timing_key(c, [measure]), len(self.layers), self.scale)  # (a whole step: every layer)

    def kept_choice(self, c: int, measure: str) -> object | None:
        """What an earlier plan of the same layers in this process decided for class c by `measure` (a timing of
        whole steps), if it did: a second engine of one model decides as the first (two engines of the same
        layers planned differently where the two whole-step timings were near and noise picked)."""
        return _KEPT_CHOICES.get(self._choice_key(c, measure))

    def keep_choice(self, c: int, measure: str, choice: object) -> None:
        """Record `choice` (what the measure decided, with its figures) for kept_choice."""
        _KEPT_CHOICES[self._choice_key(c, measure)] = choice
        while len(_KEPT_CHOICES) > _MAX_KEPT:
            del _KEPT_CHOICES[next(iter(_KEPT_CHOICES))]

    def bind(self, c: int, name: str) -> None:
        """Kernel `name` for every layer's shape class c."""
        self.chosen[c] = self.names[_label(c)] = name
        for q in self.layers:
            f = q.candidates()[name].__func__  # type: ignore[attr-defined]
            ks = list(getattr(q, "kernels", ()) or (f,) * len(SHAPE_CLASSES))
            ks[c] = f
            q.kernels = tuple(ks)

    def pin(self, c: int, name: str) -> None:
        """Shape class c runs `name`, chosen by another measurement (whole steps): kernel timings no longer bound
        its steps nor re-check it (that measurement re-checks its own choice: model/stack_plan.py)."""
        self.chosen[c] = self.names[_label(c)] = name
        self.timings[c] = None

    RECHECK_SPAN = 3.0

    def drop(self, layer: PlannedLinear) -> None:
        """A layer replaced after planning (a GGUF head converted at load) leaves the plan: kept, its weights stayed
        alive and its start-up timing stayed in the bound every step is judged by (a float head of 1 GB, 19 ms a
        step, made quiet steps look too fast and re-checks fire). If it was timed, the timings describe the plan no
        more: no bound, no re-check."""
        self.layers = [q for q in self.layers if q is not layer]
        if any(q is layer for q in self.timed):
            self.timed = [q for q in self.timed if q is not layer]
            self.timings = [None] * len(SHAPE_CLASSES)

    def recheck(self, c: int) -> None:
        """Time shape class c's candidates again (the step costs its timings predicted turned out wrong)."""
        timings = self.timings[c]
        if timings is None:
            return
        before = self.chosen[c]
        # Only kernels whose weight layout is still held: the unplanned copy was released after start-up (a
        # packed layout no class chose is gone, and timing it raised KeyError inside a serving step). And only
        # those within RECHECK_SPAN of the choice's start-up timing: the re-check runs inside a step, and timing
        # a portable path that lost by far (one that dequantizes whole layers) cost a benchmark's whole b=1 window
        # (135M: ~1.5 s, 19 against 126 tok/s); the load that inflated the choice's timing slowed it alike.
        kept = self.timed[0].candidates() if self.timed else {}
        names = [n for n in timings if n in kept and timings[n] <= self.RECHECK_SPAN * timings[before]]
        if len(names) < 2:
            self.timings[c] = None  # nothing left to choose between
            return
        after = self.time_class(c, names)
        self.rechecks.append((c, before, after))
        logger.info("%s: kernel plan for %d-token matmuls re-checked (steps ran faster than its start-up timings "
                    "allow): %s -> %s", self.what, SHAPE_CLASSES[c][1], before, after)


class PlanCheck:
    """Re-checks the kernel plans where steps run faster than their timings say they can: the plan was timed under
    load (another process busy at start-up) and may have chosen by the distortion. A step whose whole forward took
    less than FASTER x the plans' lower bound for its tokens counts against its shape class; SUSPECT of the last
    WINDOW steps of a class re-time it, at most once per COOLDOWN steps of that class."""

    # Quiet, the embedded model's decode forwards run at 0.81-1.0x its plan's timed projections (the native stack
    # saves the calls); under a busy core the timings doubled: half is the margin between the two.
    FASTER, WINDOW, SUSPECT, COOLDOWN = 0.5, 8, 3, 1000

    def __init__(self, plans: list[KernelPlan]) -> None:
        self.plans = [p for p in plans if p.layers]
        self.recent: list[deque[bool]] = [deque(maxlen=self.WINDOW) for _ in SHAPE_CLASSES]
        self.since = [self.COOLDOWN] * len(SHAPE_CLASSES)  # steps of each class since its last re-check

    def observe(self, m: int, seconds: float) -> list[int]:
        """One forward over m tokens; returns the shape classes re-checked now."""
        c = shape_class(m)
        bounds = [p.lower_bound(m) for p in self.plans]
        self.since[c] += 1
        if not any(b is not None for b in bounds):
            return []
        recent = self.recent[c]
        recent.append(seconds < self.FASTER * sum(b for b in bounds if b is not None))
        if sum(recent) < self.SUSPECT or self.since[c] < self.COOLDOWN:
            return []
        for p in self.plans:
            p.recheck(c)
        recent.clear()
        self.since[c] = 0
        return [c]


@torch.no_grad()
def plan_kinds(layers: Sequence[PlannedLinear], kernel: str = "auto", what: str = "linear",
               dtype: torch.dtype = torch.float32) -> list[KernelPlan]:
    """A plan per kind of layer (plan_kernels each; a GGUF file's int4 layers beside its int8 blocks), at least one."""
    kinds: dict[str, list[PlannedLinear]] = {}
    for q in layers:
        kinds.setdefault(q.plan_kind(), []).append(q)
    if len(kinds) <= 1:
        return [plan_kernels(layers, kernel, what, dtype)]
    return [plan_kernels(group, kernel, f"{what} ({kind})", dtype) for kind, group in kinds.items()]


def first_layers(layers: Sequence[PlannedLinear]) -> list[PlannedLinear]:
    """The layers a start-up timing runs over: the first ones up to TIMED_WEIGHTS weights (all of a small model)."""
    timed, total = [], 0
    for q in layers:
        timed.append(q)
        total += q.in_features * q.out_features
        if total >= TIMED_WEIGHTS:
            break
    return timed


def plan_kernels(layers: Sequence[PlannedLinear], kernel: str = "auto", what: str = "linear",
                 dtype: torch.dtype = torch.float32) -> KernelPlan:
    """Time every candidate over the model's own layers (the first TIMED_WEIGHTS weights of them) for each
    shape class, on activations of `dtype`, and bind the fastest to all `layers`, or force one by name."""
    if not layers:
        return KernelPlan(layers, [], what, dtype)
    names = list(layers[0].candidates())
    if kernel != "auto":
        if kernel not in names:
            raise ValueError(f"{what}: {kernel!r} has no kernel here; choose auto or one of {', '.join(names)}")
        names = [kernel]
    elif "torch" in names and ("onednn" in names or "onednn_plain" in names):
        names.remove("torch")  # aten's path ran 1.2-4x slower than oneDNN at every M measured; never timed
    timed = first_layers(layers)
    plan = KernelPlan(layers, timed, what, dtype)
    every = list(layers[0].candidates())
    for c, (largest, _) in enumerate(SHAPE_CLASSES):
        fits = [n for n in names if layers[0].eligible(n, largest)]
        # (a kernel forced by name where it may not run: the native kernel there, else the portable one)
        fits = fits or [next(n for n in ("native", "reference") if n in every and layers[0].eligible(n, largest))]
        if len(fits) > 1:
            plan.time_class(c, fits, reuse=True)
        else:
            plan.bind(c, fits[0])
    return plan
