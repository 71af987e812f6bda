"""The decode stack's shape classes, chosen by timing whole steps, and re-checked on the serving steps.

The start-up plan (model/kernel_plan.py) times each projection's kernels alone, so it cannot see that native kernels
in every layer let the decode stack (model/decode_stack.py) run a whole step in one call, without a Python call per
layer, or per expert of a mixture. Where a class was planned otherwise (the one-token class: a batch-1 decode; the
handful, 2-6 rows: a batch-1 speculative verification; 7-16 rows; and many rows: a batched decode), a decode step of
its rows (1, 4, 10, 64) is timed both ways and the faster kept: a mixture of experts' one-token projections timed
13.1 ms on oneDNN against 13.8 native on a Zen 4 EPYC, so its decode ran every layer and expert through Python, at
0.5-0.76x llama.cpp f32 (the stack: 1.5-1.9x that); GPT-2's 64-token projections timed 47.6 ms on oneDNN against 48.9
native on another, so three of four seed-workload engines ran 50-sequence steps through the modules in 83-94 ms
where the stack ran them in 78.

Kernel timings cannot re-check such a choice, and a choice timed at start-up can be wrong for the engine's life (a
busy core during one of the two timings, the machine's speed shifting later). So StackCheck watches each decided
class's serving steps: where they run faster than their way's start-up timing allows (that timing was inflated) or
clearly slower than the other way's (the choice's premise no longer holds), the class's next steps run each way in turn,
TRIAL of each, and the faster by their medians is kept, at most once per COOLDOWN steps of the class.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minivllm.model.input_batch import SequenceInput
from minivllm.model.kernel_plan import KernelPlan, PlannedLinear, best_time, shape_class

if TYPE_CHECKING:
    from minivllm.model.attention import AttentionMetadata
    from minivllm.model.decode_stack import DecodeStack
    from minivllm.model.runner import ModelRunner

logger = logging.getLogger(__name__)

# (shape class, rows of the decode step timed for it)
STACK_CLASSES = ((0, 1), (1, 4), (2, 10), (3, 64))


@dataclass(slots=True)
class StackChoice:
    """How a shape class's decode steps run, through the native stack or the modules, with each way's seconds for a
    step of the class's timed rows (at start-up: dummy rows; after a re-check: the medians of serving steps)."""

    use_stack: bool
    module_s: float
    stack_s: float

    def expected(self, on_stack: bool) -> float:
        return self.stack_s if on_stack else self.module_s


class StackClass:
    """One shape class decided by whole steps in one runner, switched between the two ways through its plans."""

    def __init__(self, c: int, rows: int, model: Any, stack: DecodeStack, plans: list[KernelPlan]) -> None:
        self.c, self.rows, self.model, self.stack, self.plans = c, rows, model, stack, plans
        self.choice = StackChoice(False, 0.0, 0.0)
        # Each plan's own choice for the class (kernel, its timings), kept while the stack runs it.
        self.planned: list[tuple[str, dict[str, float] | None]] = []

    @property
    def on_stack(self) -> bool:
        return self.stack.native_classes[self.c]

    def use(self, stack: bool) -> bool:
        """Run the class through the stack (every projection native, the plans pinned) or the modules (each plan's
        own choice back, with its timings: kernel re-checks resume); returns whether the stack now runs it."""
        c = self.c
        if stack and not self.on_stack:
            self.planned = [(p.chosen[c], p.timings[c]) for p in self.plans]
            for p in self.plans:
                p.bind(c, "native")
                p.pin(c, "native")
        elif not stack and self.on_stack and self.planned:
            for p, (name, timings) in zip(self.plans, self.planned, strict=True):
                p.bind(c, name)
                p.timings[c] = timings
            self.planned = []
        self.stack.refresh(self.model)
        return self.on_stack


