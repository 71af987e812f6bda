"""The decode stack's shape classes, chosen by timing whole steps.

The start-up plan (model/kernel_plan.py) times each projection's kernels alone, so it cannot see that native kernels
in every layer let the decode stack (model/decode_stack.py) run a whole step in one call, without a Python call per
layer, or per expert of a mixture. Where the one-token class (a batch-1 decode) or the handful class (2-6 rows: a
batch-1 speculative verification) was planned otherwise, a 1- (4-) row decode step is timed both ways and the
faster kept: a mixture of experts' one-token projections timed 13.1 ms on oneDNN against 13.8 native on a Zen 4
EPYC, so its decode ran every layer and expert through Python, at 0.5-0.76x llama.cpp f32 (the stack: 1.5-1.9x that).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from minivllm.model.input_batch import SequenceInput
from minivllm.model.kernel_plan import PlannedLinear, best_time

if TYPE_CHECKING:
    from minivllm.model.decode_stack import DecodeStack
    from minivllm.model.runner import ModelRunner

logger = logging.getLogger(__name__)

# (shape class, rows of the decode step timed for it)
STACK_CLASSES = ((0, 1), (1, 4))


def plan_classes_with_stack(runner: ModelRunner) -> None:
    """Each of STACK_CLASSES not planned native throughout: timed as a whole step, with and without the stack."""
    for c, rows in STACK_CLASSES:
        stack = runner.decode_stack
        if stack is not None and not stack.native_classes[c]:
            _plan_class(runner, stack, c, rows)


def _plan_class(runner: ModelRunner, stack: DecodeStack, c: int, rows: int) -> None:
    """Class c's kernels: as planned, or native in every projection (then pinned: never re-checked by kernel
    timings, which cannot see the stack) where a `rows`-row decode step ran faster so (dummy rows: K/V into empty
    block 0). An earlier engine of the same layers in this process decided for this one."""
    projs = [m for m in runner.model.modules() if isinstance(m, PlannedLinear)]
    if not all("native" in m.candidates() for m in projs):
        return
    bs = runner.block_size
    inputs = [SequenceInput([0], i, [0] * (i // bs + 1), True, group_tables=(
        [0] * (i // bs + 1),) * (runner.num_kv_groups - 1)) for i in range(rows)]
    # Every plan holding layers is pinned alike (a quantized model's layers are in its quant plans, its linear plan
    # may be empty); the first keys the decision kept for later engines.
    plans = [p for p in (runner.linear_plan, *runner.quant_plans) if p.layers]
    if not plans:
        return
    planned, plan = [m.kernels for m in projs], plans[0]
    use_stack = plan.kept_choice(c, "decode stack")
    module_time = best_time(lambda: runner.execute(inputs)) if use_stack is None else 0.0
    for m in projs:
        ks = list(m.kernels)
        ks[c] = m.candidates()["native"].__func__  # type: ignore[attr-defined]
        m.kernels = tuple(ks)
    stack.native_classes = tuple(n or i == c for i, n in enumerate(stack.native_classes))
    if use_stack is None:
        stack_time = best_time(lambda: runner.execute(inputs))
        logger.info("%d-row decode step: %s %.2f ms, native stack %.2f ms", rows, plan.chosen[c] or "as planned",
                    module_time * 1e3, stack_time * 1e3)
        use_stack = plan.keep_choice(c, "decode stack", stack_time < module_time)
    if use_stack:
        for p in plans:
            p.pin(c, "native")
        return
    for m, kernels in zip(projs, planned, strict=True):
        m.kernels = kernels
    stack.native_classes = tuple(n and i != c for i, n in enumerate(stack.native_classes))
