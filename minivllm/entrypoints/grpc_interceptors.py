"""gRPC server interceptors: the API key check (--api-key) and InferenceService's own request decoding (a request
that does not parse is INVALID_ARGUMENT naming why, not grpc's UNKNOWN)."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from minivllm.entrypoints.proto import inference_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name  # "minivllm.v1.InferenceService"

_WIRE_TYPES = {0: "a varint", 1: "a 64-bit value", 2: "length-delimited bytes", 3: "a group", 4: "a group end",
               5: "a 32-bit value"}


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):
    """InferenceService requests are parsed here rather than by grpc (which answers a request that does not parse
    with UNKNOWN): bytes that are not the method's message, a string field that is not UTF-8, or a declared field
    sent with another wire type (an int as bytes, ...) end the call with INVALID_ARGUMENT naming the problem.
    Fields this server does not know are ignored, as protobuf intends (a newer client's)."""

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or not details.method.startswith(
                f"/{SERVICE_NAME}/"):
            return handler
        parse = handler.request_deserializer

        async def decode(data: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                msg = parse(data)
            except DecodeError as e:
                name = details.method.rsplit("/", 1)[-1]
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request is not a valid message for {name}: {e}")
            fields = msg.DESCRIPTOR.fields_by_number
            for unknown in UnknownFieldSet(msg):
                if unknown.field_number in fields:
                    fd = fields[unknown.field_number]
                    wire = _WIRE_TYPES.get(unknown.wire_type, str(unknown.wire_type))
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"{fd.name}: field {fd.number} was sent as {wire}, which does not match "
                                        "its type in the proto (a wrong type)")
            return msg

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await handler.unary_unary(await decode(request, context), context)

        async def streaming(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            inner = handler.unary_stream(await decode(request, context), context)
            try:
                async for item in inner:
                    yield item
            finally:  # a cancelled call (client gone, deadline) closes the handler now: it frees its KV blocks
                await inner.aclose()

        kw = {"request_deserializer": None, "response_serializer": handler.response_serializer}
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(streaming, **kw)
        return grpc.unary_unary_rpc_method_handler(unary, **kw)


# Calls that need no API key, as /health and /metrics over HTTP: health checks and reflection.
_OPEN_METHODS = (f"/{SERVICE_NAME}/Health", "/grpc.health.v1.Health/", "/grpc.reflection.")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """--api-key (and the named keys of --api-keys-file) for gRPC: generation calls need metadata
    `authorization: Bearer <key>` (UNAUTHENTICATED otherwise)."""

    def __init__(self, keys: list[str]) -> None:
        self._expected = [f"Bearer {k}".encode() for k in keys]

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_METHODS):
            return handler
        auth = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        given = auth.encode() if isinstance(auth, str) else auth
        if sum(hmac.compare_digest(given, e) for e in self._expected):  # (every key compared)
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that ends the call with UNAUTHENTICATED."""
    message = "invalid or missing API key: send metadata 'authorization: Bearer <key>'"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as the streaming handler it replaces

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)
