"""The deployment's controller: a detached, named Ray actor that Ray restarts when it dies
(`max_restarts=-1`), as Ray Serve's controller. It owns the pools: their placement groups, their
worker actors (detached and named too, so they outlive it) and the supervision that relaunches a
TP x PP instance that lost a rank. It holds no state that it cannot rebuild: started again with
the same arguments, it adopts the instances still alive by their names (disagg.cluster.launcher
`PoolLauncher._adopt`, in the role each reports now) and launches only those that are gone.

While it lives it refreshes a key in the registry; frontends report NOT_SERVING when the key
lapses (no relaunch would follow a failure then).
"""

from __future__ import annotations

import logging
import os
import threading

import ray

from disagg.cluster.launcher import NAMESPACE, LaunchedInstance, PoolLauncher
from disagg.config import ServingConfig
from disagg.errors import RegistryUnavailable
from disagg.hosts.cpu_binding import CpuPlan
from disagg.registry import Registry
from disagg.supervision import supervise_thread

logger = logging.getLogger(__name__)
CONTROLLER_PREFIX = "controller-"  # its name: this and the deployment's id, in NAMESPACE


class Controller:
    def __init__(
        self, config: ServingConfig, redis_url: str, link_key: bytes, deployment_id: str,
        worker_host: str | None, cpu_plan: CpuPlan | None,
    ):  # fmt: skip
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.config = config
        self.launcher = PoolLauncher(config, redis_url, link_key, worker_host, cpu_plan, deployment_id=deployment_id)
        self.registry = Registry(redis_url)
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.frontends: dict[int, tuple[str, str | None]] = {}  # index -> (gRPC, HTTP) addresses
        self._stopping = threading.Event()
        self._failure: BaseException | None = None
        # Launching (or adopting) takes minutes with big models: off the constructor, which Ray
        # must see return before it answers any call (ready() waits for it).
        self._starting = threading.Thread(target=self._start, name="controller-start", daemon=True)
        self._starting.start()

    def _start(self) -> None:
        try:
            self.launcher.launch()
        except BaseException as exc:  # noqa: BLE001 - ready() raises it to whoever waits
            self._failure = exc
            return
        self.launcher.supervise(on_failure=self._loop_failed)
        beat = ("controller-heartbeat", self._heartbeat, self._stopping, self._loop_failed)
        threading.Thread(target=supervise_thread, args=beat, name="controller-heartbeat", daemon=True).start()
        logger.info("controller %s: %d instances", "restarted" if self.restarted else "started",
                    len(self.launcher.instances))  # fmt: skip

    def _heartbeat(self) -> None:
        while not self._stopping.is_set():
            try:
                self.registry.controller_heartbeat(self.config.heartbeat_ttl_s)
            except RegistryUnavailable as exc:
                logger.warning("controller heartbeat: %s", exc)
            self._stopping.wait(self.config.heartbeat_interval_s)

    def _loop_failed(self, loop: str) -> None:
        logger.error("control loop %s failed and was restarted", loop)

    # ---- what the server and the tools ask ---------------------------------------------------
    def ready(self, timeout_s: float) -> int:
        """Once every instance is launched or adopted (raises the start's error); this process's pid."""
        self._starting.join(timeout_s)
        if self._failure is not None:
            raise self._failure
        if self._starting.is_alive():
            raise TimeoutError(f"the controller did not start its instances in {timeout_s:.0f} s")
        return os.getpid()

    def instances(self) -> list[LaunchedInstance]:
        with self.launcher._lock:
            return list(self.launcher.instances)

    def switched(self, instance_id: str, role: str) -> None:
        self.launcher.switched(instance_id, role)

    def register_frontend(self, index: int, grpc_address: str, http_address: str | None) -> None:
        self.frontends[index] = (grpc_address, http_address)

    def frontend_addresses(self) -> dict[int, tuple[str, str | None]]:
        return dict(self.frontends)

    def status(self) -> dict:
        return {"pid": os.getpid(), "restarted": self.restarted, "instances": len(self.launcher.instances)}

    def shutdown(self, remove_groups: bool = True) -> None:
        """Ends every instance of the deployment (the actor itself is killed by the caller)."""
        self._stopping.set()
        self.launcher.shutdown(remove_groups=remove_groups)
        try:
            self.registry.controller_gone()
        except RegistryUnavailable as exc:
            logger.warning("controller: %s", exc)


def start_controller(config: ServingConfig, redis_url: str, link_key: bytes, deployment_id: str,
                     worker_host: str | None, cpu_plan: CpuPlan | None):  # fmt: skip
    """The deployment's controller actor, detached, named, restarted by Ray whenever it dies."""
    return (
        ray.remote(Controller)
        .options(
            name=CONTROLLER_PREFIX + deployment_id,
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=-1,
            max_concurrency=8,
            num_cpus=0,
        )  # fmt: skip
        .remote(config, redis_url, link_key, deployment_id, worker_host, cpu_plan)
    )


def find_controller(deployment_id: str):
    """The controller of deployment `deployment_id` if it runs, else None."""
    try:
        return ray.get_actor(CONTROLLER_PREFIX + deployment_id, namespace=NAMESPACE)
    except ValueError:
        return None


def running_deployments() -> list[str]:
    """The ids of the deployments whose controller lives in this Ray cluster."""
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        n["name"].removeprefix(CONTROLLER_PREFIX)
        for n in names
        if n["namespace"] == NAMESPACE and n["name"].startswith(CONTROLLER_PREFIX)
    )
