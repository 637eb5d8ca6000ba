"""Starts the pools of worker actors on Ray, one placement group per instance, and relaunches
those that die.

A placement group holds the instance's TP x PP workers together. When the cluster has nodes
labelled with a custom resource named after the pool (`prefill`, `decode`, `colocated`), the
pool is pinned to them; on a single machine it goes anywhere.

Relaunch: Ray restarts a dead single-worker instance itself (`max_restarts`). A TP x PP instance
cannot be restarted rank by rank (its process groups need every rank anew), so `supervise()`
watches them: one that lost a rank (it takes itself out of service) or whose rank 0 died is
stopped whole and launched again under the same id, in a new placement group.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

import ray
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray._private.state import available_resources_per_node

from disagg.cluster.capacity import has_room
from disagg.hosts.addressing import LOOPBACK
from disagg.hosts.cpu_binding import CpuPlan
from disagg.config import POOL_LABEL_SLIVER, PoolConfig, Role, ServingConfig, WorkerConfig
from disagg.errors import ModelLoadError, UnavailableError
from disagg.supervision import FailureCounter, not_counted, supervise_thread

logger = logging.getLogger(__name__)
NAMESPACE = "disagg"
# How Ray reports a worker that refused to start with a ModelLoadError (a model it cannot load,
# memory its device does not have): the error's last line in the actor's creation traceback.
_REFUSED_START = re.compile(r"^disagg\.errors\.ModelLoadError: (.+)$", re.M)


def raise_refused_start(exc: BaseException) -> None:
    """Raise the ModelLoadError a worker refused to start with, when `exc` (Ray's report of an
    actor's death, or of a call that died of it) carries one: the worker's own message, whole."""
    refused = _REFUSED_START.findall(str(exc))
    if refused:
        raise ModelLoadError(refused[-1]) from exc


@dataclass
class LaunchedInstance:
    instance_id: str
    role: str
    actor_name: str
    actor: "ray.actor.ActorHandle"  # rank 0: schedules, and is what the router talks to
    placement_group: PlacementGroup
    shard_actors: list = field(default_factory=list)  # the other ranks of a TP x PP instance
    pool: PoolConfig | None = None
    index: int = 0  # within its pool
    relaunches: int = 0  # by the supervisor (Ray's own restarts of single workers not counted)


def wait_for_pool_nodes(config: ServingConfig, timeout_s: float, poll_s: float = 2.0) -> None:
    """Until the cluster has a node with each resource a pool names (its label): on a cluster
    that `ray up` starts, worker nodes join after the head, where `disagg serve` starts."""
    needed = {name for _, pool in config.pools() for name in pool.resources}
    deadline = time.monotonic() + timeout_s
    next_log = 0.0
    while missing := sorted(n for n in needed if ray.cluster_resources().get(n, 0) <= 0):
        now = time.monotonic()
        if now > deadline:
            raise UnavailableError(
                f"no node of the cluster has {missing} after {timeout_s:.0f} s (node labels: README)"
            )
        if now >= next_log:
            logger.info("waiting for nodes labelled %s to join the cluster", missing)
            next_log = now + 30.0
        time.sleep(poll_s)


class PoolLauncher:
    def __init__(
        self,
        config: ServingConfig,
        registry_url: str | None,
        link_key: bytes,
        worker_host: str | None = LOOPBACK,
        cpu_plan: CpuPlan | None = None,
        deployment_id: str | None = None,
        detached: bool = True,
    ):
        """`worker_host`: what every worker listens on; None: each its own node's IP (addressing).
        `cpu_plan`: the CPUs of each engine thread, on a one-node cluster we started (cpu_binding).
        `deployment_id`: in every instance's name (a new one when None); a launcher given the id of
        a deployment whose actors live adopts them instead of starting others (a restarted
        controller, disagg.controller). `detached`: the placement groups and workers outlive the
        process that launches them (a controller that Ray restarts); else they end with it."""
        self.config = config
        self.lifetime = "detached" if detached else None
        self.deployment_id = deployment_id or uuid.uuid4().hex[:6]
        self.cpu_plan = cpu_plan
        self.registry_url = registry_url
        self.link_key = link_key
        self.worker_host = worker_host
        self.instances: list[LaunchedInstance] = []
        self._lock = threading.Lock()  # self.instances, between the supervisor and shutdown
        self._stopping = threading.Event()

    def launch(self) -> list[LaunchedInstance]:
        """Every pool's instances, ready within the config's start_timeout_s (else stopped, and an
        error): those of this deployment still alive adopted, the others launched."""
        for role, pool in self.config.pools():
            for index in range(pool.num_instances):
                instance_id = f"{role}-{index}-{self.deployment_id}"
                adopted = self._adopt(role, pool, index, instance_id)
                self.instances.append(adopted or self._launch_one(role, pool, index, instance_id))
        self.instances += self._adopt_added()
        try:
            ray.get([inst.actor.ready.remote() for inst in self.instances], timeout=self.config.start_timeout_s)
        except Exception as exc:
            self.shutdown()
            raise_refused_start(exc)
            raise
        return self.instances

    def _adopt(self, role: str, pool: PoolConfig, index: int, instance_id: str) -> LaunchedInstance | None:
        """The instance as a launcher before this one left it (its actors are detached and named),
        in the role it serves now (a switch may have moved it); None, its leftovers removed, when
        its rank 0 is gone. A missing rank of a TP x PP instance takes it out of service, and the
        supervisor relaunches it whole."""
        actor_name = f"{NAMESPACE}-{instance_id}"
        actor = _named_actor(actor_name)
        group = _named_group(f"{NAMESPACE}-{instance_id}")
        shards = [_named_actor(_shard_name(actor_name, rank)) for rank in range(1, pool.workers_per_instance)]
        if actor is None or group is None:
            _kill_all([a for a in [actor, *shards] if a is not None], group)
            return None
        try:
            role = ray.get(actor.instance_info.remote(), timeout=self.config.control_call_timeout_s).role
        except Exception as exc:  # noqa: BLE001 - alive but not answering: out of service, relaunched
            logger.warning("adopted instance %s does not answer (%s); it will be relaunched", instance_id, exc)
        logger.info("adopted %s (%s, %d workers)", instance_id, role, pool.workers_per_instance)
        live_shards = [a for a in shards if a is not None]
        return LaunchedInstance(instance_id, role, actor_name, actor, group, live_shards, pool, index)

    def _bundle(self, role: str, pool: PoolConfig) -> dict[str, float]:
        """What each worker of one of the pool's instances takes (its placement group's bundle)."""
        return {
            "CPU": pool.num_cpus_per_worker,
            **({"GPU": pool.num_gpus_per_worker} if pool.num_gpus_per_worker else {}),
            **pool.resources,
            **self._pin(role),
        }

    def _adopt_added(self) -> list[LaunchedInstance]:
        """The instances the re-planner added (`add`) before this launcher, still alive: found by
        name, beyond the configured pools."""
        known = {i.instance_id for i in self.instances}
        pools = dict(self.config.pools())
        pattern = re.compile(rf"{NAMESPACE}-(\w+)-(\d+)-{re.escape(self.deployment_id)}")
        adopted = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            found = pattern.fullmatch(entry["name"]) if entry["namespace"] == NAMESPACE else None
            if found is None or found.group(1) not in pools:
                continue
            role, index = found.group(1), int(found.group(2))
            instance_id = f"{role}-{index}-{self.deployment_id}"
            if instance_id not in known and (inst := self._adopt(role, pools[role], index, instance_id)):
                adopted.append(inst)
        return adopted

    def _launch_one(self, role: str, pool: PoolConfig, index: int, instance_id: str) -> LaunchedInstance:
        bundle = self._bundle(role, pool)
        # Tensor-parallel ranks all-reduce every layer: without pipeline stages, one node only.
        strategy = "STRICT_PACK" if pool.pipeline_parallel_size == 1 else "PACK"
        # Detached, as the actors: the group outlives the controller that made it (disagg.controller).
        group = placement_group(
            [bundle] * pool.workers_per_instance, strategy=strategy, name=f"{NAMESPACE}-{instance_id}",
            lifetime=self.lifetime,
        )  # fmt: skip
        try:
            ray.get(group.ready(), timeout=60)
        except Exception as exc:
            remove_placement_group(group)
            raise UnavailableError(f"cannot place {instance_id}: the cluster lacks {bundle} ({exc})") from exc
        actor_name = f"{NAMESPACE}-{instance_id}"
        options = self._worker_options(pool, group, 0, self.lifetime)
        options["name"], options["namespace"] = actor_name, NAMESPACE
        if pool.workers_per_instance == 1:
            # Ray relaunches a dead worker with the same config: it reloads, re-registers (at a new
            # link address) and routers use it again. Not a TP x PP instance's ranks: its process
            # groups need every rank rebuilt, so `supervise` relaunches the whole instance.
            options["max_restarts"] = self.config.max_worker_restarts
        relaunched = pool.workers_per_instance > 1 and self.config.max_worker_restarts != 0
        engine_cpus = self.cpu_plan.engine_cpus(role, index) if self.cpu_plan else None
        config = WorkerConfig(
            instance_id=instance_id,
            role=Role(role),
            engine=self.config.pool_engine_config(pool, index),
            registry_url=self.registry_url,
            host=self.worker_host,
            kv_timeout_s=self.config.kv_timeout_s,
            kv_transport=self.config.kv_transport,
            num_threads=self.config.worker_threads(pool, index),
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            heartbeat_ttl_s=self.config.heartbeat_ttl_s,
            drain_timeout_s=self.config.drain_timeout_s,
            step_timeout_s=self.config.step_timeout_s,
            group_timeout_s=self.config.group_timeout_s,
            actor_name=actor_name,
            engine_cpus=tuple(sorted(engine_cpus)) if engine_cpus is not None else None,
            link_key=self.link_key,
            relaunched=relaunched,
        )
        shards = self._launch_shards(pool, group, config, actor_name)
        from disagg.worker.actor import WorkerActor

        actor = ray.remote(WorkerActor).options(**options).remote(config, followers=shards or None)
        logger.info("launched %s (%d workers)", instance_id, pool.workers_per_instance)
        return LaunchedInstance(
            instance_id, role, actor_name, actor, group, [handle for _, handle in shards], pool, index
        )

    def _launch_shards(self, pool: PoolConfig, group: PlacementGroup, rank0: WorkerConfig, rank0_name: str) -> list:
        """Ranks 1.. of a TP x PP instance, one per bundle of its placement group; rank 0 (the
        worker actor) makes them all join its process groups."""
        # Here, not at the top: torch (behind RankPlace) would add seconds to every start of the
        # controller, which Ray restarts when it dies.
        from disagg.engine.distributed import RankPlace
        from disagg.worker.shard import ShardActor

        shards = []
        for rank in range(1, pool.workers_per_instance):
            place = RankPlace.of_rank(rank, pool.tensor_parallel_size, pool.pipeline_parallel_size)
            parallel = replace(rank0.engine.parallel, tp_rank=place.tp_rank, pp_rank=place.pp_rank)
            config = rank0.replace(
                engine=rank0.engine.replace(parallel=parallel), registry_url=None, actor_name="", engine_cpus=None
            )
            options = self._worker_options(pool, group, rank, self.lifetime)
            options["name"], options["namespace"] = _shard_name(rank0_name, rank), NAMESPACE
            actor = ray.remote(ShardActor).options(**options).remote(config)
            shards.append((place, actor))
        return shards

    @staticmethod
    def _worker_options(pool: PoolConfig, group: PlacementGroup, bundle: int, lifetime: str | None) -> dict:
        # Detached: a worker outlives the process that launched it (the controller, which Ray
        # restarts and which adopts it again); `disagg stop` or the launcher's shutdown ends it.
        return dict(
            num_cpus=pool.num_cpus_per_worker,
            num_gpus=pool.num_gpus_per_worker,
            max_restarts=0,
            lifetime=lifetime,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
        )

    @staticmethod
    def _pin(role: str) -> dict:
        return {role: POOL_LABEL_SLIVER} if ray.cluster_resources().get(role, 0) > 0 else {}

    # ---- relaunching TP x PP instances ----------------------------------------------------------
    def supervise(self, interval_s: float = 2.0, on_failure: FailureCounter = not_counted) -> None:
        """Watch the multi-worker instances from a thread; relaunch one that is out of service,
        at most `max_worker_restarts` times each (-1: always). The watch is restarted if it
        raises, and `on_failure("relaunch")` counts it (disagg.supervision)."""
        if self.config.max_worker_restarts == 0 or not any(i.shard_actors for i in self.instances):
            return
        args = ("relaunch", functools.partial(self._supervise, interval_s), self._stopping, on_failure)
        threading.Thread(target=supervise_thread, args=args, name="instance-supervisor", daemon=True).start()

    def _supervise(self, interval_s: float) -> None:
        while not self._stopping.wait(interval_s):
            with self._lock:
                watched = [i for i in self.instances if i.shard_actors]
            for inst in watched:
                if self._stopping.is_set() or self._in_service(inst) or not self._may_relaunch(inst):
                    continue
                try:
                    self._relaunch(inst)
                except Exception as exc:  # keep watching the others; this one is retried next round
                    logger.error("relaunch of %s failed: %s", inst.instance_id, exc)

    def _in_service(self, inst: LaunchedInstance) -> bool:
        try:
            return ray.get(inst.actor.in_service.remote(), timeout=self.config.control_call_timeout_s)
        except Exception:  # rank 0 died (or hangs): out of service too
            return False

    def _may_relaunch(self, inst: LaunchedInstance) -> bool:
        limit = self.config.max_worker_restarts
        return limit < 0 or inst.relaunches < limit

    def _relaunch(self, inst: LaunchedInstance) -> None:
        logger.warning("instance %s is out of service; relaunching it (all %d ranks)", inst.instance_id,
                       1 + len(inst.shard_actors))  # fmt: skip
        _kill(inst, remove_group=True)  # no shutdown(): that would deregister it for good
        fresh = self._launch_one(inst.role, inst.pool, inst.index, inst.instance_id)
        fresh.relaunches = inst.relaunches + 1
        with self._lock:
            if self._stopping.is_set():  # shut down meanwhile: this one is ours to stop
                _kill(fresh, remove_group=True)
                return
            self.instances[self.instances.index(inst)] = fresh
        ray.get(fresh.actor.ready.remote(), timeout=self.config.start_timeout_s)
        logger.info("instance %s is back (relaunch %d)", inst.instance_id, fresh.relaunches)

    # ---- scaling (the re-planner's, issue 53) ----------------------------------------------------
    def room_for(self, role: str) -> bool:
        """Whether the cluster has room now for one more whole instance of `role`'s pool."""
        pool = dict(self.config.pools())[role]
        nodes = list(available_resources_per_node().values())
        return has_room(nodes, self._bundle(role, pool), pool.workers_per_instance, pool.pipeline_parallel_size == 1)

    def add(self, role: str) -> LaunchedInstance:
        """One more instance of `role`'s pool, launched and ready (else removed, and an error)."""
        pool = dict(self.config.pools())[role]
        with self._lock:
            index = 1 + max((i.index for i in self.instances), default=-1)
        fresh = self._launch_one(role, pool, index, f"{role}-{index}-{self.deployment_id}")
        try:
            ray.get(fresh.actor.ready.remote(), timeout=self.config.start_timeout_s)
        except Exception:
            _kill(fresh, remove_group=True)
            raise
        with self._lock:
            if self._stopping.is_set():  # shut down meanwhile: this one is ours to stop
                _kill(fresh, remove_group=True)
                raise UnavailableError(f"the deployment stopped while {fresh.instance_id} started")
            self.instances.append(fresh)
        return fresh

    def remove(self, instance_id: str, timeout_s: float = 15.0) -> None:
        """Stop one instance (it holds no requests: the re-planner drained it) and release its group."""
        with self._lock:
            found = [i for i in self.instances if i.instance_id == instance_id]
            self.instances = [i for i in self.instances if i.instance_id != instance_id]
        self._stop_all(found, timeout_s, remove_groups=True)

    def switched(self, instance_id: str, role: str) -> None:
        """An instance now serves in `role` (the re-planner switched it)."""
        with self._lock:
            for inst in self.instances:
                if inst.instance_id == instance_id:
                    inst.role = role

    def abandon(self) -> None:
        """The cluster is gone, and every worker with it: nothing to stop, and no Ray call
        would return."""
        self._stopping.set()
        with self._lock:
            self.instances = []

    def shutdown(self, timeout_s: float = 15.0, remove_groups: bool = True) -> None:
        """Stop every actor (deregistering it) and release its placement group.

        Bounded: after Ctrl-C the terminal's SIGINT may already have taken Ray's own processes
        down, and then Ray calls can block; the teardown runs on a thread we stop waiting for.
        """
        self._stopping.set()
        with self._lock:
            instances, self.instances = self.instances, []
        worker = threading.Thread(target=self._stop_all, args=(instances, timeout_s, remove_groups), daemon=True)
        worker.start()
        worker.join(timeout_s + 5)
        if worker.is_alive():
            logger.warning("worker teardown did not finish in %.0fs; leaving it to ray.shutdown()", timeout_s + 5)

    @staticmethod
    def _stop_all(instances: list[LaunchedInstance], timeout_s: float, remove_groups: bool) -> None:
        try:
            ray.get([inst.actor.shutdown.remote() for inst in instances], timeout=timeout_s)
        except Exception as exc:  # dead or stuck actors are killed below anyway
            logger.warning("some workers did not shut down cleanly: %s", exc)
        for inst in instances:
            _kill(inst, remove_groups)


