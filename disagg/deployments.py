"""A deployment's life beyond one `disagg serve` process: a second `disagg serve` attaches to the
one running (disagg.cluster.deployment_state records it) instead of starting another, and
`disagg stop` ends it, whether or not the `disagg serve` that started it still lives: its
controller stops every worker (disagg.controller), its frontends are killed, and the Ray head
and redis-server it started in sessions of their own are stopped, leaving no process of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import ray

from disagg.cluster.deployment_state import DeploymentState, forget_state, load_state, process_alive, redis_processes
from disagg.cluster.launcher import NAMESPACE, kill_deployment
from disagg.cluster.local_ray import LocalRayHead, use_token_auth
from disagg.cluster.redis_server import REDIS_DIR_PREFIX
from disagg.controller.controller import find_controller, running_deployments

logger = logging.getLogger(__name__)
FRONTEND_PREFIX = "frontend-"  # frontend replicas' actor names (disagg.server.FrontendReplica)
SERVE_EXIT_TIMEOUT_S = 90.0  # for a `disagg serve` sent SIGTERM to drain and stop everything itself
CALL_TIMEOUT_S = 10.0


def ray_answers(address: str, timeout_s: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False


def running_state() -> DeploymentState | None:
    """The deployment recorded on this machine if its Ray still answers; a record whose Ray is
    gone is stale, and what is left of it (its redis-server) is stopped."""
    state = load_state()
    if state is None:
        return None
    if ray_answers(state.ray_address):
        return state
    _stop_redis(state)
    forget_state()
    return None


def join_ray(state: DeploymentState) -> None:
    """ray.init() on the deployment's Ray (with the token a head we started asks for)."""
    if state.ray_temp_dir:
        use_token_auth()
    ray.init(address=state.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)


def frontend_addresses(state: DeploymentState) -> list[str]:
    """The gRPC addresses of the deployment's live frontends (ray.init'd on its Ray)."""
    addresses = []
    controller = find_controller(state.deployment_id)
    if controller is not None and process_alive(state.serve_pid):
        known = ray.get(controller.frontend_addresses.remote(), timeout=CALL_TIMEOUT_S)
        addresses += [grpc for _, (grpc, _) in sorted(known.items())]
    for name in _frontend_names():
        with contextlib.suppress(Exception):  # one restarting now is left out
            addresses.append(ray.get(ray.get_actor(name, namespace=NAMESPACE).addresses.remote(), timeout=5)[0])
    return addresses


def _frontend_names() -> list[str]:
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(n["name"] for n in named if n["namespace"] == NAMESPACE and n["name"].startswith(FRONTEND_PREFIX))


def stop_deployment(state: DeploymentState | None) -> list[str]:
    """Ends the deployment recorded (`state`) or, with None, every deployment on the Ray this
    process joined (`disagg stop --cluster`); what it did, as lines to print."""
    done = []
    if state is not None and process_alive(state.serve_pid, "disagg") and state.serve_pid != os.getpid():
        done.append(f"sent SIGTERM to disagg serve (pid {state.serve_pid})")
        _end_process(state.serve_pid, SERVE_EXIT_TIMEOUT_S)
    if state is None or ray_answers(state.ray_address):
        if state is not None:
            join_ray(state)
        done += _stop_actors()
        ray.shutdown()
    if state is not None and state.ray_temp_dir:
        LocalRayHead(state.ray_address, state.ray_temp_dir).stop()
        done.append(f"stopped the Ray head at {state.ray_address}")
    if state is not None and _stop_redis(state):
        done.append(f"stopped redis-server on {state.redis_address}")
    if state is not None:
        forget_state()
    return done


def _stop_actors() -> list[str]:
    done = []
    for deployment_id in running_deployments():
        controller = find_controller(deployment_id)
        try:
            ray.get(controller.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - a controller that does not answer: its actors by name
            kill_deployment(deployment_id)
        with contextlib.suppress(Exception):
            ray.kill(controller, no_restart=True)
        done.append(f"stopped deployment {deployment_id} (its controller and workers)")
    for name in _frontend_names():
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        done.append(f"stopped {name}")
    return done


def stop_leftovers(state: DeploymentState) -> None:
    """After a `disagg serve` was killed outright: the Ray head and redis-server it started."""
    if state.ray_temp_dir:
        LocalRayHead(state.ray_address, state.ray_temp_dir).stop()
    _stop_redis(state)


def _stop_redis(state: DeploymentState) -> bool:
    """The redis-server the deployment started (whichever process runs it now), and its dir."""
    pids = redis_processes(state.redis_address)
    for pid in pids:
        work_dir = _cwd(pid)
        _end_process(pid, 10.0)
        if work_dir is not None and Path(work_dir).name.startswith(REDIS_DIR_PREFIX):
            shutil.rmtree(work_dir, ignore_errors=True)
    return bool(pids)


def _cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def _end_process(pid: int, timeout_s: float) -> None:
    """SIGTERM, and SIGKILL if it still runs after `timeout_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)
