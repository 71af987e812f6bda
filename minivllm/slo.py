"""SLO-aware scheduling's vocabulary (issue 19): priority classes and time-to-first-token deadlines.

A request's `priority` is vLLM's int (lower is served sooner) or a class name: interactive = 0, batch = 1,
background = 2. The class of any int follows from it: <= 0 interactive, 1 batch, >= 2 background. Requests that
name no priority are 0, i.e. interactive, so a server whose clients know nothing of classes behaves as before.
The int orders the queues; the class is what metrics label and what may displace running work (a better class
preempts a worse one, never a same-class one: engine/scheduler.py).

A TTFT deadline is arrival + SLO: per request (`ttft_slo_ms`), else its class's default (`--ttft-slo-ms`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

PRIORITY_CLASSES: dict[str, int] = {"interactive": 0, "batch": 1, "background": 2}
CLASS_NAMES = tuple(PRIORITY_CLASSES)
_INT_RE = re.compile(r"^[+-]?\d+$")


def class_rank(priority: int) -> int:
    """The class of a priority value as an index into CLASS_NAMES (0 interactive, 1 batch, 2 background)."""
    return 0 if priority <= 0 else 1 if priority == 1 else 2


def priority_class(priority: int) -> str:
    """The class name of a priority value (<= 0 interactive, 1 batch, >= 2 background)."""
    return CLASS_NAMES[class_rank(priority)]


def resolve_priority(value: int | str) -> int:
    """An int, or a class name → the priority int; ValueError naming `priority` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        name = value.strip().lower()
        if name in PRIORITY_CLASSES:
            return PRIORITY_CLASSES[name]
        if _INT_RE.match(name) and len(name) <= 20:  # a number sent as a JSON string: the HTTP API took those before
            return int(name)                        # classes (int() refuses over 4300 digits, unnamed: capped here)
    raise ValueError(f"priority: {value!r} is neither an integer (lower is served sooner) nor a priority class "
                     f"({', '.join(CLASS_NAMES)})")


def check_slo_ms(value: object, what: str = "ttft_slo_ms") -> float:
    """A TTFT SLO in milliseconds, checked: a finite number > 0 (ValueError naming `what`)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}: a TTFT deadline must be a positive number of milliseconds, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class TtftSlo:
    """Each class's default TTFT SLO in seconds (None: the class has no deadline unless a request sets one)."""

    per_class: tuple[float | None, ...] = (None, None, None)

    @staticmethod
    def parse(spec: str | float | None) -> TtftSlo:
        """`--ttft-slo-ms`: "interactive=500,batch=30000" (a class not named has no default deadline), or one
        number, which is interactive's alone: batch and background work rarely has a first-token deadline, and
        every request without a class is interactive, so one number covers a server that uses no classes."""
        if spec is None or spec == "":
            return TtftSlo()
        if not isinstance(spec, str):
            return TtftSlo((check_slo_ms(spec) / 1000, None, None))
        if "=" not in spec:
            try:
                value = float(spec)
            except ValueError:
                raise ValueError(f"ttft_slo_ms: cannot parse {spec!r}; give milliseconds for interactive requests "
                                 "(e.g. 500) or CLASS=MS pairs (e.g. interactive=500,batch=30000)") from None
            return TtftSlo((check_slo_ms(value) / 1000, None, None))
        per_class: list[float | None] = [None] * len(CLASS_NAMES)
        for part in spec.split(","):
            name, sep, ms = (x.strip() for x in part.partition("="))
            if not sep or not name or not ms:
                raise ValueError(f"ttft_slo_ms: {part.strip()!r} in {spec!r} is not CLASS=MS "
                                 "(e.g. interactive=500,batch=30000)")
            if name not in PRIORITY_CLASSES:
                raise ValueError(f"ttft_slo_ms: unknown class {name!r}; the classes are {', '.join(CLASS_NAMES)}")
            rank = PRIORITY_CLASSES[name]
            if per_class[rank] is not None:
                raise ValueError(f"ttft_slo_ms: {name} is given twice in {spec!r}")
            try:
                value = float(ms)
            except ValueError:
                raise ValueError(f"ttft_slo_ms: {name}={ms!r} is not a number of milliseconds") from None
            per_class[rank] = check_slo_ms(value, f"ttft_slo_ms ({name})") / 1000
        return TtftSlo(tuple(per_class))

    def deadline(self, priority: int, arrival_time: float, ttft_slo_ms: float | None = None) -> float:
        """When the request's first token is due (arrival_time's clock): its own SLO, else its class's; math.inf
        when it has neither."""
        if ttft_slo_ms is not None:
            return arrival_time + check_slo_ms(ttft_slo_ms) / 1000
        slo = self.per_class[class_rank(priority)]
        return math.inf if slo is None else arrival_time + slo
