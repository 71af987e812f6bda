"""The step's hook points (engine/hooks.py): a hook is called only at the points its class overrides, in
registration order; forward wrappers nest with the first registered outermost; token_accepted chains statuses."""

from __future__ import annotations

import torch

from minivllm.engine.hooks import HookSet, StepHook
from minivllm.engine.sequence import SequenceStatus


class Recorder(StepHook):
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def before_schedule(self, scheduler) -> None:
        self.calls.append(f"{self.name}.before_schedule")

    def forward(self, inner):
        def run(scheduled, inputs):
            self.calls.append(f"{self.name}.forward in")
            out = inner(scheduled, inputs)
            self.calls.append(f"{self.name}.forward out")
            return out + 1

        return run


class Stopper(StepHook):
    def token_accepted(self, seq, token, status):
        return SequenceStatus.FINISHED_STOPPED if token == 7 else status


def test_only_overridden_points_are_called_in_order():
    calls: list[str] = []
    hooks = HookSet([Recorder("a", calls), Stopper(), Recorder("b", calls)])
    assert [type(h).__name__ for h in hooks.at["before_schedule"]] == ["Recorder", "Recorder"]
    assert [type(h).__name__ for h in hooks.at["token_accepted"]] == ["Stopper"]
    assert hooks.at["end_step"] == [] and hooks.at["process_logits"] == []
    hooks.before_schedule(None)
    assert calls == ["a.before_schedule", "b.before_schedule"]
    calls.clear()
    run = hooks.wrap_forward(lambda scheduled, inputs: torch.zeros(2))
    assert run([], []).tolist() == [2.0, 2.0]
    assert calls == ["a.forward in", "b.forward in", "b.forward out", "a.forward out"]
    assert hooks.token_accepted(None, 7, None) is SequenceStatus.FINISHED_STOPPED
    assert hooks.token_accepted(None, 3, None) is None
    assert hooks.token_accepted(None, 3, SequenceStatus.FINISHED_LENGTH) is SequenceStatus.FINISHED_LENGTH
    assert isinstance(hooks.find(Stopper), Stopper) and hooks.find(StepHook) is not None


def test_the_engine_registers_only_the_features_it_runs(model_factory):
    from minivllm.config import EngineArgs
    from minivllm.engine.fault_injection import FaultInjectionHook
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.swap_manager import SwapCostHook
    from minivllm.spec_decode.hook import SpeculationHook
    from minivllm.structured_output.hook import GuidedDecodingHook

    path = model_factory("tiny-llama")
    plain = LLMEngine(EngineArgs(model=path, num_kv_blocks=64))
    assert [type(h) for h in plain.hooks.hooks] == [GuidedDecodingHook]
    spec = LLMEngine(EngineArgs(model=path, num_kv_blocks=64, speculative_model="ngram", num_speculative_tokens=2,
                                preemption_mode="swap", swap_space="1MiB"))
    assert [type(h) for h in spec.hooks.hooks] == [SpeculationHook, GuidedDecodingHook, SwapCostHook]
    assert spec.hooks.find(FaultInjectionHook) is None


def test_guided_decoding_stays_off_every_point_until_a_guided_request(model_factory):
    # An on-demand hook (guided decoding) is registered but dormant: plain traffic never calls its code; the first
    # request with a grammar turns it on (before its sequence is set up, so it gets its matcher) and it stays on.
    from minivllm.config import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import GuidedDecodingParams, SamplingParams
    from minivllm.structured_output.hook import GuidedDecodingHook

    engine = LLMEngine(EngineArgs(model=model_factory("tiny-llama"), num_kv_blocks=64))
    guided = engine.hooks.find(GuidedDecodingHook)
    assert guided is not None and not any(guided in at for at in engine.hooks.at.values())
    engine.add_request("plain", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert not any(guided in at for at in engine.hooks.at.values())
    engine.add_request("guided", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])))
    assert guided in engine.hooks.at["token_accepted"] and guided in engine.hooks.at["process_logits"]
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].text in ("yes", "no")
    engine.check_invariants()
