"""The decode stack's one-token class chosen by timing whole steps (model/stack_plan.py): where the projections'
start-up timing put another kernel there, a 1-row decode step is timed with the module path and with the native
stack, and the faster kept, with the same greedy output either way."""

from __future__ import annotations

import pytest
from conftest import PROMPTS

from minivllm import LLM, SamplingParams
from minivllm.model import kernel_plan, stack_plan
from minivllm.model.kernel_plan import KernelPlan


@pytest.mark.parametrize("stack_faster", [True, False])
def test_a_one_token_class_planned_off_native_is_decided_by_whole_steps(monkeypatch, stack_faster):
    monkeypatch.setattr(kernel_plan, "_KEPT_TIMINGS", {})  # (as a fresh process: earlier tests built this model)
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
    steps = iter([2e-3, 1e-3] if stack_faster else [1e-3, 2e-3])  # the module path's step, then the stack's

    def step_time(fn, reps=3):
        fn()  # (the step runs: the stack's buffers are bound as they would be)
        return next(steps)

    monkeypatch.setattr(stack_plan, "best_time", step_time)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(num_kv_blocks=64)
    runner = llm.llm_engine.runner
    plan, stack = runner.linear_plan, runner.decode_stack
    assert stack is not None and next(steps, None) is None  # both ways timed
    if stack_faster:  # native throughout, pinned: kernel timings (blind to the stack) never re-check it
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
