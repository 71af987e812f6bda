"""The HTTP server: the FastAPI app (seed and OpenAI routes, /health, /metrics) behind a guard for API
keys and body size, its error handlers and lifespan (which also starts the gRPC server on the same loop
and engine when --grpc-port is given); `run_server` starts it under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.config import EngineArgs, parse_size
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.protocol import EngineClient
from minivllm.entrypoints import (
    anthropic_routes,
    dashboard,
    embeddings_routes,
    lora_routes,
    openai_routes,
    responses_routes,
    seed_routes,
    tokenize_routes,
)
from minivllm.entrypoints.api_schema import HealthResponse
from minivllm.entrypoints.auth import KeyPolicy, redact_access_logs
from minivllm.entrypoints.clients import current_client
from minivllm.entrypoints.metrics import HTTP_ENDPOINTS, ServerMetrics
from minivllm.entrypoints.responses_store import ResponseStore
from minivllm.entrypoints.server_args import ServerArgs, uvicorn_limits
from minivllm.entrypoints.serving import (
    APIError,
    ClientDisconnected,
    ServerState,
    dead_engine,
    internal_error,
    served_model_name,
    validation_message,
)
from minivllm.gc_utils import freeze_startup_heap

logger = logging.getLogger(__name__)

_LAG_PROBE_S = 0.01
_DEATH_EXIT_DELAY_S = 1.0


class BodyTooLarge(StarletteHTTPException):
    """The request body is over --max-body-size."""


class BodyStalled(StarletteHTTPException):
    """The client sent nothing of the rest of its request body for --client-stall-timeout (slow loris)."""


class GuardMiddleware:
    """API key and body-size checks before any route runs (pure ASGI, so streaming is untouched)."""

    def __init__(self, app: ASGIApp, keys: KeyPolicy, max_body_bytes: int, stall_timeout_s: float = 30.0) -> None:
        self.app = app
        self.keys = keys
        self.keyed = bool(keys.api_key or keys.admin_key or keys.clients)  # no key set: every route is open
        self.max_body_bytes = max_body_bytes
        self.stall_timeout_s = stall_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["t0"] = time.monotonic()  # request.state.t0: latency from arrival
        if self.keyed:
            allowed, client = self.keys.identify(scope)
            if not allowed:
                message = self.keys.denial(scope["path"])
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
                    return
                return await APIError(401, message).response(scope["path"])(scope, receive, send)
            current_client.set(client)  # (this request's task and those it starts see it: clients.py)
        cookie = self.keys.page_set_cookie(scope) if self.keyed else None
        if cookie is not None:  # the live view's page opened with ?token=: a reload then needs none
            inner_send = send

            async def send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
                await inner_send(message)

        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            err = APIError(413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes "
                                "(--max-body-size)")
            return await err.response(scope["path"])(scope, receive, send)
        seen, body_done = 0, False

        async def counting_receive() -> Message:
            nonlocal seen, body_done
            if body_done:  # after the body, receive() only waits for the disconnect: no time limit
                return await receive()
            # uvicorn has no timeout of its own on a request body: a client that stops sending mid-body (slow
            # loris) would hold its connection and handler forever. Like nginx's client_body_timeout, this bounds
            # the wait for each next piece, not the whole upload.
            try:
                async with asyncio.timeout(self.stall_timeout_s):
                    message = await receive()
            except TimeoutError:
                raise BodyStalled(408, f"the client sent nothing of the rest of its request body for "
                                       f"{self.stall_timeout_s:g} s (--client-stall-timeout)",
                                  headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked body with no Content-Length
                    raise BodyTooLarge(413, f"request body exceeds the limit of {limit} bytes (--max-body-size)")
            return message

        await self.app(scope, counting_receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    def counted(request: Request, err: APIError) -> JSONResponse:
        state: ServerState = request.app.state.server
        if request.url.path in HTTP_ENDPOINTS:
            status = "client_error" if err.status < 500 else "server_error"
            state.count(request.url.path, status, getattr(request.state, "t0", time.monotonic()))
        return err.response(request.url.path)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return counted(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(exc)
        return counted(request, APIError(400, msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's generic "error parsing the body"
            detail = f"the request body is not valid UTF-8 JSON ({exc.__cause__.reason} at byte {exc.__cause__.start})"
        elif isinstance(exc.__cause__, RecursionError):  # json.loads gives up past ~1000 levels of [ or {
            detail = "invalid JSON body: nested too deeply"
        elif isinstance(exc.__cause__, ValueError):  # e.g. an integer of over 4300 digits (no server-side advice)
            detail = f"invalid JSON body: {str(exc.__cause__).split('; use sys.')[0]}"
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            detail = f"method {request.method} is not allowed on {request.url.path}"
            # A 405 must name every method the path takes (Allow, RFC 9110); Starlette names the first matching
            # route's only, and a path may have several (GET and DELETE /v1/responses/{id}).
            allowed = {m for r in _flat_routes(request.app.routes) if r.path_regex.match(request.url.path)
                       for m in r.methods or ()}
            if allowed - {"HEAD"}:
                headers = {k: v for k, v in headers.items() if k.lower() != "allow"}
                headers["Allow"] = ", ".join(sorted(allowed - {"HEAD"}))
        return counted(request, APIError(exc.status_code, detail, headers=headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return counted(request, internal_error(exc))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        request.app.state.server.count(request.url.path, "aborted", getattr(request.state, "t0", time.monotonic()))
        return Response(status_code=499)


def _flat_routes(routes: list[Any]) -> Iterator[Route]:
    """Every route of the app, through the routers it includes (FastAPI keeps those as included-router entries)."""
    for r in routes:
        if isinstance(r, Route):
            yield r
        inner = getattr(r, "routes", None) or getattr(getattr(r, "original_router", None), "routes", None)
        if inner:
            yield from _flat_routes(inner)


async def _lag_probe(metrics: ServerMetrics) -> None:
    """How late a 10 ms timer fires: the event loop's responsiveness under load."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(_LAG_PROBE_S)
        metrics.observe_loop_lag(max(0.0, loop.time() - t - _LAG_PROBE_S))


