"""The Serving service on a gRPC server, with request decoding that never raises.

gRPC's own handlers decode each request before our code runs, and bytes that are not the
message answer UNKNOWN or INTERNAL with a logged traceback per call: a client that sends garbage
would get the wrong code and flood the log. Here a request that cannot be decoded arrives as an
`Undecodable`, and the servicer answers it INVALID_ARGUMENT like any other bad input.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from disagg.v1 import serving_pb2, serving_pb2_grpc

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Serving"].full_name


@dataclass(frozen=True)
class Undecodable:
    """What a request that is not its message decodes to; `reason` says why."""

    reason: str


def add_serving_service(servicer, server) -> None:
    handlers = _generated_handlers(servicer)
    tolerant = {
        name: handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        for name, handler in handlers.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, tolerant),))
    server.add_registered_method_handlers(SERVICE_NAME, tolerant)


def _generated_handlers(servicer) -> dict[str, grpc.RpcMethodHandler]:
    """The handlers the generated code would register (so names and types follow the proto)."""

    class Capture:
        handlers: dict = {}

        def add_generic_rpc_handlers(self, _):
            pass

        def add_registered_method_handlers(self, _, handlers):
            self.handlers = handlers

    capture = Capture()
    serving_pb2_grpc.add_ServingServicer_to_server(servicer, capture)
    return capture.handlers


def _tolerant(decode):
    def decode_or_undecodable(data: bytes):
        try:
            return decode(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, and anything else garbage causes
            return Undecodable(f"{type(exc).__name__}: {exc}")

    return decode_or_undecodable
