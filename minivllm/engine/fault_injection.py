"""Test-only fault injection: faults that fire for the requests whose prompt holds a marker text.

Off unless MINIVLLM_FAULT_INJECTION names faults, e.g. `step_raise=<<boom>>,nan_logits=<<nan>>`; refused
(the engine does not start) when MINIVLLM_ENV=production, so a stray variable cannot arm it in a deployment.
Faults exercise the real containment paths rather than stand in for them:

- step_raise: the forward pass raises whenever a marked request is in the batch (step_guard.py isolates it);
- nan_logits: a marked request's logits rows turn NaN (step_guard.py fails the rows that are not finite);
- detokenize: a marked request's detokenizer raises (the engine fails that request at the end of the step);
- kill_loop: the engine loop dies when a marked request reaches it (the server then answers 503 and exits);
- slow_step: each step that holds a marked request takes SLOW_STEP_S longer (a slow model at a known pace, so a
  test of what happens while a request runs does not race the machine's speed).

The faults act through the step's hook points (FaultInjectionHook; engine/hooks.py), so no core class knows of
them. Cost when off: none (the hook is not registered). A request's faults are looked up once, when it is added.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minivllm.engine.hooks import Entry, Forward, StepHook
from minivllm.engine.step_guard import entry_spans

if TYPE_CHECKING:
    from minivllm.engine.sequence import Sequence, SequenceGroup
    from minivllm.model.runner import SequenceInput

logger = logging.getLogger(__name__)

ENV_VAR = "MINIVLLM_FAULT_INJECTION"
PRODUCTION_ENV = "MINIVLLM_ENV"
KINDS = ("step_raise", "nan_logits", "detokenize", "kill_loop", "slow_step")
SLOW_STEP_S = 0.01


class InjectedFault(RuntimeError):
    """A fault raised on purpose by the fault-injection hook."""


class EngineLoopKilled(BaseException):
    """Ends the engine loop as a crash would (a BaseException: no per-step handler catches it)."""


@dataclass(slots=True, frozen=True)
class FaultInjector:
    """kind → marker text: a request whose prompt contains the marker gets that fault."""

    markers: dict[str, str]

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FaultInjector | None:
        """The injector MINIVLLM_FAULT_INJECTION asks for, or None (the default: nothing is injected).
        ValueError for a malformed spec, or for any spec when MINIVLLM_ENV=production."""
        env = os.environ if environ is None else environ
        spec = env.get(ENV_VAR, "").strip()
        if not spec:
            return None
        if env.get(PRODUCTION_ENV, "").strip().lower() == "production":
            raise ValueError(f"{ENV_VAR} is set but {PRODUCTION_ENV}=production: fault injection is a test-only "
                             "hook and is refused in production; unset it")
        markers: dict[str, str] = {}
        for part in spec.split(","):
            kind, sep, marker = part.partition("=")
            kind = kind.strip()
            if not sep or kind not in KINDS or not marker:
                raise ValueError(f"{ENV_VAR}: {part!r} is not KIND=MARKER with KIND one of {', '.join(KINDS)}")
            markers[kind] = marker
        logger.warning("FAULT INJECTION IS ON (%s): requests holding these markers fail on purpose", markers)
        return cls(markers)

    def faults_for(self, prompt: str | None, prompt_text: Any) -> frozenset[str]:
        """The faults of a request: those whose marker appears in its prompt (text, or decoded token ids)."""
        text = prompt if prompt is not None else str(prompt_text())
        return frozenset(kind for kind, marker in self.markers.items() if marker in text)


class FailingDetokenizer:
    """Wraps a sequence's detokenizer so that decoding raises (fault `detokenize`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        raise InjectedFault("injected fault: the detokenizer failed for this request")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FaultInjectionHook(StepHook):
    """The injector's faults at the step's hook points: marked requests found when added, the forward wrapped."""

    def __init__(self, injector: FaultInjector, tokenizer: Any) -> None:
        self.injector, self.tokenizer = injector, tokenizer
        self.marked: dict[str, frozenset[str]] = {}  # request id → its faults (only requests that have some)

    def request_added(self, group: SequenceGroup) -> None:
        faults = self.injector.faults_for(group.prompt, lambda: self.tokenizer.decode(group.prompt_token_ids))
        if "kill_loop" in faults:
            raise EngineLoopKilled(f"injected fault: request {group.request_id!r} killed the engine loop (kill_loop)")
        if faults:
            self.marked[group.request_id] = faults

    def sequence_added(self, seq: Sequence) -> None:
        if "detokenize" in self.marked.get(seq.request_id, ()) and seq.detokenizer is not None:
            seq.detokenizer = FailingDetokenizer(seq.detokenizer)  # type: ignore[assignment]

    def sequence_finished(self, seq: Sequence) -> None:
        if seq.group is None or seq.group.finished:
            self.marked.pop(seq.request_id, None)

    def forward(self, inner: Forward) -> Forward:
        def run(scheduled: list[Entry], inputs: list[SequenceInput]) -> torch.Tensor:
            faults = set().union(*(self.marked.get(seq.request_id, ()) for seq, _ in scheduled))
            if "step_raise" in faults:
                raise InjectedFault("injected fault: the forward pass raised (step_raise)")
            if "slow_step" in faults:
                time.sleep(SLOW_STEP_S)
            logits = inner(scheduled, inputs)
            with torch.inference_mode():
                for (seq, _), (_, _, r0, r1) in zip(scheduled, entry_spans(scheduled, inputs), strict=True):
                    if "nan_logits" in self.marked.get(seq.request_id, ()) and r1 > r0:
                        logits[r0:r1] = float("nan")
            return logits

        return run
