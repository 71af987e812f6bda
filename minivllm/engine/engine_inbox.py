"""What the event loop hands the engine thread between steps: requests to add, aborts, and calls to run on the
engine (state such as LoRA slots belongs to that thread), under one condition variable."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minivllm.engine.input_processor import EngineRequest

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine


@dataclass
class Abort:
    """Abort this request before the next step."""

    request_id: str


@dataclass
class Call:
    """Run fn(engine) between steps; its result (or exception) settles `future` on the event loop."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


Item = EngineRequest | Abort | Call


class EngineInbox:
    """A locked queue of Items, with the count of requests in it (the waiting gauge) and the stop flag."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: deque[Item] = deque()
        self.adds = 0  # requests in the inbox
        self.stopped = False

    def put(self, items: Sequence[Item]) -> None:
        """Queue items and wake the engine thread."""
        with self._cv:
            self._items.extend(items)
            self.adds += sum(isinstance(i, EngineRequest) for i in items)
            self._cv.notify()

    def stop(self) -> None:
        """Ask the engine thread to stop."""
        with self._cv:
            self.stopped = True
            self._cv.notify()

    def take(self, wait: float | None) -> list[Item]:
        """Everything queued; when empty (and not stopping), first wait up to `wait` seconds for something."""
        with self._cv:
            if wait and not self._items and not self.stopped:
                self._cv.wait(wait)
            items = list(self._items)
            self._items.clear()
            self.adds = 0
        return items


def settle(future: asyncio.Future[Any], result: Any, error: Exception | None) -> None:
    """Complete a Call's future (on the event loop)."""
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)