def kill_deployment(deployment_id: str) -> int:
    """Every named actor and placement group of deployment `deployment_id`, killed and removed
    without asking anyone (its controller is gone or does not answer); how many actors."""
    named = ray.util.list_named_actors(all_namespaces=True)
    actors = [_named_actor(n["name"]) for n in named if n["namespace"] == NAMESPACE and deployment_id in n["name"]]
    _kill_all([a for a in actors if a is not None], None)
    for group in ray.util.placement_group_table().values():
        if deployment_id in (group.get("name") or "") and group.get("state") != "REMOVED":
            with contextlib.suppress(Exception):
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group["placement_group_id"]))))
    return len(actors)


def _kill(inst: LaunchedInstance, remove_group: bool) -> None:
    _kill_all([inst.actor, *inst.shard_actors], inst.placement_group if remove_group else None)


def _kill_all(actors: list, group: PlacementGroup | None) -> None:
    for actor in actors:
        with contextlib.suppress(Exception):  # gone already
            ray.kill(actor, no_restart=True)
    if group is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(group)


def _shard_name(rank0_name: str, rank: int) -> str:
    return f"{rank0_name}-rank{rank}"


def _named_actor(name: str):
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def _named_group(name: str) -> PlacementGroup | None:
    try:
        return get_placement_group(name)
    except ValueError:
        return None
