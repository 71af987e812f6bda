"""The HTTP server: FastAPI app with the seed endpoints, the OpenAI routes, /health, /metrics and the
WebSocket stream, behind a guard for API keys and body size; `run_server` starts it under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.config import EngineArgs, parse_size
from minivllm.engine.async_engine import AsyncLLMEngine, AsyncStream
from minivllm.entrypoints import openai_routes
from minivllm.entrypoints.metrics import ServerMetrics
from minivllm.entrypoints.protocol import BatchGenerateRequest, GenerateRequest
from minivllm.entrypoints.serving import (
    APIError,
    ClientDisconnected,
    EngineStreamingResponse,
    ServerArgs,
    ServerState,
    bad_request,
    engine_error,
    final_output,
    final_outputs,
    served_model_name,
    sse,
    until_disconnect,
)
from minivllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_SEED_DEFAULT_MAX_TOKENS = 128
_LAG_PROBE_S = 0.01
# Routes that need the API key (monitoring stays open, as Prometheus scrapes without one).
_OPEN_PATHS = frozenset({"/health", "/metrics", "/docs", "/openapi.json"})


class BodyTooLarge(StarletteHTTPException):
    """The request body is over --max-body-size."""


class GuardMiddleware:
    """API key and body-size checks before any route runs (pure ASGI, so streaming is untouched)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    def _authorized(self, scope: Scope) -> bool:
        if not self.api_key or scope["path"] in _OPEN_PATHS:
            return True
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        return hmac.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["t0"] = time.monotonic()  # request.state.t0: latency from arrival
        if not self._authorized(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})
                return
            err = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")
            return await err.response()(scope, receive, send)
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            err = APIError(413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes "
                                "(--max-body-size)")
            return await err.response()(scope, receive, send)
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked body with no Content-Length
                    raise BodyTooLarge(413, f"request body exceeds the limit of {limit} bytes (--max-body-size)")
            return message

        await self.app(scope, counting_receive, send)


