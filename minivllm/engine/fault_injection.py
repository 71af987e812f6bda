"""Test-only fault injection: faults that fire for the requests whose prompt holds a marker text.

Off unless MINIVLLM_FAULT_INJECTION names faults, e.g. `step_raise=<<boom>>,nan_logits=<<nan>>`; refused
(the engine does not start) when MINIVLLM_ENV=production, so a stray variable cannot arm it in a deployment.
Faults exercise the real containment paths rather than stand in for them:

- step_raise: the forward pass raises whenever a marked request is in the batch (step_guard.py isolates it);
- nan_logits: a marked request's logits rows turn NaN (step_guard.py fails the rows that are not finite);
- detokenize: a marked request's detokenizer raises (the engine fails that request at the end of the step);
- kill_loop: the engine loop dies when a marked request reaches it (the server then answers 503 and exits).

Cost when off: one `is None` test per step. A request's faults are looked up once, when it is added.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ENV_VAR = "MINIVLLM_FAULT_INJECTION"
PRODUCTION_ENV = "MINIVLLM_ENV"
KINDS = ("step_raise", "nan_logits", "detokenize", "kill_loop")


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
