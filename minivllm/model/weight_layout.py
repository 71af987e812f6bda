"""The layouts a float32 model's projection weights are held in: a second copy (oneDNN's packed layout, the GEMM's
panels) only where memory allows, and for a model too large for two, which one layout serves every token count.

A second copy costs at most a tenth of the machine's memory (`second_layout_affordable`). Past that (a 1B model in
float32 on a 24 GiB machine) one layout serves every shape: either the plain [N, K] weight (csrc/gemv.c's rows at a
few tokens, oneDNN's GEMM on it at many) or csrc/gemm_f32.c's panels alone (its GEMM at every token count, one token
included: a panel's k-th row is two vectors, so one token streams each panel front to back with no horizontal sums).
Until 2026-12-07 such a model kept the plain layout, and its 64-token class ran oneDNN on it (a 1B model's
projections 46.6 ms in the plan against the rows' 77.5) outside the decode stack. On a 2-vCPU Zen 4 (family 25 model
17), 1B-shaped projections from memory (six layers of qkv / o / gate_up / down, 1.46 GB a pass, 2 threads), the panels
streamed one token at 32.3-34.3 GB/s against the rows' 28.0-32.2 (each row order, with and without prefetch), ran 4
and 10 tokens in 0.81x and 0.60x the rows' time, 64 tokens at 203 GFLOP/s against oneDNN's plain layout's 182, and
tied it at 256 and 512 (205 each). That is one machine, so `choose_layout` times both layouts on the model's first
layers for every shape class and keeps the panels only where they are no slower at one token (decode's class, within
PANELS_MARGIN) and faster over the classes (the geometric mean of the per-class ratios).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch

from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import SHAPE_CLASSES, KernelPlan, PlannedLinear, first_layers
from minivllm.model.layers import Linear

logger = logging.getLogger(__name__)

# At one token the panels may take at most this much of the plain layout's best time (decode at one sequence must not
# lose), over ONE_TOKEN_ROUNDS timings (a short one: on the Zen 4 above, single timings of the 1B model's first layers
# put the panels at 0.97-1.13x the rows in six start-ups, while its decode at one sequence ran the same either way:
# 6.4-9.6 tok/s with panels, 6.1-8.6 plain, in two pairs of processes; at 8 and 64 sequences 1.5x and 1.10x).
PANELS_MARGIN = 1.05
ONE_TOKEN_ROUNDS = 3


def second_layout_affordable(linears: Sequence[Linear]) -> bool:
    """Whether oneDNN's packed weights (or the GEMM's panels) may sit next to the plain ones: only while that second
    copy costs at most a tenth of the machine's memory. Past that the model keeps one layout (choose_layout)."""
    extra = sum(m.weight.numel() * m.weight.element_size() for m in linears if m.weight is not None)
    return extra <= psutil.virtual_memory().total // 10


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """What choose_layout decided: panels alone or the plain weight, by the panels' time over the plain layout's
    fastest kernel in each shape class (SHAPE_CLASSES order) on the timed layers."""

    panels: bool
    ratios: tuple[float, ...]

    def describe(self) -> str:
        classes = ", ".join(f"{SHAPE_CLASSES[c][1]} tokens {r:.2f}x" for c, r in enumerate(self.ratios))
        return f"{'panels alone' if self.panels else 'plain'} (the panels' time over the plain layout's: {classes})"


def prefer_panels(ratios: Sequence[float]) -> bool:
    """Given the panels' time over the plain layout's best per shape class (one token first): no slower at one token
    (within PANELS_MARGIN) and faster over the classes (the geometric mean of the ratios at most 1)."""
    return ratios[0] <= PANELS_MARGIN and math.exp(sum(math.log(r) for r in ratios) / len(ratios)) <= 1.0


def _shared(linears: Sequence[Linear], model: torch.nn.Module) -> int:
    """Bytes of the projections' weights that another module's parameter also holds (a head tied to the
    embedding): held as panels, those stay in memory twice."""
    own = {id(m.weight) for m in linears}
    others = {p.data_ptr() for p in model.parameters() if id(p) not in own}
    return sum(m.weight.numel() * 4 for m in linears if m.weight is not None and m.weight.data_ptr() in others)


def eligible(linears: Sequence[Linear], model: torch.nn.Module, backend: str) -> bool:
    """Whether a model allowed one layout may hold its projections as panels: every projection a dense float32
    Linear on the CPU (no routed experts: csrc/moe_decode.c reads their plain rows), the native kernels built, the
    backend auto or native, and a tied weight's second copy within a tenth of memory."""
    return (backend in ("auto", "native") and bool(linears) and cpu_kernels.available()
            and all(m.weight is not None and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
                    and not m.routed for m in linears)
            and _shared(linears, model) <= psutil.virtual_memory().total // 10)


def choose_layout(linears: Sequence[Linear], backend: str, dtype: torch.dtype) -> LayoutChoice:
    """Time the plain layout's kernels and the GEMM on panels over the first layers for every shape class (panels
    made for those layers alone), then hold every projection as panels alone where they win (module docstring),
    one projection at a time (no moment holds two copies of more than one weight beyond the timed layers)."""
    trial = list(linears[: len(first_layers(linears))])
    timed: list[PlannedLinear] = list(trial)
    for m in trial:
        m.trial_panels(True)
    ratios = []
    try:
        plan = KernelPlan(trial, timed, "weight layout", dtype)
        names = list(trial[0].candidates())
        if backend == "native":
            names = ["native", "panels"]
        elif "torch" in names and "onednn_plain" in names:  # (aten's path never timed beside oneDNN: kernel_plan)
            names.remove("torch")
        for c in range(len(SHAPE_CLASSES)):
            best: dict[str, float] = {}
            for _ in range(ONE_TOKEN_ROUNDS if c == 0 else 1):  # (each kernel's fastest round counts)
                plan.time_class(c, names)
                t = plan.timings[c]
                assert t is not None
                best = {n: min(v, best.get(n, v)) for n, v in t.items()}
            ratios.append(best["panels"] / min(v for n, v in best.items() if n != "panels"))
    except BaseException:
        for m in trial:
            m.trial_panels(False)
        raise
    choice = LayoutChoice(prefer_panels(ratios), tuple(ratios))
    for m in linears:
        if choice.panels:
            m.keep_panels_only()
        else:
            m.trial_panels(False)
    logger.info("float32 weights, one layout (a second copy exceeds a tenth of memory): %s", choice.describe())
    return choice