def _validation_message(e: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in e.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        got = err.get("input")
        if not loc and isinstance(got, bytes | str):
            parts.append("the request body must be a JSON object (send it with Content-Type: application/json)")
            continue
        field = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        shown = "" if err.get("type") == "missing" else f" (got {json.dumps(got, default=str)[:80]})"
        parts.append(f"{field}: {err.get('msg')}{shown}")
    return "; ".join(parts) or "invalid request", param


def _install_error_handlers(app: FastAPI) -> None:
    def counted(request: Request, err: APIError) -> JSONResponse:
        state: ServerState = request.app.state.server
        if request.url.path in openai_routes.GENERATION_PATHS:
            status = "client_error" if err.status < 500 else "server_error"
            state.count(request.url.path, status, getattr(request.state, "t0", time.monotonic()))
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return counted(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return counted(request, APIError(400, msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's generic "error parsing the body"
            detail = f"the request body is not valid UTF-8 JSON ({exc.__cause__.reason} at byte {exc.__cause__.start})"
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            detail = f"method {request.method} is not allowed on {request.url.path}"
        return counted(request, APIError(exc.status_code, detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return counted(request, APIError(500, f"internal server error: {exc!r}"))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        request.app.state.server.count(request.url.path, "aborted", getattr(request.state, "t0", time.monotonic()))
        return Response(status_code=499)


async def _lag_probe(metrics: ServerMetrics) -> None:
    """How late a 10 ms timer fires: the event loop's responsiveness under load."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(_LAG_PROBE_S)
        metrics.observe_loop_lag(max(0.0, loop.time() - t - _LAG_PROBE_S))


def build_app(engine: AsyncLLMEngine, args: ServerArgs) -> FastAPI:
    """The FastAPI app around a (not yet started) AsyncLLMEngine; its metrics join the engine's loggers."""
    metrics = ServerMetrics(served_model_name(engine.engine.args.model, args))
    engine.stat_loggers.insert(0, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        probe = asyncio.ensure_future(_lag_probe(metrics))
        try:
            yield
        finally:
            probe.cancel()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Mini-vLLM", lifespan=lifespan)
    app.state.server = state = ServerState(engine, metrics, args)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        err = APIError(503, f"engine loop is not running ({engine.dead_error!r})")
        return JSONResponse({"status": "error", **err.body()}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        t0 = request.state.t0
        params = _seed_params(body, RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY)
        (req,) = await state.prepare(_rid("gen"), [body.prompt], params, body.priority,
                                     default_max_tokens=_SEED_DEFAULT_MAX_TOKENS)
        (stream,) = state.submit([req])
        if body.stream:
            return EngineStreamingResponse(_seed_sse(state, stream, t0), lambda: state.abort([stream]),
                                           media_type="text/event-stream")
        try:
            out = await until_disconnect(request, final_output(stream))
        except (ClientDisconnected, asyncio.CancelledError):
            state.abort([stream])
            raise
        except Exception as e:
            raise engine_error(e) from None
        c = out.outputs[0]
        state.count("/generate", "success", t0)
        return JSONResponse({"generated_text": c.text, "tokens_generated": len(c.token_ids),
                             "latency_ms": 1000.0 * (time.monotonic() - t0), "finish_reason": c.finish_reason,
                             "prompt_tokens": len(out.prompt_token_ids)})

    @app.post("/batch_generate")
    async def batch_generate(body: BatchGenerateRequest, request: Request) -> Response:
        t0 = request.state.t0
        params = _seed_params(body, RequestOutputKind.FINAL_ONLY)
        reqs = await state.prepare(_rid("batch"), list(body.prompts), params, body.priority,
                                   default_max_tokens=_SEED_DEFAULT_MAX_TOKENS)
        streams = state.submit(reqs)  # one inbox entry: the engine sees them together and batches them
        try:
            outs = await until_disconnect(request, final_outputs(streams))
        except (ClientDisconnected, asyncio.CancelledError):
            state.abort(streams)
            raise
        except Exception as e:
            state.abort(streams)
            raise engine_error(e) from None
        state.count("/batch_generate", "success", t0)
        return JSONResponse({"generated_texts": [o.outputs[0].text for o in outs],
                             "tokens_generated": [len(o.outputs[0].token_ids) for o in outs],
                             "finish_reasons": [o.outputs[0].finish_reason for o in outs],
                             "latency_ms": 1000.0 * (time.monotonic() - t0)})

    @app.websocket("/ws/generate")
    async def ws_generate(ws: WebSocket) -> None:
        await ws.accept()
        await _serve_websocket(state, ws)

    app.include_router(openai_routes.router)
    app.add_middleware(GuardMiddleware, api_key=args.api_key, max_body_bytes=parse_size(args.max_body_size))
    return app


def _rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _seed_params(body: GenerateRequest | BatchGenerateRequest, kind: RequestOutputKind) -> SamplingParams:
    try:
        return body.sampling_params(body.max_new_tokens, kind)
    except ValueError as e:
        raise bad_request(e) from None


async def _seed_sse(state: ServerState, stream: AsyncStream, t0: float) -> AsyncIterator[str]:
    """/generate with stream: one event per text delta, then [DONE]."""
    n = 0
    status = "aborted"
    try:
        async for out in stream:
            for c in out.outputs:
                n += len(c.token_ids)
                if c.text or c.finished:
                    yield sse(json.dumps({"text": c.text, "tokens_generated": n, "finish_reason": c.finish_reason},
                                         ensure_ascii=False))
        status = "success"
        yield sse("[DONE]")
    except Exception as e:
        status = "server_error"
        yield sse(json.dumps(engine_error(e).body()))
    finally:
        state.abort([stream])
        state.count("/generate", status, t0)


async def _serve_websocket(state: ServerState, ws: WebSocket) -> None:
    """WS /ws/generate: each JSON request gets one message per delta, then a final one with usage.
    Requests on one connection run one after another; closing the socket aborts the current one and
    drops any still queued."""
    inbox: asyncio.Queue[str] = asyncio.Queue()

    async def reader() -> None:  # ends when the client goes away
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, KeyError):
            while True:
                await inbox.put(await ws.receive_text())

    reading = asyncio.ensure_future(reader())
    try:
        while True:
            getting = asyncio.ensure_future(inbox.get())
            await asyncio.wait({getting, reading}, return_when=asyncio.FIRST_COMPLETED)
            if reading.done():
                getting.cancel()
                return
            await _ws_request(state, ws, getting.result(), reading)
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        reading.cancel()


async def _ws_request(state: ServerState, ws: WebSocket, text: str, reading: asyncio.Future[None]) -> None:
    t0 = time.monotonic()
    try:
        body = GenerateRequest.model_validate_json(text)
        params = _seed_params(body, RequestOutputKind.DELTA)
        (req,) = await state.prepare(_rid("ws"), [body.prompt], params, body.priority,
                                     default_max_tokens=_SEED_DEFAULT_MAX_TOKENS)
        if reading.done():
            return
        (stream,) = state.submit([req])
    except ValidationError as e:
        msg, param = _validation_message(e)
        await ws.send_json(APIError(400, msg, param).body())
        state.count("/ws/generate", "client_error", t0)
        return
    except APIError as e:
        await ws.send_json(e.body())
        state.count("/ws/generate", "client_error" if e.status < 500 else "server_error", t0)
        return
    outcome = ["aborted"]
    pump = asyncio.ensure_future(_ws_stream(ws, stream, t0, outcome))
    try:
        await asyncio.wait({pump, reading}, return_when=asyncio.FIRST_COMPLETED)  # the client may leave
    finally:
        if not pump.done():
            pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        state.abort([stream])
        state.count("/ws/generate", outcome[0], t0)


async def _ws_stream(ws: WebSocket, stream: AsyncStream, t0: float, outcome: list[str]) -> None:
    n, text, finish = 0, [], None
    try:
        async for out in stream:
            for c in out.outputs:
                n += len(c.token_ids)
                text.append(c.text)
                finish = c.finish_reason or finish
                if c.text:
                    await ws.send_json({"text": c.text, "tokens_generated": n})
    except (WebSocketDisconnect, RuntimeError, asyncio.CancelledError):
        raise
    except Exception as e:
        outcome[0] = "server_error"
        await ws.send_json(engine_error(e).body())
        return
    prompt_tokens = len(stream.prompt_token_ids)
    await ws.send_json({"text": "", "finish_reason": finish, "generated_text": "".join(text),
                        "latency_ms": 1000.0 * (time.monotonic() - t0),
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                  "total_tokens": prompt_tokens + n}})
    outcome[0] = "success"


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    """Load the model and serve until interrupted."""
    import uvicorn

    engine = AsyncLLMEngine.from_engine_args(engine_args)
    app = build_app(engine, server_args)
    logger.info("serving %s on http://%s:%d", app.state.server.model_name, server_args.host, server_args.port)
    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                timeout_graceful_shutdown=5)
