"""gRPC's door: a `Generate` over the in-flight bound is refused by grpc.aio itself, before
anything of ours runs for it (no interceptor's handler, no decoding, no servicer, no traceback).

grpc.aio counts the calls its handlers run and, past `maximum_concurrent_rpcs`, answers the next
one RESOURCE_EXHAUSTED ("Concurrent RPC limit exceeded!") from its own call loop: the cheapest
answer a Python gRPC server can give, so that a flood's refusals do not queue behind the admitted
requests' work. The limit is this frontend's share of the in-flight bound
(ServingConfig.frontend_inflight_limit) and CONTROL_CALLS more, for Abort, ClusterStatus,
health and reflection calls, which gRPC counts too; the request path's own bound still holds
exactly (it counts the HTTP API's requests as well), so the calls between the two are refused
by the servicer, as before. Clients cannot tell the two refusals apart but by their message:
both are RESOURCE_EXHAUSTED (HTTP's is 429).

The core's refusals never reach the servicer, so this interceptor tells the request path of
every `Generate` as it arrives (interceptors run before grpc.aio's check): a flood is seen as a
burst, and the admitted requests' work waits for it (disagg.router.arrivals).
"""

from __future__ import annotations

import grpc

from disagg.config import ServingConfig
from disagg.router.grpc_service import SERVICE_NAME

GENERATE = f"/{SERVICE_NAME}/Generate"
# Calls other than Generate that may run at once beyond the bound: a health Watch per load
# balancer, Abort, ClusterStatus, reflection. Past the bound plus these, gRPC refuses any call.
CONTROL_CALLS = 32


def concurrent_rpcs(config: ServingConfig) -> int:
    """grpc.aio's `maximum_concurrent_rpcs` for a frontend of `config`."""
    return config.frontend_inflight_limit() + CONTROL_CALLS


def frontend_server(path, config: ServingConfig, interceptors=()) -> grpc.aio.Server:
    """A grpc.aio server with this door in front of `path` (the frontend's RequestPath), and
    `interceptors` after it."""
    return grpc.aio.server(
        interceptors=[ArrivalsInterceptor(path), *interceptors], maximum_concurrent_rpcs=concurrent_rpcs(config)
    )


class ArrivalsInterceptor(grpc.aio.ServerInterceptor):
    """Tells the request path (its `arrived`) of every Generate, refused by gRPC or not."""

    def __init__(self, path):
        self.path = path

    async def intercept_service(self, continuation, details):
        if details.method == GENERATE:
            self.path.arrived()
        return await continuation(details)
