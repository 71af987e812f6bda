"""The gRPC front end (SPEC §5): InferenceService on grpc.aio, served next to the HTTP server in the same
process, on the same event loop and the same AsyncLLMEngine, with the standard grpc.health.v1 service
(reflecting the engine loop's real state) and server reflection.

Every call goes through the HTTP routes' ServerState (tokenize and validate, limits, submission,
metrics), so both transports accept and refuse exactly the same requests: a 400 becomes
INVALID_ARGUMENT, a full queue RESOURCE_EXHAUSTED (with a retry-after trailer), a dead engine
UNAVAILABLE. grpc.aio cancels a handler when its client cancels or its deadline passes; the handlers
abort their engine requests on the way out, so the KV blocks are freed before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from minivllm.config import parse_size
from minivllm.engine.async_engine import EngineDeadError, RequestFailedError
from minivllm.engine.input_processor import check_timeout
from minivllm.entrypoints.clients import current_client
from minivllm.entrypoints.embeddings_routes import embed
from minivllm.entrypoints.grpc_interceptors import SERVICE_NAME, ApiKeyInterceptor, RequestDecodingInterceptor
from minivllm.entrypoints.proto import inference_pb2 as pb
from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc
from minivllm.entrypoints.protocol import SamplingFields, beam_search_fields
from minivllm.entrypoints.serving import (
    APIError,
    ServerState,
    bad_request,
    dead_engine,
    engine_error,
    internal_error,
    new_request_id,
    validation_message,
)
from minivllm.entrypoints.tokenize_routes import tokenize_prompt
from minivllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

METHODS = ("Generate", "BatchGenerate", "GenerateStream", "Tokenize", "Embed")
ENDPOINTS = tuple(f"/{SERVICE_NAME}/{m}" for m in METHODS)  # the metrics' endpoint label: the gRPC method path
_DEFAULT_MAX_TOKENS = 128  # as /generate
_HEALTH_POLL_S = 0.25  # how often Watch subscribers learn of a change (Check is exact)
_SAMPLING_FIELDS = frozenset(SamplingFields.model_fields) - {"priority", "ttft_slo_ms", "timeout"}
_STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                 413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 503: grpc.StatusCode.UNAVAILABLE}


def status_code(http_status: int) -> grpc.StatusCode:
    """The gRPC status of an APIError's HTTP status."""
    return _STATUS_CODES.get(http_status, grpc.StatusCode.INTERNAL)


def sampling_params(msg: pb.GenerateRequest | pb.BatchGenerateRequest, kind: RequestOutputKind) -> SamplingParams:
    """The request's sampling fields → SamplingParams, validated as the HTTP routes validate them (APIError
    400 naming the field). An unset optional field keeps SamplingParams' default."""
    fields: dict[str, Any] = {fd.name: v if isinstance(v, int | float | str) else list(v)
                              for fd, v in msg.ListFields() if fd.name in _SAMPLING_FIELDS}
    if msg.guided_json_object:
        fields["structured_outputs"] = {"json_object": True}
    extra: dict[str, Any] = {"logprobs": _opt(msg, "logprobs")}
    if isinstance(msg, pb.GenerateRequest):
        extra["prompt_logprobs"] = _opt(msg, "prompt_logprobs")
        if msg.HasField("beam_width"):
            extra.update(beam_search_fields(msg.beam_width, _opt(msg, "length_penalty"), _opt(msg, "early_stopping")))
    try:
        sampling = SamplingFields.model_validate(fields)
        return sampling.sampling_params(msg.max_new_tokens if msg.HasField("max_new_tokens") else None, kind,
                                        **extra)
    except ValidationError as e:
        raise APIError(400, *validation_message(e)) from None
    except ValueError as e:
        raise bad_request(e) from None


def _logprobs(c: CompletionOutput, k: int) -> list[pb.TokenLogprob]:
    """The chosen token's log-probability at each position, with the k most likely alternatives."""
    out = []
    for tid, pos in zip(c.token_ids, c.logprobs or [], strict=False):
        chosen = pos[tid]
        out.append(pb.TokenLogprob(token_id=tid, token=chosen.decoded_token, logprob=chosen.logprob, rank=chosen.rank,
                                   top_logprobs=_top(pos, k)))
    return out


