"""Exception classes and their one mapping to gRPC status codes (and from those to HTTP's).

Bad input is a `ValueError` subclass so that plain Python callers can catch it the usual way.
"""

from __future__ import annotations


class DisaggError(Exception):
    """Base class of every error this project raises on purpose."""

    grpc_code_name = "INTERNAL"


class InvalidRequestError(DisaggError, ValueError):
    """The caller sent something we will not run (names the offending field)."""

    grpc_code_name = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class ModelLoadError(DisaggError, ValueError):
    """A model path, shape name or weight file that cannot be loaded."""

    grpc_code_name = "INVALID_ARGUMENT"


class OverloadedError(DisaggError):
    """A bounded queue is full; the request was shed before any work was done."""

    grpc_code_name = "RESOURCE_EXHAUSTED"


class UnavailableError(DisaggError):
    """No healthy worker can take the request, or the server is shutting down."""

    grpc_code_name = "UNAVAILABLE"


class RegistryUnavailable(DisaggError):
    """Redis (the registry) cannot be reached or refused us; callers keep their last view and retry later."""

    grpc_code_name = "UNAVAILABLE"


class KVTransferError(DisaggError):
    """A KV-cache transfer failed or timed out; the blocks involved have been freed."""

    grpc_code_name = "UNAVAILABLE"


class RequestFailedError(DisaggError):
    """The request's own computation failed on a worker (its batch went on without it). It is not
    retried elsewhere: it would fail there too."""

    grpc_code_name = "INTERNAL"


class RemoteError(DisaggError):
    """A worker raised this while serving a router's call; carries the status code it maps to."""

    def __init__(self, message: str, grpc_code_name: str = "UNAVAILABLE", peer: str = ""):
        super().__init__(message)
        self.grpc_code_name = grpc_code_name
        self.peer = peer  # the instance that raised it


class WorkerLinkError(UnavailableError):
    """The router's link to a worker broke (the worker died or stopped reading); `peer` names it."""

    def __init__(self, message: str, peer: str = ""):
        super().__init__(message)
        self.peer = peer


def grpc_code_name(exc: BaseException) -> str:
    """The gRPC status code name (e.g. "INVALID_ARGUMENT") for any exception."""
    if isinstance(exc, DisaggError):
        return exc.grpc_code_name
    if isinstance(exc, ValueError):
        return "INVALID_ARGUMENT"
    if isinstance(exc, TimeoutError):
        return "DEADLINE_EXCEEDED"
    return "INTERNAL"


# The HTTP status of each gRPC status code name, so that the OpenAI-compatible HTTP API answers
# every failure as gRPC does (disagg.router.openai_errors); a code not listed is a 500.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,  # nginx's "client closed request": nobody reads it, but logs and metrics do
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


def http_status(code_name: str) -> int:
    """The HTTP status answering a gRPC status code name (e.g. 429 for "RESOURCE_EXHAUSTED")."""
    return HTTP_STATUS.get(code_name, 500)
