"""The decode stack's shape classes chosen by timing whole steps (model/stack_plan.py): where the projections'
start-up timing put another kernel in one (the one-token class here, the many-row class last), a decode step of its
rows is timed with the module path and with the native stack, and the faster kept, with the same greedy output
either way."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from conftest import PROMPTS

from minivllm import LLM, SamplingParams
from minivllm.model import kernel_plan, stack_plan
from minivllm.model.decode_stack import DecodeStack
from minivllm.model.kernel_plan import KernelPlan
from minivllm.model.stack_plan import StackCheck, StackChoice


@pytest.fixture
def off_native(monkeypatch):
    """The one-token class planned off native by the kernel timings (a tie broken the other way), as a fresh process
    (earlier tests built this model); yields the plan's own time_class (the fixture replaces it)."""
    monkeypatch.setattr(kernel_plan, "_KEPT_TIMINGS", {})
    monkeypatch.setattr(kernel_plan, "_KEPT_CHOICES", {})
    monkeypatch.setattr(stack_plan, "STACK_CLASSES", ((0, 1),))
    timed = KernelPlan.time_class

    def off_native(self: KernelPlan, c: int, names: list[str], reuse: bool = False) -> str:
        if c in (1, 2):  # (native there, whatever the timing: the stack exists, for steps of 2-16 rows)
            self.timings[c] = None
            self.bind(c, "native")
            return "native"
        if c != 0:
            return timed(self, c, names, reuse)
        other = "onednn_plain" if "onednn_plain" in names else next(n for n in names if n != "native")
        self.timings[c] = {n: 1e-3 for n in names}  # (a tie the kernels' timing broke the other way)
        self.bind(c, other)
        return other

    monkeypatch.setattr(KernelPlan, "time_class", off_native)
    yield timed


def start_up_steps(monkeypatch, module_s: float, stack_s: float) -> Iterator[float]:
    """The whole-step timings at start-up: the module path's step, then the stack's (an iterator left empty)."""
    steps = iter((module_s, stack_s))

    def step_time(fn, reps=3):
        fn()  # (the step runs: the stack's buffers are bound as they would be)
        return next(steps)

    monkeypatch.setattr(stack_plan, "best_time", step_time)
    return steps


@pytest.mark.parametrize("stack_faster", [True, False])
def test_a_one_token_class_planned_off_native_is_decided_by_whole_steps(monkeypatch, off_native, stack_faster):
    timed = off_native
    steps = start_up_steps(monkeypatch, *((2e-3, 1e-3) if stack_faster else (1e-3, 2e-3)))
    monkeypatch.setattr(StackCheck, "SUSPECT", StackCheck.WINDOW + 1)  # (the serving steps' re-check: tests below)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(num_kv_blocks=64)
    runner = llm.llm_engine.runner
    plan, stack = runner.linear_plan, runner.decode_stack
    assert stack is not None and next(steps, None) is None  # both ways timed
    if stack_faster:  # native throughout, pinned: kernel timings (blind to the stack) do not re-check it
        assert plan.names["m<=1"] == "native" and plan.timings[0] is None and stack.native_classes[0]
        assert all(q.kernels[0].__name__ == "forward_native" for q in plan.layers)
    else:  # the plan as timed, the stack off for one token
        assert plan.names["m<=1"] != "native" and plan.timings[0] is not None and not stack.native_classes[0]
        assert all(q.kernels[0].__name__ == f"forward_{plan.names['m<=1']}" for q in plan.layers)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    # A second engine of the same layers decides as the first did, without timing steps again (none are left).
    again = LLM(num_kv_blocks=64).llm_engine.runner
    assert again.linear_plan.names["m<=1"] == plan.names["m<=1"]
    assert again.decode_stack is not None and again.decode_stack.native_classes[0] == stack_faster
    monkeypatch.setattr(KernelPlan, "time_class", timed)
    ref = [o.outputs[0].token_ids for o in LLM(num_kv_blocks=64, linear_backend="torch").generate(
        PROMPTS, sp, use_tqdm=False)]
    assert got == ref


# What a slow way costs each step in the tests below: several times the embedded model's one-token step.
SLOW_S = 0.02