def _top(pos: PositionLogprobs, k: int) -> list[pb.TopLogprob]:
    ranked = sorted(pos.items(), key=lambda kv: kv[1].rank)[:k]
    return [pb.TopLogprob(token_id=t, token=lp.decoded_token, logprob=lp.logprob, rank=lp.rank) for t, lp in ranked]


def _usage(prompt_tokens: int, completion_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens)


def _response(out: RequestOutput, t0: float, logprobs: int | None, beam_search: bool = False) -> pb.GenerateResponse:
    c = out.outputs[0]
    beams = [pb.Beam(text=b.text, token_ids=b.token_ids, cumulative_logprob=b.cumulative_logprob or 0.0,
                     finish_reason=b.finish_reason or "") for b in out.outputs] if beam_search else []
    prompt_lps = [pb.TokenLogprob(token_id=tid, token=pos[tid].decoded_token, logprob=pos[tid].logprob,
                                  rank=pos[tid].rank, top_logprobs=_top(pos, len(pos)))
                  for tid, pos in zip(out.prompt_token_ids[1:], (out.prompt_logprobs or [None])[1:], strict=False)
                  if pos is not None]
    return pb.GenerateResponse(
        generated_text=c.text, tokens_generated=len(c.token_ids), latency_ms=1000.0 * (time.monotonic() - t0),
        finish_reason=c.finish_reason or "", usage=_usage(len(out.prompt_token_ids), len(c.token_ids)),
        token_ids=c.token_ids, logprobs=_logprobs(c, logprobs) if logprobs is not None else (),
        request_id=out.request_id, beams=beams, prompt_logprobs=prompt_lps)


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """InferenceService on the server's shared engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def _call(self, method: str, context: grpc.aio.ServicerContext, work: Callable[[float], Awaitable[T]]
                    ) -> T:
        """Run a unary call: count its outcome in the metrics and turn APIErrors into gRPC statuses."""
        t0 = time.monotonic()
        status = "aborted"  # stays so when the client cancels or its deadline passes
        try:
            result = await work(t0)
            status = "success"
            return result
        except APIError as e:
            status = "client_error" if e.status < 500 else "server_error"
            await _abort(context, e)
            raise AssertionError("unreachable: context.abort raises") from None
        except Exception as e:  # a bug: INTERNAL, as HTTP answers 500
            status = "server_error"
            logger.exception("unhandled error in %s", method)
            await _abort(context, internal_error(e))
            raise AssertionError("unreachable: context.abort raises") from None
        finally:
            self.state.count(f"/{SERVICE_NAME}/{method}", status, t0)

    def _identify(self, context: grpc.aio.ServicerContext | None) -> None:
        if context is not None and self.state.named_keys:  # a named key's client: its seats and bounds (clients.py)
            auth = dict(context.invocation_metadata() or ()).get("authorization", "")
            token = auth[len("Bearer "):] if isinstance(auth, str) and auth.startswith("Bearer ") else ""
            current_client.set(self.state.keys.match([token], self.state.keys.accepted("/generate"))[1])

    async def _prepare(self, msg: pb.GenerateRequest | pb.BatchGenerateRequest, kind: RequestOutputKind,
                       prompts: list[Any], request_id: str = "", context: grpc.aio.ServicerContext | None = None
                       ) -> list:
        self._identify(context)
        params = sampling_params(msg, kind)
        if len(request_id) > 256 or not request_id.isprintable():  # it reaches logs and metrics' exemplars
            raise APIError(400, "request_id: at most 256 printable characters", "request_id")
        rid = request_id or new_request_id("grpc")
        # proto3 cannot tell an unset int from 0, so a class name comes in a field of its own.
        if msg.priority_class and msg.priority:
            raise APIError(400, "priority_class: give priority or priority_class, not both", "priority_class")
        # The call's own deadline bounds how long it may wait to start, as the `timeout` field does (the sooner).
        timeout = _opt(msg, "timeout")
        if timeout is not None:  # checked before the deadline may replace it, as HTTP checks it (inf: refused)
            try:
                check_timeout(timeout)
            except ValueError as e:
                raise bad_request(e) from None
        left = context.time_remaining() if context is not None else None
        if left is not None and (timeout is None or 0 < left < timeout):
            timeout = max(left, 1e-3)
        return await self.state.prepare(rid, prompts, params, msg.priority_class or msg.priority,
                                        default_max_tokens=_DEFAULT_MAX_TOKENS, ttft_slo_ms=_opt(msg, "ttft_slo_ms"),
                                        timeout_s=timeout)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        """One prompt, answered once finished."""
        async def work(t0: float) -> pb.GenerateResponse:
            reqs = await self._prepare(request, RequestOutputKind.FINAL_ONLY, [_prompt(request)], request.request_id,
                                       context)
            (out,) = await self.state.wait_finals(None, await self.state.submit(reqs))
            return _response(out, t0, _opt(request, "logprobs"), request.HasField("beam_width"))

        return await self._call("Generate", context, work)

    async def BatchGenerate(self, request: pb.BatchGenerateRequest, context: grpc.aio.ServicerContext
                            ) -> pb.BatchGenerateResponse:
        """Several prompts submitted together, so the engine runs them as one batch."""
        async def work(t0: float) -> pb.BatchGenerateResponse:
            if not request.prompts:
                raise APIError(400, "prompts: give at least one prompt", "prompts")
            reqs = await self._prepare(request, RequestOutputKind.FINAL_ONLY, list(request.prompts), "", context)
            outs = await self.state.wait_finals(None, await self.state.submit(reqs))
            results = [_response(o, t0, _opt(request, "logprobs")) for o in outs]
            latency = 1000.0 * (time.monotonic() - t0)
            for r in results:
                r.latency_ms = latency
            return pb.BatchGenerateResponse(
                generated_texts=[r.generated_text for r in results],
                tokens_generated=[r.tokens_generated for r in results], latency_ms=latency,
                finish_reasons=[r.finish_reason for r in results],
                usage=_usage(sum(r.usage.prompt_tokens for r in results), sum(r.tokens_generated for r in results)),
                results=results)

        return await self._call("BatchGenerate", context, work)

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """One message per engine step with new tokens; the last carries finish_reason, usage and latency."""
        t0 = time.monotonic()
        status, stream = "aborted", None  # stays "aborted" when the client cancels or its deadline passes
        try:
            reqs = await self._prepare(request, RequestOutputKind.DELTA, [_prompt(request)], request.request_id,
                                       context)
            (stream,) = await self.state.submit(reqs)
            k, n = _opt(request, "logprobs"), 0
            async for out in stream:
                c = out.outputs[0]
                n += len(c.token_ids)
                msg = pb.GenerateStreamResponse(text=c.text, token_ids=c.token_ids, tokens_generated=n,
                                                request_id=out.request_id,
                                                logprobs=_logprobs(c, k) if k is not None else ())
                if out.finished:
                    msg.finish_reason = c.finish_reason or ""
                    msg.usage.CopyFrom(_usage(len(out.prompt_token_ids), n))
                    msg.latency_ms = 1000.0 * (time.monotonic() - t0)
                if c.token_ids or out.finished:
                    yield msg
            status = "success"
        except APIError as e:  # bad input, a full queue, a dead engine
            status = "client_error" if e.status < 500 else "server_error"
            await _abort(context, e)
        except Exception as e:  # the engine failed this request (or a bug): the stream ends with its status
            status = "server_error"
            if not isinstance(e, RequestFailedError | EngineDeadError):
                logger.exception("unhandled error in GenerateStream")
            await _abort(context, engine_error(e))
        finally:  # also on cancellation and deadline: free the request's KV blocks now
            if stream is not None:
                self.state.abort([stream])
            self.state.count(f"/{SERVICE_NAME}/GenerateStream", status, t0)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        """SERVING while the engine loop runs, with its gauges; NOT_SERVING and why otherwise."""
        engine = self.state.engine
        snap = engine.snapshot
        if engine.is_running:
            status, message = pb.SERVING, ""
        else:
            status, message = pb.NOT_SERVING, dead_engine(engine.dead_error)
        return pb.HealthResponse(status=status, message=message, num_requests_running=snap.num_running,
                                 num_requests_waiting=snap.num_waiting, kv_cache_usage=snap.kv_cache_usage)


    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        """A prompt's token ids, as POST /tokenize."""
        async def work(t0: float) -> pb.TokenizeResponse:
            ids = await tokenize_prompt(self.state, request.prompt, _opt(request, "add_special_tokens"))
            strs = self.state.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else []
            return pb.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.state.max_model_len,
                                       token_strs=strs)

        return await self._call("Tokenize", context, work)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        """One embedding per input, as POST /v1/embeddings (a server started with --runner pooling)."""
        async def work(t0: float) -> pb.EmbedResponse:
            if not request.inputs:
                raise APIError(400, "inputs: give at least one input", "inputs")
            self._identify(context)
            vectors = await embed(self.state, list(request.inputs), _opt(request, "dimensions"))
            return pb.EmbedResponse(embeddings=[pb.Embedding(values=v, prompt_tokens=n) for v, n in vectors],
                                    prompt_tokens=sum(n for _, n in vectors))

        return await self._call("Embed", context, work)


