"""The API key on the frontend's side services: gRPC health and reflection.

The serving service checks the key itself, per call (disagg.router.request_path.authorized).
Health and reflection are grpcio's own servicers, so an interceptor asks for the key in front of
them: with `api_key` set, a call without it (metadata `x-api-key`) is refused UNAUTHENTICATED
before it reaches them. Reflection lists the API; health tells a stranger that the server is
there and whether it serves. `health_without_key: true` leaves health open, for load balancers
whose probes send no key.
"""

from __future__ import annotations

import hmac

import grpc
from grpc_health.v1 import health

API_KEY_METADATA = "x-api-key"
_HEALTH = f"/{health.SERVICE_NAME}/"
_REFLECTION_PREFIX = "/grpc.reflection."  # v1alpha and v1


def given_key(metadata) -> str:
    """The key a call sent in its metadata ('' when none)."""
    return next((value for key, value in metadata or () if key == API_KEY_METADATA), "")


def key_matches(api_key: str | None, given: str) -> bool:
    """Whether `given` is the deployment's key (anything is, when none is set). In constant
    time: how long a refusal takes says nothing about how much of the key matched."""
    return not api_key or hmac.compare_digest(given.encode(), api_key.encode())


def guarded(method: str, health_without_key: bool) -> bool:
    """Whether this interceptor checks the key of a call to `method` (the serving service
    checks its own)."""
    if method.startswith(_HEALTH):
        return not health_without_key
    return method.startswith(_REFLECTION_PREFIX)


class _KeyGuard(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str, health_without_key: bool):
        self.api_key = api_key
        self.health_without_key = health_without_key

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not guarded(details.method, self.health_without_key):
            return handler
        if key_matches(self.api_key, given_key(details.invocation_metadata)):
            return handler
        return _refusing(handler)


def key_guard_interceptors(config) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors of a frontend with `config` (a ServingConfig): none without a key."""
    return [_KeyGuard(config.api_key, config.health_without_key)] if config.api_key else []


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (metadata x-api-key)")

    async def refuse_stream(request_or_iterator, context):
        await refuse(request_or_iterator, context)
        yield  # an async generator, as a streaming handler must be

    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **codec)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **codec)