@pytest.mark.parametrize("slow", ["stack", "modules"])
def test_a_class_the_serving_steps_find_decided_wrong_is_re_checked_on_them(monkeypatch, off_native, slow):
    """The start-up timings said one way (stack or modules) was faster; the serving steps run the other way's
    start-up time and more, so the class's next steps run each way in turn (TRIAL each), the faster is kept, the
    plan follows (pinned on the stack, its own kernel and timings back off it), later engines of these layers start
    from it, the cool-down holds, and the greedy output is what it would have been."""
    start_up_steps(monkeypatch, *((2e-3, 1e-3) if slow == "stack" else (1e-3, 2e-3)))  # (the slow way chosen)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(num_kv_blocks=64)
    runner = llm.llm_engine.runner
    plan, stack, check = runner.linear_plan, runner.decode_stack, runner.stack_check
    assert stack is not None and check is not None and stack.native_classes[0] == (slow == "stack")
    if slow == "stack":
        module_kernel = check.classes[0].planned[0][0]  # (the plan's own choice, kept while the stack runs)
        call = DecodeStack.__call__

        def slow_stack(self, h, positions):
            time.sleep(SLOW_S)
            return call(self, h, positions)

        monkeypatch.setattr(DecodeStack, "__call__", slow_stack)
    else:
        module_kernel = plan.chosen[0]
        first = runner.model.layers[0]
        forward = first.forward

        def slow_layer(*args, **kwargs):  # (the stack runs no layer's forward)
            time.sleep(SLOW_S)
            return forward(*args, **kwargs)

        monkeypatch.setattr(first, "forward", slow_layer)
    got = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert [c for c, _, _ in check.rechecks] == [0]
    before, after = check.rechecks[0][1:]
    assert before.use_stack == (slow == "stack") and after.use_stack == (slow == "modules")
    assert (after.stack_s > after.module_s + SLOW_S / 2) == (slow == "stack")  # (serving steps' medians)
    assert stack.native_classes[0] == after.use_stack and not check.trials
    if after.use_stack:
        assert plan.names["m<=1"] == "native" and plan.timings[0] is None
    else:
        assert plan.chosen[0] == module_kernel and plan.timings[0] is not None
        assert all(q.kernels[0].__name__ == f"forward_{module_kernel}" for q in plan.layers)
    llm.generate(PROMPTS[:1], sp, use_tqdm=False)  # within the cool-down: no second trial
    assert len(check.rechecks) == 1
    again = LLM(num_kv_blocks=64).llm_engine.runner
    assert again.decode_stack is not None and again.decode_stack.native_classes[0] == after.use_stack
    monkeypatch.setattr(KernelPlan, "time_class", off_native)
    ref = LLM(num_kv_blocks=64, linear_backend="torch").generate(PROMPTS[:1], sp, use_tqdm=False)
    assert got == ref[0].outputs[0].token_ids


def test_a_class_whose_serving_steps_bear_out_its_choice_is_not_re_checked(monkeypatch, off_native):
    """Steps within the chosen way's expected time and the other's are left alone; steps far faster than the
    chosen way's start-up timing (timed under load) start a trial, whose medians replace the start-up times."""
    start_up_steps(monkeypatch, 2e-3, 1e-3)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(num_kv_blocks=64)
    check = llm.llm_engine.runner.stack_check
    assert check is not None
    k = check.classes[0]
    k.choice = StackChoice(True, 100.0, 1e-9)  # (every real step within: above 0.5 x 1 ns, below 100 s)
    llm.generate(PROMPTS[:1], sp, use_tqdm=False)
    assert check.rechecks == [] and not check.trials and k.on_stack
    k.choice = StackChoice(True, 200.0, 100.0)  # the stack's start-up step as if a busy core made it 100 s
    llm.generate(PROMPTS[:1], sp, use_tqdm=False)
    assert [c for c, _, _ in check.rechecks] == [0] and not check.trials
    after = check.rechecks[0][2]
    assert 0 < after.module_s < 1 and 0 < after.stack_s < 1 and k.on_stack == after.use_stack


def test_a_many_row_class_planned_off_native_is_decided_by_whole_steps(monkeypatch, stack_calls):
    """The batched-decode class (past 16 rows) planned off native by its projections' timings alone (a tie broken
    the other way) is timed as whole 64-row steps too, and runs through the stack where they ran faster: a batch of
    more than 16 decodes then takes one call a step, with the greedy output of the torch path."""
    monkeypatch.setattr(kernel_plan, "_KEPT_TIMINGS", {})
    monkeypatch.setattr(kernel_plan, "_KEPT_CHOICES", {})
    timed = KernelPlan.time_class

    def many_off_native(self: KernelPlan, c: int, names: list[str], reuse: bool = False) -> str:
        if c != 3:  # (native below 17 rows, whatever the timing: no whole steps timed for those classes)
            self.timings[c] = None
            self.bind(c, "native")
            return "native"
        other = next(n for n in names if n != "native")
        self.timings[c] = {n: 1e-3 for n in names}
        self.bind(c, other)
        return other

    monkeypatch.setattr(KernelPlan, "time_class", many_off_native)
    steps = start_up_steps(monkeypatch, 2e-3, 1e-3)  # (the stack's 64-row step the faster)
    llm = LLM(num_kv_blocks=256)
    runner = llm.llm_engine.runner
    plan, stack = runner.linear_plan, runner.decode_stack
    assert stack is not None and next(steps, None) is None  # both ways timed
    assert plan.chosen[3] == "native" and plan.timings[3] is None and stack.native_classes[3]
    stack_calls.clear()  # (the start-up's own 64-row step)
    prompts = (PROMPTS * 6)[:20]  # (20 decodes a step: the many-row class)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert max(stack_calls) == 20
    monkeypatch.setattr(KernelPlan, "time_class", timed)
    ref = [o.outputs[0].token_ids for o in LLM(num_kv_blocks=256, linear_backend="torch").generate(
        prompts, sp, use_tqdm=False)]
    assert got == ref