def _prompt(msg: pb.GenerateRequest) -> str | list[int]:
    if msg.prompt_token_ids and msg.prompt:
        raise APIError(400, "prompt: give prompt or prompt_token_ids, not both", "prompt")
    return list(msg.prompt_token_ids) if msg.prompt_token_ids else msg.prompt


def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


async def _abort(context: grpc.aio.ServicerContext, err: APIError) -> None:
    """End the call with the error's status and message (raises)."""
    if "Retry-After" in err.headers:
        context.set_trailing_metadata((("retry-after", err.headers["Retry-After"]),))
    # The engine's messages name SamplingParams' max_tokens; the proto's field is max_new_tokens.
    timed_out = err.param == "timeout" and err.status == 503  # dropped unstarted: its deadline passed
    code = grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else status_code(err.status)
    await context.abort(code, re.sub(r"\bmax_tokens\b", "max_new_tokens", err.message))


class EngineHealthServicer(health.aio.HealthServicer):
    """grpc.health.v1.Health reporting the engine loop's state for the server ("") and InferenceService:
    Check reads it at the call; Watch subscribers hear of a change within _HEALTH_POLL_S."""

    def __init__(self, state: ServerState) -> None:
        super().__init__()
        self.state = state
        self._serving: bool | None = None

    async def refresh(self) -> None:
        """Publish the engine loop's current state if it changed."""
        serving = self.state.engine.is_running
        if serving != self._serving:
            self._serving = serving
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for service in (health.OVERALL_HEALTH, SERVICE_NAME):
                await self.set(service, status)

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()
        return await super().Check(request, context)

    async def watch_engine(self) -> None:
        """Keep the published state current (runs until cancelled)."""
        while True:
            await self.refresh()
            await asyncio.sleep(_HEALTH_POLL_S)


