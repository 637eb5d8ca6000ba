"""The deployment's controller: a detached, named Ray actor that Ray restarts when it dies
(`max_restarts=-1`), as Ray Serve's controller. It owns the pools: their placement groups, their
worker actors (detached and named too, so they outlive it) and the supervision that relaunches a
TP x PP instance that lost a rank. It holds no state that it cannot rebuild: started again with
the same arguments, it adopts the instances still alive by their names (disagg.cluster.launcher
`PoolLauncher._adopt`, in the role each reports now) and launches only those that are gone.

It runs what must run once per deployment: relaunch supervision and the re-planning loop
(disagg.router.replanning), on its own view of the instances, fed every frontend's arrivals
through Redis; each frontend drains and rebalances its own streams. The loop scales through its
launcher (`PoolLauncher.room_for`, `add`, `remove`); a restarted controller adopts the instances
it added too, by name.

While it lives it refreshes a key in the registry; frontends report NOT_SERVING when the key
lapses (no relaunch would follow a failure then).

Where the deployment does not outlive the process that starts it (a Server in a test or a
benchmark), the same Controller runs in that process instead (`detached=False`): its workers
are then owned by that process, as Ray's non-detached actors, and its start costs no process of
its own (a Ray worker process and its imports: seconds on a small host, at every start).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import ray

from disagg.cluster.launcher import NAMESPACE, LaunchedInstance, PoolLauncher
from disagg.config import ServingConfig
from disagg.errors import RegistryUnavailable
from disagg.hosts.cpu_binding import CpuPlan
from disagg.metrics import ServingMetrics
from disagg.registry import Registry
from disagg.router.directory import directory_for
from disagg.router.replanning import LoggedDecision, ReplanLoop, SwitchRecord, replan_loop_for, replans
from disagg.router.shared_arrivals import take_shared_arrivals, take_shared_verdicts
from disagg.router.streams import DecodeStreams
from disagg.supervision import supervise_thread, supervised_task

logger = logging.getLogger(__name__)
CONTROLLER_PREFIX = "controller-"  # its name: this and the deployment's id, in NAMESPACE


class Controller:
    def __init__(
        self, config: ServingConfig, redis_url: str, link_key: bytes, deployment_id: str,
        worker_host: str | None, cpu_plan: CpuPlan | None, detached: bool = True,
    ):  # fmt: skip
        """`detached`: a detached actor of its own, whose workers are detached too; else it runs in
        the caller's process, and its workers end with that process."""
        self.config = config
        self.redis_url, self.link_key = redis_url, link_key
        self.metrics = ServingMetrics(replan=True)  # the control loops' (re-planning, their failures)
        self.replanning: ReplanLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.launcher = PoolLauncher(
            config, redis_url, link_key, worker_host, cpu_plan, deployment_id=deployment_id, detached=detached
        )
        self.registry = Registry(redis_url)
        self.restarted = detached and ray.get_runtime_context().was_current_actor_reconstructed
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
        threading.Thread(target=self._run_control_loops, name="control-loops", daemon=True).start()
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
        self.metrics.control_loop_failed(loop)

    # ---- the loops that run once per deployment, on an event loop of their own -----------------
    def _run_control_loops(self) -> None:
        try:
            asyncio.run(self._control_loops())
        except Exception:  # noqa: BLE001 - logged; Ray restarts the controller only if it dies
            logger.exception("the controller's control loops ended")

    async def _control_loops(self) -> None:
        """Re-planning, on its own view of the instances (from the registry, as a frontend's)."""
        self._loop = asyncio.get_running_loop()
        if not replans(self.config):  # nothing to run: no view of the instances to keep either
            await asyncio.to_thread(self._stopping.wait)
            return
        registry = Registry(self.redis_url)
        directory = directory_for(self.config, registry, NAMESPACE, self.link_key, DecodeStreams())
        await directory.start()
        instance = self.launcher.instances[0].actor
        card = await asyncio.wait_for(instance.model_card.remote(), self.config.start_timeout_s)
        shared = lambda: take_shared_arrivals(registry)  # noqa: E731
        verdicts = lambda: take_shared_verdicts(registry)  # noqa: E731 - a check measures every frontend's
        self.replanning = replan_loop_for(
            self.config, directory, card, self.metrics, self.launcher.switched, shared, scaler=self.launcher,
            shared_verdicts=verdicts,
        )  # fmt: skip
        if self.replanning is not None:
            self.replanning.resize(len(self.instances()))  # those added by scaling before a restart too
        tasks = [supervised_task("replanning", self.replanning.run, self._loop_failed)] if self.replanning else []
        try:
            await asyncio.to_thread(self._stopping.wait)
        finally:
            for task in tasks:
                task.cancel()
            await directory.stop()
            registry.close()

    def _on_loop(self, coroutine, timeout_s: float):
        if self._loop is None:
            raise RuntimeError("the controller's control loops are not running yet")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def replan_log(self) -> list[LoggedDecision]:
        """The re-planner's latest decisions, newest last ([] where it does not run)."""
        return list(self.replanning.log) if self.replanning is not None else []

    def replan_metrics(self) -> list[dict]:
        """The re-planning metric families, as plain data (the frontends expose them)."""
        return self.metrics.replan_families()

    def replan_switch(self, from_role: str, to_role: str) -> SwitchRecord | None:
        """Switch one instance now, as a decision would (tests, operators)."""
        if self.replanning is None:
            raise ValueError("re-planning does not run in this deployment (ServingConfig.replan, switchable)")
        timeout_s = self.config.replan_switch_timeout_s + 4 * self.config.control_call_timeout_s + 30
        return self._on_loop(self.replanning.switch(from_role, to_role), timeout_s)

    def replan_scale(self, role: str, delta: int) -> SwitchRecord | None:
        """Add (delta 1) or remove (-1) one instance of `role` now, as a decision would (tests, operators)."""
        if self.replanning is None or self.replanning.scaler is None:
            raise ValueError("scaling does not run in this deployment (ServingConfig.replan_scale, scales)")
        timeout_s = (
            self.config.start_timeout_s + self.config.replan_switch_timeout_s + 4 * self.config.control_call_timeout_s
        )
        return self._on_loop(self.replanning.scale(role, delta), timeout_s + 30)

    def replan_take_arrivals(self) -> list[tuple[float, int, int]]:
        """Takes the frontends' shared arrivals into the window now; every arrival the window holds."""
        if self.replanning is None:
            return []
        self._on_loop(self.replanning._take_shared_arrivals(), self.config.control_call_timeout_s)
        return list(self.replanning.window._seen)

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

    def abandon(self) -> None:
        """Its cluster is gone, and every worker with it (disagg.server ClusterWatch)."""
        self._stopping.set()
        self.launcher.abandon()

    def shutdown(self, remove_groups: bool = True) -> None:
        """Ends every instance of the deployment (the actor itself is killed by the caller)."""
        self._stopping.set()
        self.launcher.shutdown(remove_groups=remove_groups)
        try:
            self.registry.controller_gone()
        except RegistryUnavailable as exc:
            logger.warning("controller: %s", exc)


class ControllerActor(Controller):
    """The Controller as a process of its own (start_controller), logging as the workers do."""

    def __init__(self, *args):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        super().__init__(*args)


def start_controller(config: ServingConfig, redis_url: str, link_key: bytes, deployment_id: str,
                     worker_host: str | None, cpu_plan: CpuPlan | None):  # fmt: skip
    """The deployment's controller actor, detached, named, restarted by Ray whenever it dies."""
    return (
        ray.remote(ControllerActor)
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
