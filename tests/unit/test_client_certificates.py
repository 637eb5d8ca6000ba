"""Client certificates (tls_client_ca_file): a frontend's gRPC and HTTP ports and /metrics take
only clients that present a certificate the CA signed; TLS alone lets in anyone. Real servers on
127.0.0.1 (grpc.aio with the frontend's credentials, aiohttp with its SSL context)."""

from __future__ import annotations

import asyncio
import ssl
import urllib.request

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from disagg.client import tls_credentials
from disagg.config import ServingConfig
from disagg.metrics import ServingMetrics
from disagg.router.http_frontend import _ssl_context
from disagg.server import _server_credentials
from tests.support import self_signed_certificate


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """(server cert, server key, client cert, client key); each certificate is its own CA."""
    server = self_signed_certificate(tmp_path_factory.mktemp("server"))
    client = self_signed_certificate(tmp_path_factory.mktemp("client"))
    return (*server, *client)


def config(certs, client_ca: bool) -> ServingConfig:
    cert, key, client_cert, _ = certs
    return ServingConfig(tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=client_cert if client_ca else None)


async def health_check(cfg: ServingConfig, credentials) -> str:
    """A health check over TLS to a grpc.aio server with the frontend's credentials for `cfg`."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", _server_credentials(cfg))
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    finally:
        await server.stop(None)


def test_grpc_refuses_a_client_without_a_certificate_the_ca_signed(certs):
    cfg = config(certs, client_ca=True)
    cert, key, client_cert, client_key = certs
    assert asyncio.run(health_check(cfg, tls_credentials(cert))) == "UNAVAILABLE"
    stranger = (cert, key)  # a certificate, but not one the client CA signed
    assert asyncio.run(health_check(cfg, tls_credentials(cert, stranger))) == "UNAVAILABLE"
    assert asyncio.run(health_check(cfg, tls_credentials(cert, (client_cert, client_key)))) == "SERVING"


def test_grpc_with_tls_alone_takes_any_client(certs):
    assert asyncio.run(health_check(config(certs, client_ca=False), tls_credentials(certs[0]))) == "SERVING"


async def http_get(cfg: ServingConfig, client: ssl.SSLContext) -> str:
    app = web.Application()
    app.router.add_get("/", _ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=_ssl_context(cfg))
    await site.start()
    port = runner.addresses[0][1]
    try:
        return await asyncio.to_thread(_get, f"https://127.0.0.1:{port}/", client)
    finally:
        await runner.cleanup()


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def _get(url: str, client: ssl.SSLContext) -> str:
    try:
        with urllib.request.urlopen(url, context=client, timeout=5) as response:
            return response.read().decode()
    except (OSError, ssl.SSLError) as exc:  # the handshake refused (URLError is an OSError)
        return type(exc).__name__


def client_context(certs, present: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=certs[0])
    if present:
        context.load_cert_chain(certs[2], certs[3])
    return context


def test_http_refuses_a_client_without_a_certificate(certs):
    cfg = config(certs, client_ca=True)
    assert asyncio.run(http_get(cfg, client_context(certs, present=False))) != "ok"
    assert asyncio.run(http_get(cfg, client_context(certs, present=True))) == "ok"


def test_metrics_refuse_a_scraper_without_a_certificate(certs):
    cert, key, client_cert, _ = certs
    served = ServingMetrics().start_http_server(0, tls=(cert, key), client_ca=client_cert)
    url = f"https://127.0.0.1:{served.port}/metrics"
    try:
        assert "disagg" not in _get(url, client_context(certs, present=False))
        assert "disagg" in _get(url, client_context(certs, present=True))
    finally:
        served.stop()
