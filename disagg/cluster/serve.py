"""`disagg serve`: Redis (local unless given), Ray (local unless given), the worker pools and the
gRPC frontend, started in that order and stopped in reverse on Ctrl-C or SIGTERM.

Shutdown is graceful: new requests get UNAVAILABLE, those in flight get a grace period to
finish, then every worker, placement group, Ray and the local redis-server are stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from disagg.cluster.launcher import NAMESPACE, PoolLauncher
from disagg.cluster.redis_server import LocalRedis
from disagg.config import ServingConfig
from disagg.engine.loader import load_model_source
from disagg.engine.tokenizer import Tokenizer
from disagg.errors import UnavailableError
from disagg.metrics import ServingMetrics
from disagg.registry import Registry
from disagg.router.directory import InstanceDirectory
from disagg.router.frontend import ServingServicer
from disagg.router.orchestrator import Orchestrator
from disagg.router.policy import LeastOutstandingWork
from disagg.router.streams import DecodeStreams
from disagg.router.validation import ModelLimits
from disagg.v1 import serving_pb2, serving_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Serving"].full_name
DRAIN_GRACE_S = 10.0


def serve(config: ServingConfig, ready_file: str | None = None) -> int:
    """Run until SIGINT/SIGTERM; returns the exit code."""
    with contextlib.ExitStack() as stack:
        redis_url = config.redis_url or stack.enter_context(LocalRedis()).url
        _start_ray(config)
        stack.callback(ray.shutdown)
        model = load_model_source(config.engine.model, cache_dir=config.engine.cache_dir, tokenizer=config.engine.tokenizer)
        print(f"disagg: starting {config.mode} pools for {config.engine.model}", flush=True)
        launcher = PoolLauncher(config, redis_url)
        # A local Ray takes its placement groups down with it; a shared cluster needs them removed.
        stack.callback(launcher.shutdown, remove_groups=config.ray_address is not None)
        launcher.launch()
        asyncio.run(_run_frontend(config, redis_url, model, ready_file))
    print("disagg: stopped", flush=True)
    return 0


def _start_ray(config: ServingConfig) -> None:
    if ray.is_initialized():
        return
    if config.ray_address:
        ray.init(address=config.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)
    else:
        ray.init(namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING, num_cpus=max(2, os.cpu_count() or 2))


async def _run_frontend(config: ServingConfig, redis_url: str, model, ready_file: str | None) -> None:
    registry = Registry(redis_url)
    directory = InstanceDirectory(registry, NAMESPACE)
    await _wait_for_instances(config, directory)
    tokenizer = Tokenizer(model.tokenizer) if model.tokenizer is not None else None
    limits = await _model_limits(config, model, directory)
    geometry = {"num_layers": model.config.num_hidden_layers, "num_kv_heads": model.config.num_key_value_heads}
    streams = DecodeStreams()
    orchestrator = Orchestrator(config, directory, LeastOutstandingWork(), streams, config.engine.block_size, geometry)
    metrics = ServingMetrics()
    servicer = ServingServicer(orchestrator, directory, tokenizer, limits, metrics, registry, config.engine.model)
    server, port = await _start_grpc(config, servicer)
    metrics_server = metrics.start_http_server(config.metrics_port, config.host) if config.metrics_port is not None else None
    print(f"disagg: serving {config.engine.model} ({config.mode}) on {config.host}:{port}" + (f", metrics on {metrics_server.url}" if metrics_server else ""), flush=True)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(f"{config.host}:{port}\n")
    await _until_signalled()
    print("disagg: shutting down (in-flight requests get %.0fs)" % DRAIN_GRACE_S, flush=True)
    await servicer.drain(DRAIN_GRACE_S)
    await server.stop(grace=1.0)
    await streams.stop()
    await directory.stop()
    if metrics_server:
        metrics_server.stop()
    registry.close()


async def _wait_for_instances(config: ServingConfig, directory: InstanceDirectory, timeout_s: float = 60.0) -> None:
    """Every launched instance has heartbeated at least once."""
    roles = ["colocated"] if config.mode == "colocated" else ["prefill", "decode"]
    expected = {"colocated": config.colocated, "prefill": config.prefill, "decode": config.decode}
    deadline = time.monotonic() + timeout_s
    await directory.start()
    while any(len(directory.healthy(r)) < expected[r].num_instances for r in roles):
        if time.monotonic() > deadline:
            raise UnavailableError("workers did not register in Redis in time")
        await asyncio.sleep(0.1)
        await directory.refresh()


async def _model_limits(config: ServingConfig, model, directory: InstanceDirectory) -> ModelLimits:
    role = "colocated" if config.mode == "colocated" else "decode"
    blocks = min(i.view.load.num_total_blocks for i in directory.healthy(role))
    max_len = min(config.engine.max_model_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
    return ModelLimits(model.config.vocab_size, max_len, blocks, config.engine.block_size)


async def _start_grpc(config: ServingConfig, servicer: ServingServicer):
    server = grpc.aio.server()
    serving_pb2_grpc.add_ServingServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if config.tls_cert_file:
        with open(config.tls_key_file, "rb") as k, open(config.tls_cert_file, "rb") as c:
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(k.read(), c.read())]))
    else:
        port = server.add_insecure_port(address)
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)


def main_serve(config_path: str | None, overrides: dict, ready_file: str | None = None) -> int:
    config = ServingConfig.from_yaml(config_path) if config_path else ServingConfig()
    if overrides:
        config = ServingConfig.from_dict({**_as_dict(config_path), **overrides})
    return serve(config, ready_file)


def _as_dict(config_path: str | None) -> dict:
    if not config_path:
        return {}
    import yaml

    with open(config_path) as f:
        return yaml.safe_load(f) or {}


if __name__ == "__main__":
    sys.exit(main_serve(None, {}))