def build_app(engine: EngineClient, args: ServerArgs, metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI app around a (not yet started) AsyncLLMEngine, or a RayEngineClient with the metrics its
    launcher made; the metrics join the engine's loggers."""
    if metrics is None:
        metrics = ServerMetrics(served_model_name(engine.model_path, args), engine.num_speculative_tokens)
        metrics.watch_experts(engine.expert_load)
    engine.stat_loggers.insert(0, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        # A dead engine loop cannot come back: /health answers 503 at once, and after a moment (for in-flight
        # clients to get their 503s) the server stops, and run_server exits non-zero for a supervisor to restart it.
        engine.death_callbacks.append(
            lambda: asyncio.get_running_loop().call_later(_DEATH_EXIT_DELAY_S, app.state.request_exit))
        probe = asyncio.ensure_future(_lag_probe(metrics))
        grpc_server = None
        try:
            if args.grpc_port is not None:  # same loop, same engine (imported here: HTTP-only needs no grpc)
                from minivllm.entrypoints.grpc_server import start_grpc_server

                grpc_server = await start_grpc_server(app.state.server)
                app.state.grpc_port = grpc_server.port
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop()
            probe.cancel()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Mini-vLLM", lifespan=lifespan)
    app.state.server = ServerState(engine, metrics, args)
    app.state.response_store = ResponseStore()  # the Responses API's previous_response_id
    if app.state.server.clients.gates:
        metrics.registry.register(app.state.server.clients)
    app.state.request_exit = lambda: None  # run_server: stop serving (a test's in-process server: keep answering 503)
    _install_error_handlers(app)

    @app.get("/health", responses={200: {"model": HealthResponse},
                                   503: {"model": HealthResponse, "description": "the engine loop is not running"}})
    async def health() -> JSONResponse:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        err = APIError(503, dead_engine(engine.dead_error))
        return JSONResponse({"status": "error", **err.body()}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)  # the OpenAPI schema: text, not JSON
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(dashboard.router)
    app.include_router(seed_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(lora_routes.router)
    app.include_router(tokenize_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(embeddings_routes.router)
    redact_access_logs()  # a key may come as ?token= (the live view), and uvicorn logs query strings
    app.add_middleware(GuardMiddleware, keys=app.state.server.keys,
                       max_body_bytes=parse_size(args.max_body_size, "max_body_size"),
                       stall_timeout_s=engine.client_stall_timeout_s)
    if args.allowed_origins:  # CORS is off unless asked for: browsers then refuse other origins' scripts
        app.add_middleware(CORSMiddleware, allow_origins=args.origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    """Load the model and serve until interrupted (with --replicas: Ray Serve replicas behind this front)."""
    import uvicorn

    if server_args.replicas is not None:
        from minivllm.distributed.ray.launch import run_replicated_server

        return run_replicated_server(engine_args, server_args)

    engine = AsyncLLMEngine.from_engine_args(engine_args)
    app = build_app(engine, server_args)
    server = uvicorn.Server(uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                           log_level=server_args.log_level, timeout_graceful_shutdown=5,
                                           **uvicorn_limits(server_args)))
    app.state.request_exit = lambda: setattr(server, "should_exit", True)
    logger.info("serving %s on http://%s:%d", app.state.server.model_name, server_args.host, server_args.port)
    freeze_startup_heap()  # the model, the app and their imports live as long as this process
    server.run()
    if engine.dead_error is not None:
        raise SystemExit(f"minivllm serve: the engine loop died ({engine.dead_error!r}); exiting with status 1 so "
                         "a supervisor restarts the server")
