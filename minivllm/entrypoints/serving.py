"""What every route (HTTP and gRPC) shares: errors in OpenAI's shape, request preparation
(tokenize, validate, limits), submission with overload handling, and disconnect-aware waiting."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from minivllm.config import parse_size
from minivllm.engine.async_engine import (
    AsyncStream,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestTimeoutError,
)
from minivllm.engine.async_stream import failure_text
from minivllm.engine.input_processor import EngineRequest, Prompt, RequestSpec
from minivllm.engine.lora_registry import LoadedLoRA
from minivllm.engine.protocol import EngineClient
from minivllm.entrypoints.auth import KeyPolicy
from minivllm.entrypoints.clients import ClientRegistry, load_keys_file
from minivllm.entrypoints.metrics import ServerMetrics
from minivllm.entrypoints.server_args import ServerArgs
from minivllm.entrypoints.streaming import EngineStreamingResponse, sse
from minivllm.outputs import PositionLogprobs, RequestOutput
from minivllm.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)
_INLINE_TOKENIZE_CHARS = 4096  # longer prompts are tokenized on a worker thread


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    @property
    def type(self) -> str:
        """OpenAI's error type for the status code."""
        return _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def anthropic_body(self) -> dict[str, Any]:
        """The JSON body in Anthropic's shape, for the Messages API: {"type": "error", "error": {"type",
        "message"}}."""
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """As an HTTP response (in Anthropic's shape on its routes, /v1/messages...)."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PREFIX) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
                429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


def validation_message(e: Exception) -> tuple[str, str | None]:
    """A pydantic / FastAPI validation error → (message naming each bad field, first field)."""
    parts, param = [], None
    for err in e.errors():  # type: ignore[attr-defined]
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


def bad_request(e: ValueError) -> APIError:
    """A ValueError from validation → 400, naming the field when the message starts with it."""
    msg = str(e)
    head = msg.split(":", 1)[0].split(" ", 1)[0]
    param = head if head.isidentifier() and head != msg else None
    return APIError(400, msg, param)


def new_request_id(prefix: str) -> str:
    """A fresh engine request id, e.g. gen-3f2a…, for a call whose client named none."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _prompt_size(prompt: Prompt) -> int:
    """A prompt's size for choosing where to prepare it: characters of text, or token ids (each checked)."""
    inner: Any = prompt.get("prompt_token_ids", prompt.get("prompt", "")) if isinstance(prompt, dict) else prompt
    return len(inner) if isinstance(inner, str | list) else 64


def served_model_name(model_path: str, args: ServerArgs) -> str:
    """The model's name in the API: --served-model-name, else the model directory's name."""
    return args.served_model_name or os.path.basename(os.path.normpath(model_path))


