"""The seed's endpoints: POST /generate (JSON or SSE), POST /batch_generate (one engine batch) and
WS /ws/generate."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from minivllm.engine.async_engine import AsyncStream
from minivllm.entrypoints.api_schema import (
    GENERATION_ERRORS,
    BatchGenerateResponse,
    GenerateResponse,
    responses,
)
from minivllm.entrypoints.auth import key_subprotocol
from minivllm.entrypoints.protocol import BatchGenerateRequest, GenerateRequest, beam_search_fields
from minivllm.entrypoints.server_args import WS_MAX_QUEUED
from minivllm.entrypoints.serving import (
    APIError,
    ClientDisconnected,
    ServerState,
    bad_request,
    engine_error,
    new_request_id,
    prompt_logprobs_json,
    validation_message,
)
from minivllm.entrypoints.streaming import sse
from minivllm.sampling_params import RequestOutputKind, SamplingParams

router = APIRouter()
_DEFAULT_MAX_TOKENS = 128


def _params(body: GenerateRequest | BatchGenerateRequest, kind: RequestOutputKind) -> SamplingParams:
    extra = {}
    if isinstance(body, GenerateRequest):
        extra["prompt_logprobs"] = body.prompt_logprobs
        if body.beam_width is not None:
            extra.update(beam_search_fields(body.beam_width, body.length_penalty, body.early_stopping))
    try:
        return body.sampling_params(body.max_new_tokens, kind, **extra)
    except ValueError as e:
        raise bad_request(e) from None


@router.post("/generate", responses=responses(GenerateResponse, *GENERATION_ERRORS, stream=True))
async def generate(body: GenerateRequest, request: Request) -> Response:
    """One prompt: JSON, or SSE with stream=true."""
    state: ServerState = request.app.state.server
    t0 = request.state.t0
    params = _params(body, RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY)
    (req,) = await state.prepare(new_request_id("gen"), [body.prompt], params, body.priority,
                                 default_max_tokens=_DEFAULT_MAX_TOKENS, ttft_slo_ms=body.ttft_slo_ms,
                                 timeout_s=body.timeout, request=request)
    streams = await state.submit([req])
    if body.stream:
        return state.stream_response("/generate", t0, _deltas(streams[0]), streams)
    (out,) = await state.wait_finals(request, streams)
    c = out.outputs[0]
    state.count("/generate", "success", t0)
    answer = {"generated_text": c.text, "tokens_generated": len(c.token_ids),
              "latency_ms": 1000.0 * (time.monotonic() - t0), "finish_reason": c.finish_reason,
              "prompt_tokens": len(out.prompt_token_ids)}
    if body.beam_width is not None:
        answer["beams"] = [{"text": b.text, "token_ids": b.token_ids, "cumulative_logprob": b.cumulative_logprob,
                            "finish_reason": b.finish_reason} for b in out.outputs]
    if body.prompt_logprobs is not None:
        answer["prompt_logprobs"] = prompt_logprobs_json(out, body.prompt_logprobs)
    return JSONResponse(answer)


async def _deltas(stream: AsyncStream) -> AsyncIterator[str]:
    """/generate with stream: one event per engine step with new tokens (the last one carries finish_reason).
    Its text may be empty (a character still incomplete, or a token with no text): the event still tells
    the client that a token arrived, as OpenAI's chunks and gRPC's messages do."""
    n = 0
    async for out in stream:
        for c in out.outputs:
            n += len(c.token_ids)
            if c.token_ids or c.finished:
                yield sse(json.dumps({"text": c.text, "tokens_generated": n, "finish_reason": c.finish_reason},
                                     ensure_ascii=False))


@router.post("/batch_generate", responses=responses(BatchGenerateResponse, *GENERATION_ERRORS))
async def batch_generate(body: BatchGenerateRequest, request: Request) -> Response:
    """Several prompts, run as one batch."""
    state: ServerState = request.app.state.server
    t0 = request.state.t0
    params = _params(body, RequestOutputKind.FINAL_ONLY)
    reqs = await state.prepare(new_request_id("batch"), list(body.prompts), params, body.priority,
                               default_max_tokens=_DEFAULT_MAX_TOKENS, ttft_slo_ms=body.ttft_slo_ms,
                               timeout_s=body.timeout, request=request)
    streams = await state.submit(reqs)  # one inbox entry: the engine sees them together and batches them
    outs = await state.wait_finals(request, streams)
    state.count("/batch_generate", "success", t0)
    return JSONResponse({"generated_texts": [o.outputs[0].text for o in outs],
                         "tokens_generated": [len(o.outputs[0].token_ids) for o in outs],
                         "finish_reasons": [o.outputs[0].finish_reason for o in outs],
                         "latency_ms": 1000.0 * (time.monotonic() - t0)})


@router.websocket("/ws/generate")
async def ws_generate(ws: WebSocket) -> None:
    """Streaming over a WebSocket."""
    await ws.accept(subprotocol=key_subprotocol(ws.scope))
    await _serve_websocket(ws.app.state.server, ws)


async def _serve_websocket(state: ServerState, ws: WebSocket) -> None:
    """WS /ws/generate: each JSON request gets one message per delta, then a final one with usage.
    Requests on one connection run one after another; closing the socket aborts the current one and
    drops any still queued. At most WS_MAX_QUEUED wait (more get a 429 each), and a message over
    --max-body-size ends the connection (uvicorn_limits stops it earlier, before buffering it whole)."""
    inbox: asyncio.Queue[str | bytes] = asyncio.Queue(maxsize=WS_MAX_QUEUED)

    async def reader() -> None:  # ends when the client goes away or sends a message over the size bound
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, KeyError):
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                # A binary frame gets a 400 (in _ws_request), not a silently dropped connection.
                text = message.get("text")
                payload = text if text is not None else message.get("bytes") or b""
                if len(payload) > state.max_body_bytes:
                    err = APIError(413, f"a message of {len(payload)} characters exceeds the server's limit of "
                                        f"{state.max_body_bytes} bytes (--max-body-size)")
                    await ws.send_json(err.body())
                    await ws.close(1009)
                    state.count("/ws/generate", "client_error", time.monotonic())
                    return
                if inbox.full():  # (the reader keeps reading, so a client that leaves still aborts its request)
                    err = APIError(429, f"{WS_MAX_QUEUED} requests already wait on this connection behind the one "
                                        "running; wait for an answer before sending more")
                    async with asyncio.timeout(state.stall_timeout_s):
                        await ws.send_json(err.body())
                    state.count("/ws/generate", "client_error", time.monotonic())
                    continue
                inbox.put_nowait(payload)

    reading = asyncio.ensure_future(reader())
    try:
        while True:
            getting = asyncio.ensure_future(inbox.get())
            await asyncio.wait({getting, reading}, return_when=asyncio.FIRST_COMPLETED)
            if reading.done():
                getting.cancel()
                return
            await _ws_request(state, ws, getting.result(), reading)
    except (WebSocketDisconnect, RuntimeError, ClientDisconnected):
        pass  # returning ends the connection
    finally:
        reading.cancel()


async def _ws_request(state: ServerState, ws: WebSocket, text: str | bytes, reading: asyncio.Future[None]) -> None:
    t0 = time.monotonic()
    try:
        if isinstance(text, bytes):
            raise APIError(400, f"a binary frame ({len(text)} bytes): send each request as one JSON text frame")
        body = GenerateRequest.model_validate_json(text)
        params = _params(body, RequestOutputKind.DELTA)
        (req,) = await state.prepare(new_request_id("ws"), [body.prompt], params, body.priority,
                                     default_max_tokens=_DEFAULT_MAX_TOKENS, ttft_slo_ms=body.ttft_slo_ms,
                                     timeout_s=body.timeout)
        if reading.done():
            return
        (stream,) = await state.submit([req])
    except ValidationError as e:
        msg, param = validation_message(e)
        await ws.send_json(APIError(400, msg, param).body())
        state.count("/ws/generate", "client_error", t0)
        return
    except APIError as e:
        await ws.send_json(e.body())
        state.count("/ws/generate", "client_error" if e.status < 500 else "server_error", t0)
        return
    outcome = ["aborted"]
    pump = asyncio.ensure_future(_ws_stream(ws, stream, t0, outcome, state.stall_timeout_s))
    try:
        await asyncio.wait({pump, reading}, return_when=asyncio.FIRST_COMPLETED)  # the client may leave
    finally:
        if not pump.done():
            pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        state.abort([stream])
        state.count("/ws/generate", outcome[0], t0)
    if pump.done() and not pump.cancelled() and isinstance(pump.exception(), TimeoutError):
        raise ClientDisconnected("the client stopped reading its WebSocket")


async def _ws_stream(ws: WebSocket, stream: AsyncStream, t0: float, outcome: list[str], stall_timeout_s: float
                     ) -> None:
    async def send(message: dict[str, Any]) -> None:
        # A client that stopped reading fills the transport's buffers and the send waits: give up after a while
        # (TimeoutError ends the connection; the stream is aborted).
        async with asyncio.timeout(stall_timeout_s):
            await ws.send_json(message)

    n, text, finish = 0, [], None
    try:
        async for out in stream:
            for c in out.outputs:
                n += len(c.token_ids)
                text.append(c.text)
                finish = c.finish_reason or finish
                if c.token_ids:  # one message per step with new tokens, as /generate's events
                    await send({"text": c.text, "tokens_generated": n})
    except (WebSocketDisconnect, RuntimeError, asyncio.CancelledError):
        raise
    except Exception as e:
        outcome[0] = "server_error"
        await send(engine_error(e).body())
        return
    prompt_tokens = len(stream.prompt_token_ids)
    await send({"text": "", "finish_reason": finish, "generated_text": "".join(text),
                        "latency_ms": 1000.0 * (time.monotonic() - t0),
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                  "total_tokens": prompt_tokens + n}})
    outcome[0] = "success"
