"""The async engine's two channels across the thread boundary. Out: what a request's consumer holds, AsyncStream
(its outputs, in order, on the event loop), and the errors that end a stream early. In: EngineInbox, what the event
loop hands the engine thread between steps (requests to add, aborts, and calls to run on the engine: state such as
LoRA slots belongs to that thread), under one condition variable."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minivllm.engine.input_processor import EngineRequest
from minivllm.outputs import RequestOutput

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine


def failure_text(e: BaseException) -> str:
    """What a client is told of an exception that failed its request: the package's own exceptions carry messages
    written for clients; any other (a bug's KeyError, an ATen error) only its type, since its text can hold the
    server's internals (paths, other requests' ids). The server's log has the traceback."""
    if type(e).__module__.startswith("minivllm."):
        return str(e)
    return f"{type(e).__name__}; the request was not at fault and the server's log has the details"


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; retry later."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """A step that included this request raised; the request was aborted, the engine keeps serving."""


class RequestTimeoutError(RequestFailedError):
    """The request's timeout passed before it started; it was dropped before any prefill."""


class ClientStalledError(RequestFailedError):
    """The client stopped reading its stream while outputs piled up; the request was aborted."""


class AsyncStream:
    """The outputs of one request, consumed with `async for` on the event loop."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.last_read = time.monotonic()  # when the consumer last took an output (or the stream began)
        self._on_end: list[Callable[[AsyncStream], None]] = []
        self._ended = False

    @property
    def finished(self) -> bool:
        """The consumer has the last output (or the error), or the request was aborted."""
        return self._finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self._finished = value
        if value:
            self._end()

    def on_end(self, callback: Callable[[AsyncStream], None]) -> None:
        """Call back (once, on the event loop) when the request leaves the engine: finished, failed or aborted.
        Per-client admission (entrypoints/clients.py) counts requests in flight with it."""
        if self._ended:
            callback(self)
        else:
            self._on_end.append(callback)

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            callbacks, self._on_end = self._on_end, []
            for cb in callbacks:
                cb(self)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver an output (or the error that ends the request); event-loop thread only."""
        self._queue.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            self._end()

    def fail(self, error: BaseException) -> None:
        """End the stream with error, dropping the outputs not yet read (the consumer gets the error next)."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(error)
        self._end()

    @property
    def num_unread(self) -> int:
        """Outputs delivered and not yet taken by the consumer."""
        return self._queue.qsize()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            self.last_read = time.monotonic()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


# ---- in: the engine thread's inbox -----------------------------------------------------------------------------------
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
