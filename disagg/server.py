"""`disagg serve`: Ray (local unless given), Redis (local unless given), the worker pools and the
frontends (gRPC, then the OpenAI-compatible HTTP API on the same event loop), started in that
order and stopped in reverse on Ctrl-C or SIGTERM.

On a Ray cluster of several nodes the workers listen on their nodes' IPs and a local Redis on
this node's, so that every node reaches them (disagg.hosts.addressing).

Shutdown is graceful: new requests get UNAVAILABLE (HTTP 503), those in flight get a grace period to
finish, then every worker, placement group, Ray and the local redis-server are stopped.

The pools belong to the deployment's controller (disagg.controller), a detached actor that Ray
restarts, which also runs relaunch supervision and re-planning: what must run once. Where the
deployment outlives this process (`disagg serve`), every frontend is a detached Ray actor
(FrontendReplica), frontend 0 too, and this process only starts them and waits; in a test's or a
benchmark's Server frontend 0 runs in this process, and with `frontends: N` the other N - 1 are
actors. Each is the same frontend over the same instances, from the same registry: their
placements see each other's load through the workers' reports. Ray restarts a killed one; the workers abort its requests when its
links close, freeing their blocks. Every frontend drains and rebalances its own streams and hands
its arrivals to the re-planner through Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path

import grpc
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from disagg.auth import new_key
from disagg.hosts.addressing import (
    LOOPBACK,
    WILDCARD_HOSTS,
    check_redis_reachable,
    num_alive_nodes,
    resolve_host,
    worker_host,
)
from disagg.hosts.cpu_binding import CpuPlan, bind_all_threads, plan_cpus, restore_threads
from disagg.cluster.launcher import NAMESPACE, wait_for_pool_nodes
from disagg.cluster.local_ray import LocalRayHead, free_port
from disagg.cluster.redis_server import LocalRedis
from disagg.cluster.deployment_state import DeploymentState, forget_state
from disagg.controller.client import ControllerClient, InProcessController
from disagg.controller.controller import find_controller, running_deployments
from disagg.deployments import frontend_addresses, join_ray, running_state
from disagg.config import API_KEY_ENV, ServingConfig, env, merge_settings, read_yaml_settings
from disagg.engine.memory_fit import kv_element_bytes
from disagg.engine.model_card import ModelCard
from disagg.engine.tokenizer import Tokenizer
from disagg.errors import RegistryUnavailable, UnavailableError
from disagg.metrics import ServingMetrics
from disagg.prefix_index import PrefixIndex
from disagg.registry import Registry
from disagg.router.directory import InstanceDirectory, directory_for
from disagg.router.kv_tier_status import flat_kv_tiers
from disagg.router.live_moves import LiveMoves
from disagg.router.frontend import ServingServicer
from disagg.router.grpc_door import frontend_server
from disagg.router.health import HealthVerdict
from disagg.router.grpc_service import SERVICE_NAME, add_serving_service
from disagg.router.key_guard import key_guard_interceptors
from disagg.router.http_frontend import HttpFrontend
from disagg.router.orchestrator import Orchestrator
from disagg.router.peer_fetch import PeerFetch
from disagg.placement.factory import placement_policy
from disagg.router.records import RequestRecords
from disagg.router.shared_arrivals import ArrivalFeed, VerdictFeed
from disagg.router.replanning import ReplanView, replans
from disagg.router.request_path import RequestPath
from disagg.router.streams import DecodeStreams
from disagg.router.validation import ModelLimits
from disagg.router.calibration import calibrate
from disagg.router.warm_up import warm_up
from disagg.supervision import supervised_task

logger = logging.getLogger(__name__)


class Server:
    """A running service: usable in-process (tests, benchmarks) or from `disagg serve`.

    Uses the Ray already initialised in this process if there is one, else starts a local Ray;
    starts a local redis-server when the config names none. The gRPC frontend and the HTTP API
    run on one event loop of their own on a background thread (or, with `outlive`, in a
    FrontendReplica actor: then `address`, `http_address` and `metrics_url` are that actor's).
    """

    def __init__(
        self, config: ServingConfig, *, index: int = 0, link_key: bytes | None = None, controller=None,
        outlive: bool = False, detached_controller: bool | None = None,
    ):  # fmt: skip
        """`index`: which frontend this is (0: the deployment's own; others: FrontendReplica, with
        the deployment's `link_key` and `controller` actor). `outlive`: the deployment outlives
        this process (`disagg serve`: a SIGKILL of it leaves every frontend serving): frontend 0
        too is a detached actor, and on a machine of its own (no ray_address) Ray and Redis are
        started so that they outlive it; else Ray dies with it, as a test's.
        `detached_controller`: the controller a detached actor that Ray restarts, its workers
        detached too; else it runs in this process (disagg.controller.client). None: as `outlive`."""
        self.outlive = outlive
        self.detached_controller = outlive if detached_controller is None else detached_controller
        self.head: LocalRayHead | None = None  # the Ray head it started, whose daemons are no child of it
        self.config = config.frontend(index)
        self.index = index
        self.directory: InstanceDirectory | None = None
        self.replicas: list = []  # FrontendReplica actors in frontend order (from 1 where frontend 0 is local)
        self.address: str | None = None  # gRPC's HOST:PORT
        self.http_address: str | None = None  # the OpenAI-compatible API's HOST:PORT; None: off (http_port 0)
        self.request_path: RequestPath | None = None  # what both frontends run each request through
        self.metrics_url: str | None = None
        self.servicer: ServingServicer | None = None
        self.replan_view: ReplanView | None = None  # the controller's re-planning decisions, where it re-plans
        self.controller = controller  # the deployment's controller actor (frontend 0's: set at start)
        self.launcher: ControllerClient | InProcessController | None = None  # frontend 0's server only
        self.deployment_id: str | None = None
        self._cluster_gone = False  # the Ray cluster it joined ended under it (stop())
        self.redis: LocalRedis | None = None
        # This deployment's (disagg.auth): workers and frontend replicas get it in their actor arguments.
        self._link_key = link_key if link_key is not None else new_key()
        self._stack = contextlib.ExitStack()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self.warmed_up: list[tuple[str, str]] = []  # (prefill, decode) instance ids the warm-up went through
        self.calibrated = False  # whether every instance's model was measured at start (disagg.router.calibration)
        self._card_ref = None  # the model card the frontend replicas are started with (_start_replicas)
        # This frontend's (its loops' failures included); re-planning's are the controller's, mirrored.
        self.metrics = ServingMetrics(replan=False)

    def start(self) -> "Server":
        """Within the config's start_timeout_s, or an error (what started is stopped)."""
        try:
            self._start(self.config.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        config = self.config
        owns_ray = not ray.is_initialized()
        cpu_plan = None
        if owns_ray:
            if not config.ray_address:  # a machine of our own: its Ray and Redis start from this thread
                cpu_plan = self._bind_framework_cpus()
            if not config.ray_address and self.outlive:
                self._start_own_head()
            _start_ray(config, self.head)
            self._stack.callback(self._shutdown_ray)
        wait_for_pool_nodes(config, timeout_s)
        num_nodes = num_alive_nodes()
        redis_url = self._redis_url(num_nodes)
        # The pools belong to the deployment's controller: a detached actor Ray restarts where the
        # deployment outlives this process (disagg.controller), so that it may die without taking
        # a worker with it; else one in this process, which costs its start nothing.
        self.deployment_id = uuid.uuid4().hex[:6]
        kind = ControllerClient if self.detached_controller else InProcessController
        self.launcher = kind.start(
            config, redis_url, self._link_key, self.deployment_id, worker_host(config.worker_host, num_nodes), cpu_plan
        )
        self._stack.callback(self.launcher.shutdown)
        self.controller = self.launcher.actor
        # The model's shape and tokenizer come from a worker: this node may hold no model files
        # (a `ray up` head), and the frontend tokenizes as the workers do (disagg.engine.model_card).
        card = ray.get(self.launcher.instances[0].actor.model_card.remote(), timeout=timeout_s)
        self._stack.callback(self._stop_replicas)
        if self.controller is None and (self.outlive or self.config.frontends > 1):
            # In the object store for as long as this server holds it: a restarted replica reads
            # its arguments again, and Ray would have freed an argument it stored itself. (With a
            # controller actor each replica asks it instead: it outlives this process.)
            self._card_ref = ray.put(card)
        if self.outlive:  # frontends all equal: none of them dies with this process
            self._start_replicas(redis_url, self._card_ref, range(1), timeout_s)  # first: its warm-up, calibration
            self.address, self.http_address = ray.get(self.replicas[0].addresses.remote(), timeout=timeout_s)
            self.metrics_url = ray.get(self.replicas[0].metrics_url.remote(), timeout=timeout_s)
        else:
            self._start_frontend(redis_url, card, timeout_s)
            self.launcher.register_frontend(0, _reachable(self.address), _reachable(self.http_address))
        self._start_replicas(redis_url, self._card_ref, range(1, self.config.frontends), timeout_s)

    @property
    def local_frontend(self) -> bool:
        """Whether frontend 0 runs in this process (a deployment that ends with it), rather than
        as a detached actor like the others (`disagg serve`: outlive)."""
        return not self.outlive

    def start_replica(self, redis_url: str, card: ModelCard) -> "Server":
        """Frontend `index` of a deployment already running (Ray, Redis and the workers are its;
        `card`: the model they serve)."""
        self._start_frontend(redis_url, card, self.config.start_timeout_s)
        return self

    def _start_frontend(self, redis_url: str, card: ModelCard, timeout_s: float) -> None:
        self._thread = threading.Thread(
            target=self._run_frontend, args=(redis_url, card), name=f"frontend-{self.index}", daemon=True
        )
        self._thread.start()
        if not self._started.wait(timeout_s) or self._failure is not None:
            raise self._failure or UnavailableError("the frontend did not start in time")

    def _start_replicas(self, redis_url: str, card_ref, indexes: range, timeout_s: float) -> None:
        """Frontends `indexes` as detached actors, restarted by Ray whenever they die (same ports
        where they are fixed). `card_ref`: the model card in the object store, or None: each
        fetches it from a worker through the controller (an object this process owns would be
        lost with it, and a replica restarted after its death could not read its arguments)."""
        started = []
        for index in indexes:
            replica = FrontendReplica.options(
                name=f"frontend-{index}",
                namespace=NAMESPACE,
                lifetime="detached",  # it outlives this process; stop() (or `disagg stop`) ends it
                max_restarts=-1,
                num_cpus=0,
                scheduling_strategy=_replica_placement(self.config.host),
            ).remote(self.config, redis_url, self._link_key, index, card_ref, self.controller)
            started.append(replica)
        self.replicas += started
        ray.get([r.addresses.remote() for r in started], timeout=timeout_s)

    def frontend_addresses(self, timeout_s: float = 30.0) -> list[str]:
        """Every frontend's gRPC HOST:PORT, frontend 0's first (a restarted replica on an
        ephemeral port has a new one)."""
        actors = ray.get([r.addresses.remote() for r in self.replicas], timeout=timeout_s)
        return ([self.address] if self.local_frontend else []) + [grpc_address for grpc_address, _ in actors]

    def _stop_replicas(self) -> None:
        stops = [r.stop.remote() for r in self.replicas]
        with contextlib.suppress(Exception):
            ray.get(stops, timeout=self.config.drain_grace_s + 15)
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                ray.kill(replica, no_restart=True)

    def _bind_framework_cpus(self) -> CpuPlan | None:
        """Before Ray and Redis start from this thread, so that they, and the workers Ray starts,
        inherit the framework's CPUs; each engine thread then moves to its own (cpu_binding).
        This thread gets its CPUs back on stop."""
        plan = plan_cpus(self.config, os.sched_getaffinity(0))
        if plan is not None:
            logger.info("CPU binding: %s", plan.describe())
            # Every thread of this process, not only this one: a thread started before (by an
            # import, by the CLI) would keep the engines' CPUs, and so would the threads it starts.
            self._stack.callback(restore_threads, bind_all_threads(plan.framework))
        return plan

    def _redis_url(self, num_nodes: int) -> str:
        """The configured Redis, or a local redis-server behind a fresh password: on loopback for a
        one-node cluster, else on this node's IP, since workers on the other nodes heartbeat to it.
        The password travels only inside the URL that workers get in their actor arguments."""
        if self.config.redis_url is not None:
            check_redis_reachable(self.config.redis_url, num_nodes)
            return self.config.redis_url
        if self.redis is not None:  # started before Ray (_start_own_head)
            return self.redis.url
        host = LOOPBACK if num_nodes <= 1 else resolve_host(None)
        redis = LocalRedis(host=host, password=secrets.token_hex(16), outlive_owner=self.outlive)
        self.redis = self._stack.enter_context(redis).supervise()
        return self.redis.url

    def _start_own_head(self) -> None:
        """A one-machine deployment that outlives this process (`disagg serve`): its redis-server,
        and a Ray head whose daemons are no children of this process (disagg.cluster.local_ray);
        stop() ends both, `disagg stop` too if this process died. The head's GCS keeps its
        tables in memory, not in this Redis: the registry is soft state that may die (and does in
        loadtest/faults/chaos.py), and a GCS that loses its Redis exits, with every actor."""
        redis = LocalRedis(host=LOOPBACK, password=secrets.token_hex(16), outlive_owner=True)
        self.redis = self._stack.enter_context(redis).supervise()
        self.head = LocalRayHead.start(free_port(), max(2, os.cpu_count() or 2), None, {"worker_niceness": 0})
        self._stack.callback(self.head.stop)

    def _run_frontend(self, redis_url: str, card: ModelCard) -> None:
        try:
            asyncio.run(self._frontend(redis_url, card))
        except BaseException as exc:  # reported to start(); a crash after start is logged
            self._failure = exc
            logger.exception("frontend failed")
        finally:
            self._started.set()

    async def _frontend(self, redis_url: str, card: ModelCard) -> None:
        config = self.config
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        registry = Registry(redis_url)
        streams = DecodeStreams()
        directory = directory_for(config, registry, NAMESPACE, self._link_key, streams, PrefixIndex(redis_url))
        self.directory = directory
        await _wait_for_instances(config, directory)
        hf_tokenizer = card.tokenizer()
        tokenizer = Tokenizer(hf_tokenizer) if hf_tokenizer is not None else None
        limits = await _model_limits(config, card, directory)
        metrics = self.metrics
        # The controller's re-planner plans for every frontend's traffic: each hands its arrivals over.
        arrival_feed = ArrivalFeed(registry, config.replan_window_s) if replans(config) else None
        verdict_feed = VerdictFeed(registry, config.replan_window_s) if replans(config) else None  # its checks
        orchestrator = Orchestrator(
            config,
            directory,
            placement_policy(config),
            streams,
            config.engine.block_size,
            on_migration=metrics.observe_migration,
            sliding_window=limits.sliding_window,
            arrivals=arrival_feed,
            peer_fetch=PeerFetch.from_config(config, directory, _kv_bytes_per_token(config, card)),
            on_prefill_saved=metrics.observe_prefill_saved,
        )
        if config.warm_up:  # before clients can connect: their first requests find every path ready
            self.warmed_up = await warm_up(config, directory, streams, limits.vocab_size)
        if config.placement == "goodput" and not config.profile and config.calibration_s > 0:
            self.calibrated = await calibrate(config, directory, streams, limits.vocab_size, config.calibration_s)
        records = RequestRecords(registry)
        verdicts = verdict_feed.judged if verdict_feed is not None else None
        self.request_path = RequestPath(orchestrator, tokenizer, limits, metrics, records, verdicts)
        self.replan_view = ReplanView() if replans(config) else None
        self.servicer = ServingServicer(self.request_path, directory, config.engine.model, self.replan_view)
        server, port, health_servicer = await _start_grpc(config, self.servicer)
        verdict = HealthVerdict(config.controller_grace_s)
        try:
            http = await _start_http(config, self.request_path, directory, verdict)
        except BaseException:
            await server.stop(grace=None)  # a failed start leaves no port of ours bound
            raise
        self.http_address = http.address if http is not None else None
        metrics_server = _start_metrics(config, metrics)
        self.metrics_url = metrics_server.url if metrics_server else None
        self.address = f"{config.host}:{port}"
        self.live_moves = LiveMoves(orchestrator, directory)
        counted = metrics.control_loop_failed
        tasks = [
            supervised_task("gauges", lambda: self._refresh_gauges(directory, metrics), counted),
            supervised_task(
                "health", lambda: _report_health(config, directory, health_servicer, registry, verdict), counted
            ),  # fmt: skip
            # Every frontend moves its own requests off a leaving instance; the rest runs once.
            supervised_task("drains", lambda: _drain_leavers(directory, self.live_moves, metrics), counted),
        ]
        tasks += self._control_loops(metrics)
        _freeze_startup_heap()
        self._started.set()
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)  # from the drain's start
        await self.request_path.drain(config.drain_grace_s)
        await server.stop(grace=1.0)
        if http is not None:
            await http.stop()
        await streams.stop()
        await directory.stop()
        records.close()
        if arrival_feed is not None:
            arrival_feed.close()
        if verdict_feed is not None:
            verdict_feed.close()
        if metrics_server:
            metrics_server.stop()
        registry.close()

    def _control_loops(self, metrics: ServingMetrics) -> list[asyncio.Task]:
        """Where instances may switch: rebalancing this frontend's streams, and the controller's
        re-planning decisions fetched for `disagg status` (the controller runs re-planning)."""
        tasks, counted = [], metrics.control_loop_failed
        if self.replan_view is not None and (self.controller is not None or self.launcher is not None):
            tasks.append(supervised_task("replan-view", self._refresh_replan_view, counted))
        if self.config.switchable():
            rebalance = lambda: _rebalance(self.live_moves, self.config.slo.tpot_ms, metrics)  # noqa: E731
            tasks.append(supervised_task("rebalancing", rebalance, counted))
        return tasks

    async def _refresh_replan_view(self, interval_s: float = 2.0) -> None:
        """The controller's decisions (for `disagg status`) and its re-planning metrics (shown
        on this frontend's endpoint)."""
        while True:
            if self.controller is not None:  # an actor's (bounded)
                calls = asyncio.gather(self.controller.replan_log.remote(), self.controller.replan_metrics.remote())
                log, families = await asyncio.wait_for(calls, self.config.control_call_timeout_s)
            else:  # a controller in this process
                log, families = self.launcher.replan_log(), self.launcher.replan_metrics()
            self.replan_view.log = log
            self.metrics.controller_metrics.set(families)
            await asyncio.sleep(interval_s)

    @staticmethod
    async def _refresh_gauges(directory: InstanceDirectory, metrics: ServingMetrics, interval_s: float = 1.0) -> None:
        """The workers' load as Prometheus gauges, from their heartbeats (role and instance labels)."""
        shown: set[tuple[str, str]] = set()
        while True:
            current = set()
            for inst in directory.all():
                load = inst.view.load
                metrics.set_instance_load(
                    inst.instance_id, inst.role, load.num_running, load.num_waiting, load.kv_cache_usage
                )
                metrics.set_expert_load(inst.instance_id, inst.role, load.expert_tokens)
                metrics.kv_tiers.set(
                    inst.instance_id, inst.role, flat_kv_tiers(load.kv_tiers, len(inst.indexed_hashes))
                )
                error = inst.online.recent_error()
                if error is not None:
                    metrics.set_model_error(inst.instance_id, inst.role, error)
                current.add((inst.instance_id, inst.role))
            for instance_id, role in shown - current:
                metrics.remove_instance(instance_id, role)
            for role in ("prefill", "decode", "colocated"):  # the current plan (0: no such pool, or emptied)
                metrics.pool_size.labels(role=role).set(len(directory.healthy(role)))
            metrics.refresh_slo_window()
            shown = current
            await asyncio.sleep(interval_s)

    def serving(self) -> bool:
        """Whether this frontend's serving thread (its event loop: gRPC, HTTP, the loops) runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, cluster_gone: bool = False) -> None:
        """Drain, stop the frontend, the workers, Ray (if we started it) and Redis (if ours).
        `cluster_gone`: the Ray cluster ended under us, and the workers with it; Ray calls would
        only block."""
        self._cluster_gone = cluster_gone
        if cluster_gone and self.launcher is not None:
            self.launcher.abandon()
        if self._loop is not None and self._stop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(self.config.drain_grace_s + 10)
        self._stack.close()

    def _shutdown_ray(self) -> None:
        # With its cluster gone, Ray ends the process from ray.shutdown() (its raylet is dead).
        if not self._cluster_gone:
            ray.shutdown()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(config: ServingConfig, ready_file: str | None = None) -> int:
    """`disagg serve`: start a deployment and run until SIGINT/SIGTERM, which end it; or, where
    one runs already (recorded on this machine, or on the Ray cluster it joins), attach to it
    instead of starting another. Returns the exit code."""
    attached = _running_deployment(config)
    if attached is not None:
        return _attach(attached, ready_file)
    print(f"disagg: starting {config.mode} pools for {config.engine.model}", flush=True)
    server = Server(config, outlive=True).start()
    _record(server)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own handlers
        signal.signal(sig, lambda *_: stop.set())
    extra = f", metrics on {server.metrics_url}" if server.metrics_url else ""
    print(f"disagg: serving {config.engine.model} ({config.mode}) on {server.address}{extra}", flush=True)
    if server.http_address:
        scheme = "https" if config.tls_cert_file else "http"
        print(f"disagg: OpenAI-compatible API on {scheme}://{server.http_address}/v1", flush=True)
    addresses = server.frontend_addresses()
    if len(addresses) > 1:
        print(f"disagg: frontends on {', '.join(addresses)}", flush=True)
    if ready_file:  # frontend 0's gRPC address; with more, a second line: every frontend's
        _write_ready(ready_file, addresses)
    cluster = ClusterWatch.of_ray() if config.ray_address else None
    cluster_gone, code = False, 0
    while not stop.wait(1.0):
        if cluster is not None and cluster.gone():
            print("disagg: the Ray cluster it joined is gone (`ray down` or `ray stop` on the head)", flush=True)
            cluster_gone = True
            break
        if server.local_frontend and not server.serving():  # (a detached one Ray restarts)
            print("disagg: the frontend's serving thread ended (its log says why)", flush=True)
            code = 1
            break
    print(f"disagg: shutting down (in-flight requests get {config.drain_grace_s:.0f}s)", flush=True)
    server.stop(cluster_gone)
    forget_state()
    print("disagg: stopped", flush=True)
    return code


def _kv_bytes_per_token(config: ServingConfig, card: ModelCard) -> int:
    """A token's KV bytes on the workers, every layer and head (what a peer fetch moves)."""
    return card.config.kv_bytes_per_token * (card.kv_element_bytes or kv_element_bytes(config.engine))


def _write_ready(ready_file: str, addresses: list[str]) -> None:
    """The first frontend's gRPC address; with more, a second line: every frontend's."""
    others = f"{','.join(addresses)}\n" if len(addresses) > 1 else ""
    with open(ready_file, "w") as f:
        f.write(f"{addresses[0]}\n{others}")


def _record(server: Server) -> None:
    """What `disagg stop` and a second `disagg serve` need of this deployment (deployment_state)."""
    redis, head = server.redis, server.head
    DeploymentState(
        server.deployment_id,
        head.address if head is not None else ray.get_runtime_context().gcs_address,
        server.launcher.redis_url,
        os.getpid(),
        ray_temp_dir=head.temp_dir if head is not None else None,
        redis_address=f"{redis.host}:{redis.port}" if redis is not None else None,
    ).save()


def _running_deployment(config: ServingConfig) -> DeploymentState | None:
    """The deployment to attach to: the one recorded on this machine while its Ray answers; on a
    cluster (ray_address), one whose controller runs there."""
    if not config.ray_address:
        return running_state()
    _start_ray(config)
    running = running_deployments()
    if not running:
        return None
    gcs = ray.get_runtime_context().gcs_address
    return DeploymentState(running[0], gcs, "", -1)


def _attach(state: DeploymentState, ready_file: str | None) -> int:
    """Print the running deployment's frontends (and write them to `ready_file`), then follow it
    until Ctrl-C, which detaches (`disagg stop` ends it), or until it ends."""
    if not ray.is_initialized():
        join_ray(state)
    addresses = frontend_addresses(state)
    print(f"disagg: a deployment runs already ({state.deployment_id}); attached to it, not starting another",
          flush=True)  # fmt: skip
    print(f"disagg: frontends on {', '.join(addresses) or '(none answering now)'}", flush=True)
    if ready_file and addresses:
        _write_ready(ready_file, addresses)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(2.0):
        if find_controller(state.deployment_id) is None:
            print("disagg: the deployment ended", flush=True)
            return 0
    print("disagg: detached (the deployment runs on; `disagg stop` ends it)", flush=True)
    return 0


def _replica_placement(host: str):
    """Frontends on a wildcard address spread over the cluster's nodes; on a given address (or
    loopback) they must run where that address is: this node."""
    if host in WILDCARD_HOSTS:
        return "SPREAD"
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


@ray.remote
class FrontendReplica:
    """Frontend `index` of a deployment (ServingConfig.frontends): the same gRPC and HTTP service
    as frontend 0's, on its own ports, in a process Ray restarts when it dies."""

    def __init__(
        self, config: ServingConfig, redis_url: str, link_key: bytes, index: int, card: ModelCard | None, controller
    ):  # fmt: skip
        """`card`: the model's, or None: asked of a worker through the `controller` actor."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if _restarted():
            # Restarted (frontend 0 included): it serves at once; the instances were warmed up
            # and their models measured at the deployment's start.
            config = dataclasses.replace(config, warm_up=False, calibration_s=0.0)
        if card is None:
            card = _card_of(controller, config.start_timeout_s)
        server = Server(config, index=index, link_key=link_key, controller=controller)
        self.server = server.start_replica(redis_url, card)
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="frontend-watch", daemon=True).start()

    def _watch(self, interval_s: float = 1.0) -> None:
        """A replica whose serving thread ended serves nothing while its actor still answers Ray:
        it exits, and Ray starts it again (as Ray Serve restarts a proxy that fails its check)."""
        while not self._stopping.wait(interval_s):
            if not self.server.serving():
                logger.error("frontend %d's serving thread ended; exiting for Ray to restart it", self.server.index)
                os._exit(1)

    def addresses(self) -> tuple[str, str | None]:
        """(gRPC HOST:PORT, HTTP HOST:PORT or None), with its node's IP for a wildcard host."""
        return _reachable(self.server.address), _reachable(self.server.http_address)

    def metrics_url(self) -> str | None:
        return self.server.metrics_url

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self._stopping.set()
        self.server.stop()


def _restarted() -> bool:
    """Whether Ray restarted this actor (its property reads a deprecated one of Ray's own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _card_of(controller, timeout_s: float) -> ModelCard:
    """The model card of the deployment's first instance, whichever worker holds it now; asked
    again while the controller or that worker restarts (a replica that failed here would not be
    restarted: Ray ends an actor whose constructor raises)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            instances = ray.get(controller.instances.remote(), timeout=timeout_s)
            return ray.get(instances[0].actor.model_card.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:  # (ActorUnavailableError too: restarting)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _reachable(address: str | None) -> str | None:
    if address is None:
        return None
    host, port = address.rsplit(":", 1)
    return f"{ray.util.get_node_ip_address()}:{port}" if host in WILDCARD_HOSTS else address


class ClusterWatch:
    """Whether the Ray cluster a server joined still answers: `ray down` stops Ray on the head and
    nothing else, and Ray ends a driver whose cluster is gone only a minute later and abruptly;
    the server stops on its own first, in order. Gone: neither the GCS nor this node's raylet
    accepts a connection. A GCS restarting alone (its tables in Redis: deploy/head-redis.sh)
    leaves the raylet, and the deployment serves on through it."""

    MISSES = 3  # checks in a row (a check a second) that reach neither

    def __init__(self, gcs: tuple[str, int], raylet: tuple[str, int] | None = None):
        self.addresses = [gcs] if raylet is None else [gcs, raylet]
        self.misses = 0

    @classmethod
    def of_ray(cls) -> "ClusterWatch":
        host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
        return cls((host, int(port)), _local_raylet())

    def gone(self) -> bool:
        if any(_accepts(address) for address in self.addresses):
            self.misses = 0
        else:
            self.misses += 1
        return self.misses >= self.MISSES


def _local_raylet() -> tuple[str, int] | None:
    """HOST:PORT of this node's raylet (None: Ray lists no such node)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return node["NodeManagerAddress"], int(node["NodeManagerPort"])
    return None


def _accepts(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=1.0).close()
        return True
    except OSError:
        return False


RAY_TOKEN_FILE = Path.home() / ".ray" / "auth_token"  # where Ray keeps the cluster's auth token


def _start_ray(config: ServingConfig, head: LocalRayHead | None = None) -> None:
    _protect_ray_token()
    try:
        _init_ray(config, head)
    finally:
        _protect_ray_token()  # Ray writes a new token with the default umask: readable by every user


def _protect_ray_token() -> None:
    with contextlib.suppress(FileNotFoundError):
        RAY_TOKEN_FILE.chmod(0o600)


def _init_ray(config: ServingConfig, head: LocalRayHead | None) -> None:
    if config.ray_address or head is not None:
        address = head.address if head is not None else config.ray_address
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    else:
        # Ray starts its workers at nice 15 (so that they cannot starve its own daemons); ours
        # are the request path: at 15 every other process on the machine preempts a prefill
        # (loadtest/RESULTS.md).
        ray.init(
            namespace=NAMESPACE,
            include_dashboard=False,
            logging_level=logging.WARNING,
            num_cpus=max(2, os.cpu_count() or 2),
            _system_config={"worker_niceness": 0},
        )


def _freeze_startup_heap() -> None:
    """What start-up built (torch, Ray, the model's modules, the router) lives as long as the server:
    out of the collector's reach from now on. Else every full collection walks it all (120-150 ms
    here) and holds the event loop meanwhile: every stream's tokens and every refusal wait. A
    flood sets one off: its refused calls are garbage with their tracebacks (issue 40)."""
    gc.collect()
    gc.freeze()


async def _rebalance(moves: LiveMoves, tpot_ms: float, metrics: ServingMetrics, interval_s: float = 1.0) -> None:
    """Decode instances whose batch is predicted to miss the TPOT target hand requests to others
    with room, with their KV, every `interval_s` (a heartbeat's reports see the last round's). A
    round that raises ends it: disagg.supervision starts it again, counted."""
    while True:
        await asyncio.sleep(interval_s)
        stats = await moves.rebalance(tpot_ms)
        if stats.moved or stats.failed:
            metrics.observe_live_moves(stats.moved, stats.failed)
            logger.info("rebalanced: %d requests moved with their KV, %d not", stats.moved, stats.failed)


async def _drain_leavers(
    directory: InstanceDirectory, moves: LiveMoves, metrics: ServingMetrics, interval_s: float = 0.25
) -> None:
    """Decode instances that say they are leaving (SIGTERM, scale-in): move their requests away
    with their KV, each instance's drain once, in the background."""
    tasks: dict[str, asyncio.Task] = {}  # instance id -> its drain, while the instance is draining

    async def drain(instance) -> None:
        stats = await moves.drain(instance)
        metrics.observe_live_moves(stats.moved, stats.failed)
        logger.info(
            "drained %s: %d requests moved with their KV, %d not", instance.instance_id, stats.moved, stats.failed
        )

    while True:
        leaving = {i.instance_id: i for i in directory.draining("decode")}
        for instance_id in set(tasks) - set(leaving):
            del tasks[instance_id]  # gone (or back in service)
        for instance_id, instance in leaving.items():
            if instance_id not in tasks:
                tasks[instance_id] = asyncio.create_task(drain(instance), name=f"drain-{instance_id}")
        await asyncio.sleep(interval_s)


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


async def _model_limits(config: ServingConfig, card: ModelCard, directory: InstanceDirectory) -> ModelLimits:
    role = "colocated" if config.mode == "colocated" else "decode"
    blocks = min(i.view.load.num_total_blocks for i in directory.healthy(role))
    context = card.config.max_position_embeddings
    max_len = min(config.engine.max_model_len or context, context)
    engine = config.pool_engine_config(config.colocated if role == "colocated" else config.decode)
    return ModelLimits(
        card.config.vocab_size,
        max_len,
        blocks,
        config.engine.block_size,
        sliding_window=card.config.shared_window,
        # (prefill_first computes a whole prompt in a step: no smaller chunk bounds what it holds)
        chunk_tokens=engine.max_num_batched_tokens if engine.scheduling_policy != "prefill_first" else max_len,
    )


async def _start_grpc(config: ServingConfig, servicer: ServingServicer):
    # grpc.aio: each call is a task on the event loop, so no pool of threads can fill up with long
    # streams and keep a new call from its refusal. Over the bound, gRPC refuses a call itself,
    # before any of ours runs for it (disagg.router.grpc_door).
    server = frontend_server(servicer.path, config, key_guard_interceptors(config))
    add_serving_service(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if config.tls_cert_file:
        port = server.add_secure_port(address, _server_credentials(config))
    else:
        port = server.add_insecure_port(address)
    await server.start()
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def _server_credentials(config: ServingConfig) -> grpc.ServerCredentials:
    """The config's certificate; with tls_client_ca_file, a client must present one that CA signed."""
    key, cert = Path(config.tls_key_file).read_bytes(), Path(config.tls_cert_file).read_bytes()
    client_ca = Path(config.tls_client_ca_file).read_bytes() if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca, require_client_auth=bool(client_ca))


def _start_metrics(config: ServingConfig, metrics: ServingMetrics):
    """/metrics, behind the API key and on TLS when the config has them; None when it is off."""
    if config.metrics_port is None:
        return None
    tls = (config.tls_cert_file, config.tls_key_file) if config.tls_cert_file else None
    return metrics.start_http_server(
        config.metrics_port, config.host, api_key=config.api_key, tls=tls, client_ca=config.tls_client_ca_file
    )


async def _start_http(
    config: ServingConfig, path: RequestPath, directory: InstanceDirectory, verdict: HealthVerdict
) -> HttpFrontend | None:
    """The OpenAI-compatible HTTP API on this event loop, unless http_port is 0."""
    if not config.http_port:
        return None
    http = HttpFrontend(path, directory, config, config.engine.model, verdict)
    await http.start()
    return http


async def _set_health(health_servicer, status) -> None:
    for service in (SERVICE_NAME, ""):
        await health_servicer.set(service, status)


async def _report_health(
    config: ServingConfig, directory: InstanceDirectory, health_servicer, registry: Registry, verdict: HealthVerdict
) -> None:
    """gRPC's health status and HTTP /health from one verdict (disagg.router.health), so that load
    balancers look elsewhere. Set at its start too: a loop restarted by its supervisor trusts
    nothing set before."""
    roles = [role for role, _ in config.pools()]
    shown = None
    while True:
        pools_served = all(directory.healthy(role) for role in roles)
        problem = verdict.judge(pools_served, await _controller_alive(registry))
        if (problem is None) != shown:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if problem is None
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            logger.log(logging.INFO if problem is None else logging.WARNING, "health: %s",
                       "SERVING" if problem is None else f"NOT_SERVING ({problem})")  # fmt: skip
            await _set_health(health_servicer, status)
            shown = problem is None
        await asyncio.sleep(directory.refresh_interval_s)


async def _controller_alive(registry: Registry) -> bool | None:
    """None while Redis does not answer: that is not the controller gone (the directory keeps
    its view too)."""
    try:
        return await asyncio.to_thread(registry.controller_alive)
    except RegistryUnavailable:
        return None


def main_serve(config_path: str | None, overrides: dict, ready_file: str | None = None, cluster: bool = False) -> int:
    """`disagg serve`: the defaults, under the config file's settings, under `overrides` (the
    flags', nested as in the file). A config without `api_key` takes $DISAGG_API_KEY's (the
    clients' variable), so that no key need be written in a config file or on a command line.
    A config without `redis_url` takes $DISAGG_REDIS_URL's: on a `ray up` head, the Redis that
    Ray's GCS keeps its tables in (deploy/head-redis.sh), its password off the command line.
    `cluster`: join the running Ray cluster (ServingConfig.on_cluster)."""
    config = serving_config(config_path, overrides)
    return serve(config.on_cluster() if cluster else config, ready_file)


def serving_config(config_path: str | None, overrides: dict) -> ServingConfig:
    """The defaults, under the file's settings, under `overrides`, checked by the config."""
    settings = merge_settings(read_yaml_settings(config_path) if config_path else {}, overrides)
    if not settings.get("api_key") and env(API_KEY_ENV):
        settings["api_key"] = env(API_KEY_ENV)
    if not settings.get("redis_url") and env("DISAGG_REDIS_URL"):
        settings["redis_url"] = env("DISAGG_REDIS_URL")
    return ServingConfig.from_dict(settings)


if __name__ == "__main__":
    sys.exit(main_serve(None, {}))
