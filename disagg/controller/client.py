"""The server's handle on its deployment's controller (disagg.controller.controller): what it
asked of the launcher before the launcher moved into the controller. Two of them, one interface:
ControllerClient for a detached controller actor (each call a bounded Ray call), and
InProcessController for one that runs in the server's own process (a deployment that ends with
it: tests, benchmarks), whose start costs no process of its own."""

from __future__ import annotations

import contextlib
import logging

import ray

from disagg.cluster.launcher import LaunchedInstance, kill_deployment, raise_refused_start
from disagg.config import ServingConfig
from disagg.controller.controller import Controller, start_controller
from disagg.router.replanning import LoggedDecision, SwitchRecord
from disagg.hosts.cpu_binding import CpuPlan

logger = logging.getLogger(__name__)


class ControllerClient:
    def __init__(self, actor, deployment_id: str, call_timeout_s: float, redis_url: str = ""):
        self.actor = actor
        self.redis_url = redis_url  # the deployment's registry
        self.deployment_id = deployment_id
        self.call_timeout_s = call_timeout_s
        self._abandoned = False

    @classmethod
    def start(cls, config: ServingConfig, redis_url: str, link_key: bytes, deployment_id: str,
              worker_host: str | None, cpu_plan: CpuPlan | None) -> "ControllerClient":  # fmt: skip
        """A new deployment's controller, once it has launched every instance (else an error,
        and it is stopped)."""
        actor = start_controller(config, redis_url, link_key, deployment_id, worker_host, cpu_plan)
        client = cls(actor, deployment_id, config.control_call_timeout_s, redis_url)
        try:
            ray.get(actor.ready.remote(config.start_timeout_s), timeout=config.start_timeout_s + 30)
        except BaseException as exc:
            client.shutdown()
            raise_refused_start(exc)  # through the controller too: the worker's message, not Ray's wrapping
            raise
        return client

    @property
    def instances(self) -> list[LaunchedInstance]:
        """The instances as the controller holds them now (a relaunched one anew)."""
        return ray.get(self.actor.instances.remote(), timeout=self.call_timeout_s)

    def switched(self, instance_id: str, role: str) -> None:
        ray.get(self.actor.switched.remote(instance_id, role), timeout=self.call_timeout_s)

    def register_frontend(self, index: int, grpc_address: str, http_address: str | None) -> None:
        ray.get(self.actor.register_frontend.remote(index, grpc_address, http_address), timeout=self.call_timeout_s)

    def replan_log(self) -> list[LoggedDecision]:
        return ray.get(self.actor.replan_log.remote(), timeout=self.call_timeout_s)

    def replan_metrics(self) -> list[dict]:
        return ray.get(self.actor.replan_metrics.remote(), timeout=self.call_timeout_s)

    def replan_switch(self, from_role: str, to_role: str, timeout_s: float = 120.0) -> SwitchRecord | None:
        """One switch now, as a decision would (tests, operators)."""
        return ray.get(self.actor.replan_switch.remote(from_role, to_role), timeout=timeout_s)

    def replan_scale(self, role: str, delta: int, timeout_s: float = 300.0) -> SwitchRecord | None:
        """One instance added (delta 1) or removed (-1) now, as a decision would (tests, operators)."""
        return ray.get(self.actor.replan_scale.remote(role, delta), timeout=timeout_s)

    def replan_take_arrivals(self) -> list[tuple[float, int, int]]:
        return ray.get(self.actor.replan_take_arrivals.remote(), timeout=self.call_timeout_s)

    def abandon(self) -> None:
        """The cluster is gone with the controller and the workers: nothing to stop."""
        self._abandoned = True

    def shutdown(self, timeout_s: float = 15.0, remove_groups: bool = True) -> None:
        """The controller stops every instance, then it is killed for good (bounded: after
        Ctrl-C, Ray's own processes may be going)."""
        if self._abandoned:
            return
        try:
            ray.get(self.actor.shutdown.remote(remove_groups), timeout=timeout_s + 10)
        except Exception as exc:  # noqa: BLE001 - its actors are killed by name instead
            logger.warning("the controller did not stop the workers (%s); killing them by name", exc)
            with contextlib.suppress(Exception):
                kill_deployment(self.deployment_id)
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)


class InProcessController:
    """The deployment's Controller in this process, behind ControllerClient's interface."""

    actor = None  # no actor: frontend replicas get no controller to ask

    def __init__(self, controller: Controller, deployment_id: str, redis_url: str):
        self.controller = controller
        self.deployment_id = deployment_id
        self.redis_url = redis_url

    @classmethod
    def start(cls, config: ServingConfig, redis_url: str, link_key: bytes, deployment_id: str,
              worker_host: str | None, cpu_plan: CpuPlan | None) -> "InProcessController":  # fmt: skip
        """Once it has launched every instance (else an error, and it is stopped)."""
        controller = Controller(config, redis_url, link_key, deployment_id, worker_host, cpu_plan, detached=False)
        client = cls(controller, deployment_id, redis_url)
        try:
            controller.ready(config.start_timeout_s + 30)
        except BaseException:
            client.shutdown()
            raise
        return client

    @property
    def instances(self) -> list[LaunchedInstance]:
        return self.controller.instances()

    def switched(self, instance_id: str, role: str) -> None:
        self.controller.switched(instance_id, role)

    def register_frontend(self, index: int, grpc_address: str, http_address: str | None) -> None:
        self.controller.register_frontend(index, grpc_address, http_address)

    def replan_log(self) -> list[LoggedDecision]:
        return self.controller.replan_log()

    def replan_metrics(self) -> list[dict]:
        return self.controller.replan_metrics()

    def replan_switch(self, from_role: str, to_role: str, timeout_s: float = 120.0) -> SwitchRecord | None:
        return self.controller.replan_switch(from_role, to_role)

    def replan_scale(self, role: str, delta: int, timeout_s: float = 300.0) -> SwitchRecord | None:
        return self.controller.replan_scale(role, delta)

    def replan_take_arrivals(self) -> list[tuple[float, int, int]]:
        return self.controller.replan_take_arrivals()

    def abandon(self) -> None:
        self.controller.abandon()

    def shutdown(self, timeout_s: float = 15.0, remove_groups: bool = True) -> None:
        self.controller.shutdown(remove_groups)