class ServerState:
    """The engine, metrics and limits the routes use (one per app, on app.state.server)."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics, args: ServerArgs) -> None:
        self.engine = engine
        self.metrics = metrics
        self.args = args
        self.model_path = engine.model_path
        self.model_name = served_model_name(self.model_path, args)
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.max_num_seqs
        self.tokenizer = engine.tokenizer
        self.reasoning_parser = engine.reasoning_parser
        self.pooler = engine.pooler  # --runner pooling: the server embeds, and generation is off
        self.created = int(time.time())
        self.max_body_bytes = parse_size(args.max_body_size, "max_body_size")
        named = load_keys_file(args.api_keys_file) if args.api_keys_file else ()
        self.keys = KeyPolicy(args.api_key, args.admin_api_key, named, args.metrics_need_key)
        self.clients = ClientRegistry(named)  # per-key seats and queues, and what a key may ask for
        self.named_keys = bool(named)  # (without named keys the request path never calls into clients.py)
        self.auto_tool_parser = args.auto_tool_parser  # the parser of tool_choice auto replies (None: auto off)
        # A write the client does not take within this long (its buffers are full: it stopped reading) ends the
        # response; the engine side drops such a request's stream alike (AsyncLLMEngine.MAX_UNREAD).
        self.stall_timeout_s = engine.client_stall_timeout_s

    @property
    def loras(self) -> dict[str, LoadedLoRA]:
        """The LoRA adapters served, by name."""
        return self.engine.loras

    def check_model(self, model: str | None) -> LoadedLoRA | None:
        """The adapter a request's model names (None: the base model); 404 for a name this server does not
        serve."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            served = ", ".join([self.model_name, *self.loras])
            raise APIError(404, f"The model `{model}` does not exist; this server serves: {served}.", "model")
        return lora

    async def prepare(self, request_id: str, prompts: list[Prompt], params: SamplingParams, priority: int | str = 0,
                      default_max_tokens: int | None = None, ttft_slo_ms: float | None = None,
                      timeout_s: float | None = None, lora: LoadedLoRA | None = None,
                      request: Request | None = None, pooling: bool = False) -> list[EngineRequest]:
        """The requests of one call (ids request_id-0, -1, ...), from the route's fields: one RequestSpec under the
        servers' rules (vLLM's: an explicit max_tokens must fit the context with the prompt, a default one is
        clipped to what is left), tokenized and checked against every limit by the engine client's input
        processor; APIError(400) naming the problem. Large inputs are tokenized on a worker thread, off the loop.
        `pooling`: an embedding request (a generating server refuses it, and an embedding server every other)."""
        if pooling != (self.pooler is not None):
            raise APIError(400, "this server embeds (--runner pooling): generation is off; use /v1/embeddings"
                           if self.pooler is not None else
                           "this server generates: start it with --runner pooling to serve embeddings")
        seats = None
        if self.named_keys:
            try:
                priority, ttft_slo_ms = self.clients.clamp(priority, ttft_slo_ms)  # a named key may not jump queues
            except ValueError as e:
                raise bad_request(e) from None
            seats = self.clients.seats()
        spec = RequestSpec(params, priority, time.time(), True, default_max_tokens, ttft_slo_ms, timeout_s, lora,
                           seats)
        size = sum(map(_prompt_size, prompts))
        # A guided request compiles its grammar (ms; the first one also indexes the vocabulary): off the loop too,
        # and not at all when the queue is full (the 429 comes first).
        inline = size <= _INLINE_TOKENIZE_CHARS and params.guided_decoding is None
        try:
            if params.guided_decoding is not None:
                self.engine.check_room(len(prompts))
            if inline:
                return self.engine.process_requests(request_id, prompts, spec)
            prepared = await asyncio.to_thread(self.engine.process_requests, request_id, prompts, spec)
            # (a compile or a long tokenization cannot be interrupted, but a client gone meanwhile queues nothing)
            if request is not None and await request.is_disconnected():
                raise ClientDisconnected("the client left while its request was prepared")
            return prepared
        except QueueFullError as e:
            raise APIError(429, str(e), None, {"Retry-After": str(e.retry_after_s)}) from None
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None
        except ValueError as e:
            raise bad_request(e) from None

    async def submit(self, requests: list[EngineRequest]) -> list[AsyncStream]:
        """Queue requests together; 429 when the waiting queue is full, 503 when the engine is dead."""
        gate = self.clients.gate() if self.named_keys else None
        try:
            if gate is None:
                return await self.engine.submit(requests)
            gate.enter(len(requests))  # 429 past the key's seats and queue
            try:
                streams = await self.engine.submit(requests)
            except BaseException:
                gate.leave(len(requests))
                raise
            gate.track(streams)
            return streams
        except QueueFullError as e:
            raise APIError(429, str(e), None, {"Retry-After": str(e.retry_after_s)}) from None
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None
        except ValueError as e:
            raise bad_request(e) from None

    async def wait_finals(self, request: Request | None, streams: list[AsyncStream]) -> list[RequestOutput]:
        """The final output of every stream; a disconnect (of the HTTP request, if given), a cancellation
        or a failure aborts them all."""
        try:
            if request is None:
                return await final_outputs(streams)
            return await until_disconnect(request, final_outputs(streams))
        except (ClientDisconnected, asyncio.CancelledError):
            self.abort(streams)
            raise
        except Exception as e:
            self.abort(streams)
            raise engine_error(e) from None

    def stream_response(self, endpoint: str, t0: float, events: AsyncIterator[str], streams: list[AsyncStream],
                        done: str | None = sse("[DONE]"), error_event: Callable[[APIError], str] | None = None
                        ) -> EngineStreamingResponse:
        """SSE of `events`, then `done` (OpenAI's [DONE]; None for the APIs that end on an event of their own);
        an engine failure becomes an error event (`error_event`'s, else OpenAI's error shape). Counted and aborted
        whatever happens."""
        async def body() -> AsyncIterator[str]:
            status = "aborted"
            try:
                async for event in events:
                    yield event
                status = "success"
                if done is not None:
                    yield done
            except Exception as e:
                status = "server_error"
                err = engine_error(e)
                yield error_event(err) if error_event is not None else sse(json.dumps(err.body()))
            finally:
                self.count(endpoint, status, t0)

        return EngineStreamingResponse(body(), lambda: self.abort(streams), self.stall_timeout_s,
                                       media_type="text/event-stream")

    def abort(self, streams: Iterable[AsyncStream]) -> None:
        """Abort every stream that has not finished (no-op for finished ones)."""
        for s in streams:
            self.engine.abort_stream(s)

    def count(self, endpoint: str, status: str, t0: float) -> None:
        """Seed metrics: one request of an endpoint with its outcome, and its latency."""
        self.metrics.requests_total.labels(endpoint=endpoint, status=status).inc()
        self.metrics.request_latency.labels(endpoint=endpoint).observe(time.monotonic() - t0)


