"""What a request's consumer holds: AsyncStream (its outputs, in order, on the event loop) and the errors that
end a stream early."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from minivllm.outputs import RequestOutput


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
