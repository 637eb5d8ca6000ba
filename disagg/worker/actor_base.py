"""What every worker actor shares: an engine step loop on its own thread, the request link
that routers call it on, and a heartbeat to the registry.

The request path does not go through Ray: routers call rank 0 over its request link
(disagg.rpc), serving the methods of the actor's service (disagg.rpc.services). They hand
commands to the engine thread (`StepLoop.submit`) and return futures that the engine thread
completes, replies and token streams leaving from there. Ray places the actors and runs their
lifecycle (`ready`, `status`, `shutdown`).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import ray
import torch

from disagg.hosts.addressing import resolve_host
from disagg.hosts.cpu_binding import keep_off_engine_cpus
from disagg.engine.distributed import RankPlace, join_instance
from disagg.engine.engine import resolve_device
from disagg.engine.model_card import ModelCard, model_card
from disagg.engine.step_loop import StepLoop
from disagg.errors import RegistryUnavailable
from disagg.config import WorkerConfig
from disagg.kv_transfer.layout import KVLayout
from disagg.registry import InstanceInfo, LoadReport, Registry
from disagg.rpc.server import Link, RpcServer
from disagg.worker.instance_world import InstanceWorld
from disagg.worker.shard_group import ShardGroup

logger = logging.getLogger(__name__)
MAX_REPORTED_STEPS = 128  # per heartbeat: bounds what one report weighs in Redis
MAX_PREFIX_HASHES = 4096  # likewise (about 80 kB of JSON at most)


class WorkerActorBase:
    role = ""
    service: type = object  # the disagg.rpc.services class the actor implements

    def __init__(self, config: WorkerConfig):
        """`config.host`: what the request link, the KV transport and the rank rendezvous listen
        on (and advertise); None: this node's IP, for a cluster of several nodes
        (disagg.hosts.addressing). `config.engine_cpus`: where the engine thread runs
        (disagg.hosts.cpu_binding); None: where the process may."""
        torch.set_num_threads(config.num_threads)
        self.config = config
        self.instance_id = config.instance_id
        self.role = str(config.role)
        self.actor_name = config.actor_name
        self.engine_config = config.engine
        self.host = resolve_host(config.host)
        self.rpc: RpcServer | None = None
        self._registry_url = config.registry_url
        self._heartbeat_interval_s = config.heartbeat_interval_s
        self._heartbeat_ttl_s = config.heartbeat_ttl_s
        engine_cpus = list(config.engine_cpus) if config.engine_cpus is not None else None
        self._heartbeat_enabled = threading.Event()
        self._heartbeat_enabled.set()
        self._heartbeat_lock = threading.Lock()  # a beat and a deregistration never interleave
        self._stopping = threading.Event()
        self._in_service = True
        self.loop = StepLoop(
            self._step, self._has_work, self._engine_commands(), name=f"engine-{self.instance_id}", cpus=engine_cpus
        )
        # What Ray started the process on; the engine's helper threads belong there too.
        self._framework_cpus = os.sched_getaffinity(0) if engine_cpus is not None else None
        self.shards: ShardGroup | None = None  # the other ranks of a TP x PP instance
        self._world: InstanceWorld | None = None  # where they met (rank 0 serves it)

    # ---- to be provided by the actor ---------------------------------------------------------
    def _kv_endpoint(self):
        """The worker's KV sender or receiver (None for a colocated worker)."""
        raise NotImplementedError

    def _handle_outputs(self, outputs) -> None:
        """After a step, on the engine thread: hand the step's results to whoever waits."""
        raise NotImplementedError

    def _fail_all(self, exc: Exception) -> None:
        """A step raised: end every request of the engine with an error."""
        raise NotImplementedError

    def _engine_commands(self) -> dict:
        """What other threads may ask of the engine thread: command type -> handler (StepLoop)."""
        raise NotImplementedError

    def _link_closed(self, link: Link) -> None:
        """A router went away: drop what only it was waiting for."""

    # ---- the engine thread ---------------------------------------------------------------------
    def _has_work(self) -> bool:
        # Requests waiting only for KV or for an ACK need no step: their endpoint wakes the loop.
        scheduler, endpoint = self.worker.engine.scheduler, self._kv_endpoint()
        busy = bool(scheduler.running or scheduler.waiting) or self.worker.needs_sync()
        return busy or (endpoint is not None and endpoint.has_finished())

    def _step(self) -> None:
        try:
            outputs = self.worker.step()
        except Exception as exc:
            if self.shards is not None:  # its ranks may be out of lockstep now
                self.shards.mark_broken(f"step failed: {type(exc).__name__}: {exc}")
            self._fail_all(exc)
            raise
        self._handle_outputs(outputs)

    def _leave_service(self, reason: str) -> None:
        """A multi-worker instance whose rank failed (died, or hangs in a collective) cannot
        trust any later step. Stop heartbeating and deregister, so that the router places
        nothing more here; its requests end with an error."""
        logger.error("instance %s leaves service: %s", self.instance_id, reason)
        self._in_service = False  # the launcher's supervisor relaunches it (when configured to)
        with self._heartbeat_lock:  # a beat under way would otherwise re-register it
            self._heartbeat_enabled.clear()
            self._deregister(coming_back=self.config.relaunched)

    async def in_service(self) -> bool:
        """False once a lost rank took the instance out of service (asked by the launcher)."""
        return self._in_service

    def load(self) -> LoadReport:
        raise NotImplementedError

    def instance_info(self) -> InstanceInfo:
        """What the registry shows about this instance."""
        p = self.engine_config.parallel
        layout = self.kv_layout()
        return InstanceInfo(
            self.instance_id,
            self.role,
            self.actor_name,
            self.worker.address(),
            self.engine_config.model,
            p.tensor_parallel_size,
            p.pipeline_parallel_size,
            kv_ranks=layout.to_list() if layout else [],
            rpc_address=self.rpc.address,
            expert_parallel_size=p.expert_parallel_size,
        )

    def model_card(self) -> ModelCard:
        """What a frontend needs of the model this instance serves, so that it reads no model
        files of its own (disagg.engine.model_card)."""
        engine = self.worker.engine
        tokenizer = engine.tokenizer.hf_tokenizer if engine.tokenizer is not None else None
        return model_card(engine.config.model, engine.model_config, tokenizer)

    def kv_layout(self) -> KVLayout | None:
        """Every rank's KV endpoint (None for a colocated instance, which moves no KV)."""
        return self.worker.kv_layout()

    # ---- several workers per instance ------------------------------------------------------------
    def _start_ranks(self, followers):
        """Rank 0 of a TP x PP instance: serve the rendezvous store, have the other ranks join
        and join too. Returns this rank's groups and a function that waits for the others to
        have loaded their shards; (None, None) for an instance of one worker."""
        if not followers:
            return None, None
        device = resolve_device(self.engine_config.device)
        self.shards = ShardGroup(
            followers,
            self.config.step_timeout_s,
            host=self.host,
            link_key=self.config.link_key,
            device=device,
            on_broken=self._leave_service,
        )
        self._world = InstanceWorld(self.instance_id, self.config.link_key, self.host, self.config.group_timeout_s)
        joining = self.shards.start_join(self._world.address)
        p = self.engine_config.parallel
        place = RankPlace(0, p.tensor_parallel_size, 0, p.pipeline_parallel_size)
        groups = join_instance(place, self._world.store(), device, self.host, self.config.group_timeout_s)
        return groups, lambda: self.shards.finish_join(joining)

    # ---- lifecycle ---------------------------------------------------------------------------
    def _start(self) -> None:
        self.loop.start()
        self.rpc = RpcServer(self, self.service, self.config.link_key, self.host, name=self.instance_id)
        self.rpc.on_link_closed = self._link_closed
        if self._registry_url:
            threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{self.instance_id}", daemon=True).start()

    async def ready(self) -> dict:
        """Awaited by the launcher: the engine is loaded and the loop runs."""
        return {
            "instance_id": self.instance_id,
            "role": self.role,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": self.host,
        }

    async def shutdown(self) -> None:
        self._stopping.set()
        self._deregister()
        self.rpc.close()
        self.loop.stop()
        if self.shards is not None:
            self.shards.shutdown()
            self._world.close()

    def set_heartbeat_enabled(self, enabled: bool) -> None:
        """Stop or resume heartbeats (draining an instance; also how tests simulate a lapse)."""
        (self._heartbeat_enabled.set if enabled else self._heartbeat_enabled.clear)()

    # ---- registry ------------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        registry = Registry(self._registry_url)
        while not self._stopping.wait(self._heartbeat_interval_s):
            if self._framework_cpus is not None:
                keep_off_engine_cpus(self.loop.thread_id, self._framework_cpus)
            with self._heartbeat_lock:
                if not self._heartbeat_enabled.is_set():
                    continue
                load = self.load()
                load.steps = self._recent_steps()
                load.prefix_hashes = self.worker.engine.block_manager.cached_hashes(MAX_PREFIX_HASHES)
                load.kv_paths = self.worker.kv_paths()
                try:
                    registry.heartbeat(self.instance_info(), load, self._heartbeat_ttl_s)
                except RegistryUnavailable as exc:  # keep serving; the next beat retries
                    logger.warning("heartbeat failed: %s", exc)
        registry.close()

    def _recent_steps(self) -> list[list]:
        """The engine's latest steps, each a `MeasuredStep.to_list()`: every report repeats the
        last MAX_REPORTED_STEPS, so a router that reads Redis less often than workers beat
        misses none (it learns each index once)."""
        try:
            latest = list(self.worker.engine.step_stats)[-MAX_REPORTED_STEPS:]
        except RuntimeError:  # appended to while copied: the next beat has them
            return []
        return [step.to_list() for step in latest]

    def _deregister(self, coming_back: bool = False) -> None:
        if not self._registry_url:
            return
        try:
            registry = Registry(self._registry_url)
            registry.deregister(self.instance_id, coming_back)
            registry.close()
        except RegistryUnavailable:
            pass


def engine_load(engine, num_waiting_for_kv: int = 0) -> LoadReport:
    """A snapshot readable from any thread (len() of the scheduler's queues is atomic)."""
    scheduler = engine.scheduler
    queued = sum(
        r.num_tokens - r.num_computed_tokens
        for r in list(scheduler.waiting) + list(scheduler.running)
        if r.num_computed_tokens < r.num_prompt_tokens
    )
    free, total = engine.num_free_blocks, engine.num_total_blocks
    context = sum(r.num_tokens for r in list(scheduler.running))
    return LoadReport(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + len(scheduler.suspended),  # suspended: waiting for a slot again
        num_waiting_for_kv=num_waiting_for_kv,
        queued_prefill_tokens=queued,
        num_free_blocks=free,
        num_total_blocks=total,
        kv_cache_usage=1.0 - free / total,
        updated_at=time.time(),
        decode_context_tokens=context,
        expert_tokens=engine.expert_tokens(),
    )