def engine_error(e: BaseException) -> APIError:
    """An engine-side failure of a request → 500 / 503."""
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e))
    if isinstance(e, RequestTimeoutError):  # the server was too busy to start it in time: try again later
        return APIError(503, str(e), "timeout", {"Retry-After": "1"})
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e))
    logger.error("request failed inside the server", exc_info=e)
    return internal_error(e)


def internal_error(e: BaseException) -> APIError:
    """A bug's 500: a foreign exception's type, not its text (which can hold the server's internals: keys, paths,
    other requests' ids; async_stream.failure_text); the log has the traceback."""
    return APIError(500, f"internal server error: {failure_text(e)}")


def dead_engine(error: BaseException | None) -> str:
    """What /health and the gRPC health check say of a dead engine loop (open routes: the type only)."""
    return f"engine loop is not running ({type(error).__name__ if error is not None else 'stopped'})"


async def final_output(stream: AsyncStream) -> RequestOutput:
    """The last output of a stream (FINAL_ONLY requests send exactly one)."""
    last = None
    async for out in stream:
        last = out
    assert last is not None
    return last


async def final_outputs(streams: list[AsyncStream]) -> list[RequestOutput]:
    """The last output of every stream; if one fails (or this is cancelled), stop waiting on the rest."""
    tasks = [asyncio.ensure_future(final_output(s)) for s in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await work, cancelling it (ClientDisconnected) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # e.g. server shutdown: not a client disconnect
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    return task.result()


def prompt_logprobs_json(out: RequestOutput, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt position (the first None), the prompt's token and
    the top k, token id → {logprob, rank, decoded_token}."""
    def position(tid: int, pos: PositionLogprobs | None) -> dict[str, dict[str, Any]] | None:
        if pos is None:
            return None
        keep = {tid: pos[tid], **{t: lp for t, lp in pos.items() if lp.rank <= k}}
        return {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in keep.items()}

    return [position(tid, pos) for tid, pos in zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=True)]
