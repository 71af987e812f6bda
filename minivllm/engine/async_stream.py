"""What a request's consumer holds: AsyncStream (its outputs, in order, on the event loop) and the errors that
end a stream early."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from minivllm.outputs import RequestOutput


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
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.last_read = time.monotonic()  # when the consumer last took an output (or the stream began)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver an output (or the error that ends the request); event-loop thread only."""
        self._queue.put_nowait(item)

    def fail(self, error: BaseException) -> None:
        """End the stream with error, dropping the outputs not yet read (the consumer gets the error next)."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(error)

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