class StackCheck:
    """Re-checks the classes decided by whole steps on the serving steps (see the module's docstring). A step counts
    against its class's choice when it ran below FASTER x its way's expected time or above SLOWER x the other way's
    (this machine's speed drifts by a third over minutes: a slow phase alone should not start a trial); SUSPECT of
    the class's last WINDOW steps start a trial."""

    FASTER, SLOWER, WINDOW, SUSPECT, COOLDOWN, TRIAL = 0.5, 1.3, 8, 3, 1000, 8

    def __init__(self, classes: list[StackClass]) -> None:
        self.classes = {k.c: k for k in classes}
        self.recent = {k.c: deque[bool](maxlen=self.WINDOW) for k in classes}
        self.since = {k.c: self.COOLDOWN for k in classes}  # steps of each class since its last trial
        self.trials: dict[int, dict[bool, list[float]]] = {}  # class → its trial's step seconds, by way (stack?)
        self.rechecks: list[tuple[int, StackChoice, StackChoice]] = []  # (class, choice before, after)

    def observe(self, md: AttentionMetadata, m: int, seconds: float) -> None:
        """One forward over m tokens that took `seconds` (only all-decode steps without LoRA: what the stack runs)."""
        if md.num_decodes != m or md.prefills or md.lora is not None:
            return
        k = self.classes.get(shape_class(m))
        if k is None:
            return
        c, on_stack = k.c, k.on_stack
        trial = self.trials.get(c)
        if trial is not None:
            trial[on_stack].append(seconds)
            if min(len(trial[True]), len(trial[False])) >= self.TRIAL:
                self._decide(k, trial)
            elif k.use(not on_stack) == on_stack:
                del self.trials[c]  # (the stack refused the class: nothing to compare)
                k.use(k.choice.use_stack)
            return
        self.since[c] += 1
        f = m / k.rows
        expected = k.choice.expected(on_stack)
        recent = self.recent[c]
        recent.append(seconds < self.FASTER * expected * min(1.0, f)
                      or seconds > self.SLOWER * k.choice.expected(not on_stack) * max(1.0, f))
        if sum(recent) >= self.SUSPECT and self.since[c] >= self.COOLDOWN:
            recent.clear()
            self.since[c] = 0
            self.trials[c] = {True: [], False: []}
            k.use(not on_stack)

    def _decide(self, k: StackClass, trial: dict[bool, list[float]]) -> None:
        before = k.choice
        module_s, stack_s = statistics.median(trial[False]), statistics.median(trial[True])
        k.choice = StackChoice(stack_s < module_s, module_s, stack_s)
        del self.trials[k.c]
        k.use(k.choice.use_stack)
        k.plans[0].keep_choice(k.c, "decode stack", k.choice)  # (a later engine of these layers starts from it)
        self.rechecks.append((k.c, before, k.choice))
        logger.info("decode stack for %d-row steps re-checked on serving steps (expected %.2f ms, modules %.2f ms, "
                    "stack %.2f ms at start-up): modules %.2f ms, stack %.2f ms -> %s", k.rows,
                    before.expected(before.use_stack) * 1e3, before.module_s * 1e3, before.stack_s * 1e3,
                    module_s * 1e3, stack_s * 1e3, "stack" if k.choice.use_stack else "modules")


def plan_classes_with_stack(runner: ModelRunner) -> StackCheck | None:
    """Each of STACK_CLASSES not planned native throughout: timed as a whole step, with and without the stack; the
    check that re-times those so decided on serving steps (None where none was)."""
    classes = []
    for c, rows in STACK_CLASSES:
        stack = runner.decode_stack
        if stack is not None and not stack.native_classes[c]:
            k = _plan_class(runner, stack, c, rows)
            if k is not None:
                classes.append(k)
    return StackCheck(classes) if classes else None


def _plan_class(runner: ModelRunner, stack: DecodeStack, c: int, rows: int) -> StackClass | None:
    """Class c's kernels: as planned, or native in every projection (the plans pinned) where a `rows`-row decode step
    ran faster so (dummy rows: K/V into empty block 0). An earlier engine of the same layers in this process decided
    for this one."""
    projs = [m for m in runner.model.modules() if isinstance(m, PlannedLinear)]
    if not all("native" in m.candidates() for m in projs):
        return None
    bs = runner.block_size
    inputs = [SequenceInput([0], i, [0] * (i // bs + 1), True, group_tables=(
        [0] * (i // bs + 1),) * (runner.num_kv_groups - 1)) for i in range(rows)]
    # Every plan holding layers is pinned alike (a quantized model's layers are in its quant plans, its linear plan
    # may be empty); the first keys the decision kept for later engines.
    plans = [p for p in (runner.linear_plan, *runner.quant_plans) if p.layers]
    if not plans:
        return None
    k = StackClass(c, rows, runner.model, stack, plans)
    kept = plans[0].kept_choice(c, "decode stack")
    if isinstance(kept, StackChoice):
        k.choice = kept
    else:
        module_s = best_time(lambda: runner.execute(inputs))
        if not k.use(True):
            return None
        stack_s = best_time(lambda: runner.execute(inputs))
        logger.info("%d-row decode step: %s %.2f ms, native stack %.2f ms", rows, k.planned[0][0] or "as planned",
                    module_s * 1e3, stack_s * 1e3)
        k.choice = StackChoice(stack_s < module_s, module_s, stack_s)
        plans[0].keep_choice(c, "decode stack", k.choice)
    k.use(k.choice.use_stack)
    return k
