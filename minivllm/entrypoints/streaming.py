"""Streaming responses: Server-Sent Events that abort their engine requests when the client goes away or stops
reading, and the merge of several requests' streams into one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from minivllm.engine.async_stream import AsyncStream
from minivllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


async def merge(streams: list[AsyncStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class EngineStreamingResponse(StreamingResponse):
    """SSE that stops — and aborts its engine requests — the moment the client disconnects.

    Starlette only notices a disconnect at the next write under ASGI 2.4; this always listens, so a
    request still queued (no tokens to write yet) is aborted too, and it always closes the generator
    and calls on_close (which aborts, even if the generator never started)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], stall_timeout_s: float = 30.0,
                 **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close
        self.stall_timeout_s = stall_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        async def timed_send(message: Message) -> None:
            # uvicorn's send waits while the transport's buffer is full: a client that stopped reading would hold
            # this response (and its engine request) forever.
            async with asyncio.timeout(self.stall_timeout_s):
                await send(message)

        streamer = asyncio.ensure_future(self.stream_response(timed_send))
        listener = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({streamer, listener}, return_when=asyncio.FIRST_COMPLETED)
            if streamer.done() and not streamer.cancelled() and isinstance(streamer.exception(), TimeoutError):
                logger.warning("a client read nothing of its stream for %g s: response dropped, its request "
                               "aborted (--client-stall-timeout)", self.stall_timeout_s)
        finally:
            streamer.cancel()
            listener.cancel()
            await asyncio.gather(streamer, listener, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()


def sse(data: str) -> str:
    """One Server-Sent Event."""
    return f"data: {data}\n\n"