class GrpcServer:
    """The running gRPC server and its health servicer."""

    def __init__(self, server: grpc.aio.Server, port: int, health: EngineHealthServicer,
                 watcher: asyncio.Task[None]) -> None:
        self.server, self.port, self.health, self._watcher = server, port, health, watcher

    async def stop(self, grace_s: float = 2.0) -> None:
        """Report NOT_SERVING, stop accepting calls; calls still running after grace_s are cancelled (and so
        aborted)."""
        self._watcher.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def start_grpc_server(state: ServerState) -> GrpcServer:
    """Serve InferenceService, grpc.health.v1 and reflection on --host:--grpc-port, on the running event loop,
    with the HTTP server's API key and request size limit."""
    args = state.args
    assert args.grpc_port is not None
    options = [("grpc.so_reuseport", 0),  # gRPC's default on Linux would let a second server share the port
               ("grpc.max_receive_message_length", parse_size(args.max_body_size, "max_body_size"))]
    keys = [k for k, _ in state.keys.accepted("/generate")]
    interceptors = [ApiKeyInterceptor(keys)] if keys else []
    interceptors.append(RequestDecodingInterceptor())  # after the key check: a caller without one parses nothing
    server = grpc.aio.server(options=options, interceptors=interceptors)
    pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(state), server)
    health_servicer = EngineHealthServicer(state)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"[{args.host}]:{args.grpc_port}" if ":" in args.host else f"{args.host}:{args.grpc_port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"cannot serve gRPC on {address}: {e}") from None
    if bound == 0:
        raise RuntimeError(f"cannot serve gRPC on {address}: the port is in use or the address is invalid")
    await server.start()
    await health_servicer.refresh()
    watcher = asyncio.ensure_future(health_servicer.watch_engine())
    logger.info("serving gRPC (%s, grpc.health.v1, reflection) on %s:%d", SERVICE_NAME, args.host, bound)
    return GrpcServer(server, bound, health_servicer, watcher)
