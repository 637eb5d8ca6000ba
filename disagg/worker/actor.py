"""The worker: rank 0 of an instance, as a Ray actor, in whichever role it holds now.

It serves both request-path services (disagg.rpc.services) on its request link (disagg.rpc),
and holds its role as an object built around the engine it shares: a PrefillRole
(disagg.prefill_worker) or a DecodeRole (disagg.decode_worker; COLOCATED too), as vLLM's
engine holds its KV connector's role. Each service method is one line that runs the role's own
method on the engine thread, between steps (`_run`); a call for the role it does not hold is
refused by one check (`_holding`), its error going back over the link. Replies and token streams
leave from the engine thread itself. Ray places the actor and runs its lifecycle (`ready`,
`status`, `switch_role`, `drain`, `shutdown`); it is not on a request's path.

`switch_role` replaces the role between steps, once the instance holds nothing (the router
drained it first): the new role is built around the same engine, weights and KV memory
untouched, on new KV endpoints, and only then is the old one closed; the next heartbeat
registers the instance in its new pool. A switch that fails leaves the old role as it was.
Ray relaunches a dead instance with the arguments it was created with, so one that dies after
a switch comes back in its first role, whole.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import ray
import torch

from disagg.config import Role, WorkerConfig
from disagg.decode_worker.role import DecodeRole
from disagg.engine.distributed import RankPlace, join_instance
from disagg.engine.engine import LLMEngine, resolve_device
from disagg.engine.model_card import ModelCard, model_card
from disagg.engine.step_loop import StepLoop
from disagg.errors import UnavailableError
from disagg.hosts.addressing import resolve_host
from disagg.hosts.cpu_binding import keep_off_engine_cpus
from disagg.kv_transfer.factory import role_transports
from disagg.kv_transfer.layout import KVLayout
from disagg.prefill_worker.role import PrefillRole
from disagg.registry import InstanceInfo, LoadReport
from disagg.request import SamplingParams
from disagg.rpc.messages import Reservation
from disagg.rpc.server import Link, RpcServer
from disagg.rpc.services import WorkerService
from disagg.worker import sigterm
from disagg.worker.heartbeat import MAX_PREFIX_HASHES, Heartbeat, engine_load, recent_steps
from disagg.worker.instance_world import InstanceWorld
from disagg.worker.prefix_publisher import PrefixPublisher
from disagg.worker.shard_group import ShardGroup

logger = logging.getLogger(__name__)
SWITCHABLE_ROLES = (Role.PREFILL, Role.DECODE)

HeldRole = PrefillRole | DecodeRole


class WorkerActor(WorkerService):
    def __init__(self, config: WorkerConfig, followers=None):
        """`config.host`: what the request link, the KV transport and the rank rendezvous listen
        on (and advertise); None: this node's IP (disagg.hosts.addressing). `config.engine_cpus`:
        where the engine thread runs (disagg.hosts.cpu_binding); None: where the process may.
        `followers`: [(RankPlace, ShardActor handle)] of the other ranks of a TP x PP instance."""
        torch.set_num_threads(config.num_threads)
        self.config = config
        self.instance_id = config.instance_id
        self.actor_name = config.actor_name
        self.host = resolve_host(config.host)
        engine_cpus = list(config.engine_cpus) if config.engine_cpus is not None else None
        self.loop = StepLoop(self._step, self._has_work, name=f"engine-{self.instance_id}", cpus=engine_cpus)
        # What Ray started the process on; the engine's helper threads belong there too.
        self._framework_cpus = os.sched_getaffinity(0) if engine_cpus is not None else None
        self._in_service = True
        self._draining = threading.Event()
        self._generation = itertools.count(1)  # each role's KV endpoints get ids of their own
        self.shards: ShardGroup | None = None  # the other ranks of a TP x PP instance
        self._world: InstanceWorld | None = None  # where they met (rank 0 serves it)
        groups, wait_for_ranks = self._start_ranks(followers)
        self.role: HeldRole = self._new_role(config.role, self.instance_id, groups=groups)
        if wait_for_ranks is not None:
            wait_for_ranks()
        self.heartbeat = Heartbeat(
            config.registry_url, config.heartbeat_interval_s, config.heartbeat_ttl_s, self._report, self._rebind
        )
        self.prefix_publisher = PrefixPublisher(
            config.registry_url,
            self.instance_id,
            lambda: self.role.engine,
            config.heartbeat_interval_s,
            config.heartbeat_ttl_s,
        )
        self._catch_sigterm()
        self.loop.start()
        self.rpc = RpcServer(
            self, WorkerService, config.link_key, self.host, name=self.instance_id, on_link_closed=self._link_closed
        )
        self.heartbeat.start(self.instance_id)
        self.prefix_publisher.start()

    # ---- PrefillService (each on the calling link's thread: one line into the role) -----------
    def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> Future:
        return self._run(PrefillRole.prefill, request_id, prompt_token_ids, params, priority, self.rpc.caller())

    def set_kv_targets(self, request_id: str, reservation: Reservation) -> Future:
        return self._now(PrefillRole.set_kv_targets, request_id, reservation)  # before the next layer goes out

    # ---- DecodeService ---------------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill: KVLayout,
        kv_wait_s: float,
        priority: int = 0,
    ) -> Future:
        caller = self.rpc.caller()
        return self._run(DecodeRole.reserve, request_id, prompt_token_ids, params, prefill, kv_wait_s, priority, caller)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> Future:
        return self._run(DecodeRole.submit, request_id, prompt_token_ids, params, priority, self.rpc.caller())

    def migration_layout(self) -> KVLayout | None:
        return self._now(DecodeRole.migration_layout)

    def reserve_migration(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        num_prompt_tokens: int,
        source: KVLayout,
        capacity_tokens: int,
        kv_wait_s: float,
        priority: int = 0,
    ) -> Future:
        return self._run(
            DecodeRole.reserve_migration, request_id, token_ids, params, num_prompt_tokens, source, capacity_tokens,
            kv_wait_s, priority, self.rpc.caller(),
        )  # fmt: skip

    def migrate_out(self, request_id: str, reservation: Reservation) -> Future:
        return self._run(DecodeRole.migrate_out, request_id, reservation)  # answered once it paused here

    # ---- PeerBlockService -------------------------------------------------------------------------
    def peer_export_layout(self) -> KVLayout | None:
        return self.role.peer_export_layout()  # fixed: answered from any thread

    def reserve_peer_import(self, import_id: str, token_ids: list[int], num_blocks: int, source: KVLayout) -> Future:
        return self._run(PrefillRole.reserve_peer_import, import_id, token_ids, num_blocks, source)

    def export_prefix(self, export_id: str, token_ids: list[int], num_blocks: int, slot: Reservation) -> Future:
        return _answer_of(self.loop.submit(self._export_prefix, export_id, token_ids, num_blocks, slot))

    def _export_prefix(self, export_id: str, token_ids: list[int], num_blocks: int, slot: Reservation) -> Future:
        return self.role.export_prefix(export_id, token_ids, num_blocks, slot)  # either role's: both lend blocks

    # ---- both ------------------------------------------------------------------------------------
    def abort(self, request_id: str) -> Future:
        return self.loop.submit(self._abort, request_id)

    def _abort(self, request_id: str) -> bool:
        return self.role.abort(request_id)  # either role's: both take aborts

    # ---- the one dispatch ------------------------------------------------------------------------
    def _run(self, method: Callable, *args) -> Future:
        """`method` (a role's) on the engine thread, between steps, on the role held then; the
        Future is its answer (a Future it returns is waited for)."""
        return _answer_of(self.loop.submit(self._held_role_runs, method, args))

    def _held_role_runs(self, method: Callable, args: tuple):
        return method(self._holding(method), *args)

    def _now(self, method: Callable, *args):
        """`method` (a role's, safe from any thread) now, on this thread."""
        return method(self._holding(method), *args)

    def _holding(self, method: Callable) -> HeldRole:
        """The role held now, if `method` is its own: a call of the other role's (a router that
        placed on the registry's view of a moment ago) is refused, not run in the wrong role."""
        role = self.role
        if getattr(type(role), method.__name__, None) is not method:
            raise UnavailableError(f"instance {self.instance_id} serves {role.kind} now: {method.__qualname__} refused")
        return role

    def _link_closed(self, link: Link) -> None:
        """A router went away (on its link's thread): drop what only it was waiting for."""
        self.loop.submit(self._drop_link, link)

    def _drop_link(self, link: Link) -> None:
        self.role.drop_link(link)

    # ---- the engine thread -----------------------------------------------------------------------
    def _has_work(self) -> bool:
        return self.role.has_work()

    def _step(self) -> None:
        try:
            self.role.step()
        except Exception as exc:
            if self.shards is not None:  # its ranks may be out of lockstep now
                self.shards.mark_broken(f"step failed: {type(exc).__name__}: {exc}")
            self.role.fail_all(exc)
            raise

    # ---- switching roles -------------------------------------------------------------------------
    async def switch_role(self, role: str) -> bool:
        """Once the engine thread switched (True; or it holds that role already) or refused:
        ValueError while the instance holds requests, the old role unchanged."""
        return await asyncio.wrap_future(self.loop.submit(self._switch, Role(role)))

    def _switch(self, role: Role) -> bool:
        old = self.role
        if role is old.kind:
            return True
        if role not in SWITCHABLE_ROLES or old.kind not in SWITCHABLE_ROLES:
            raise ValueError(f"switch: from {old.kind} to {role}? only prefill and decode switch")
        if self.shards is not None:
            raise ValueError("switch: an instance of several ranks cannot switch roles yet")
        if not old.is_idle():  # before any endpoint is built: nothing to undo
            raise ValueError("switch: the instance still holds requests; drain it first")
        self.role = self._new_role(role, f"{self.instance_id}~{next(self._generation)}", engine=old.engine)
        old.close()
        self.prefix_publisher.mark_incomplete()  # the new role's pool starts empty
        logger.info("instance %s switched from %s to %s", self.instance_id, old.kind, role)
        return True

    def _new_role(self, role: Role, transport_id: str, *, engine: LLMEngine | None = None, groups=None) -> HeldRole:
        """The role's object around `engine` (None: a new one, loading the weights), on new KV
        endpoints named `transport_id`."""
        c = self.config
        transports = role_transports(
            c.kv_transport, role, transport_id, c.link_key, self.host, c.engine.device, one_rank=self.shards is None
        )
        common = dict(kv_timeout=c.kv_timeout_s, wake=self.loop.wake, groups=groups, followers=self.shards)
        try:
            peers = dict(export_transport=transports.exports)
            if role is Role.PREFILL:
                return PrefillRole(c.engine, transports.kv, engine=engine, import_transport=transports.imports,
                                   **peers, **common)  # fmt: skip
            return DecodeRole(c.engine, transports.kv, migration_transport=transports.moves, engine=engine, **peers,
                              **common)  # fmt: skip
        except BaseException:
            transports.close()
            raise

    # ---- leaving -----------------------------------------------------------------------------------
    def drain(self, exit_when_done: bool = False) -> None:
        """Leave service: no new requests; routers move the ones here away with their KV (or, where
        they cannot, let them finish here). With `exit_when_done`, the process ends once it holds
        none, or after the config's drain_timeout_s (what is left then migrates by recompute)."""
        if self._draining.is_set():
            return
        self._draining.set()
        self.heartbeat.beat_now()  # the routers stop placing here within a refresh, not a beat later
        logger.info("instance %s draining", self.instance_id)
        if exit_when_done:
            threading.Thread(target=self._exit_when_drained, name="drain", daemon=True).start()

    def resume_service(self) -> None:
        """Back in service after a drain without exit (a role switch that failed, a benchmark)."""
        self._draining.clear()

    def _catch_sigterm(self) -> None:
        """SIGTERM drains, then exits (the default would drop every request here at once)."""
        if not sigterm.install(lambda: self.drain(exit_when_done=True)):
            logger.warning("instance %s: SIGTERM cannot be caught here; it ends the process at once", self.instance_id)

    def _exit_when_drained(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while time.monotonic() < deadline and not self.role.is_idle():
            time.sleep(0.1)
        time.sleep(0.5)  # the last deltas and acknowledgements leave
        self.heartbeat.deregister(self.instance_id)
        os._exit(0)

    def _leave_service(self, reason: str) -> None:
        """A multi-worker instance whose rank failed (died, or hangs in a collective) cannot
        trust any later step. Stop heartbeating and deregister, so that the router places
        nothing more here; its requests end with an error."""
        logger.error("instance %s leaves service: %s", self.instance_id, reason)
        self._in_service = False  # the launcher's supervisor relaunches it (when configured to)
        self.heartbeat.leave(self.instance_id, coming_back=self.config.relaunched)

    async def in_service(self) -> bool:
        """False once a lost rank took the instance out of service (asked by the launcher)."""
        return self._in_service

    # ---- what it is and how loaded -----------------------------------------------------------------
    def load(self) -> LoadReport:
        load = engine_load(self.role.engine)
        load.draining = self._draining.is_set()
        return load

    def instance_info(self) -> InstanceInfo:
        """What the registry shows about this instance."""
        p = self.config.engine.parallel
        layout = self.kv_layout()
        return InstanceInfo(
            self.instance_id,
            str(self.role.kind),
            self.actor_name,
            self.role.address(),
            self.config.engine.model,
            p.tensor_parallel_size,
            p.pipeline_parallel_size,
            kv_ranks=layout.to_list() if layout else [],
            rpc_address=self.rpc.address,
            expert_parallel_size=p.expert_parallel_size,
        )

    def kv_layout(self) -> KVLayout | None:
        """Every rank's KV endpoint (None for a colocated instance, which moves no KV)."""
        return self.role.kv_layout()

    def model_card(self) -> ModelCard:
        """What a frontend needs of the model this instance serves, so that it reads no model
        files of its own (disagg.engine.model_card)."""
        engine = self.role.engine
        tokenizer = engine.tokenizer.hf_tokenizer if engine.tokenizer is not None else None
        return model_card(engine.config.model, engine.model_config, tokenizer, engine.kv_cache.tensor.element_size())

    async def status(self) -> dict:
        return {"load": self.load(), **self.role.status(), "role": str(self.role.kind)}

    def _report(self) -> tuple[InstanceInfo, LoadReport]:
        """A heartbeat's: the instance and its load, with its latest steps and cached prefixes."""
        role = self.role
        load = self.load()
        load.steps = recent_steps(role.engine)
        load.prefix_hashes = role.engine.block_manager.cached_hashes(MAX_PREFIX_HASHES)
        load.kv_paths = role.kv_paths()
        if role.engine.kv_tiers is not None:
            load.kv_tiers = {**role.engine.kv_tiers.report(), "index": self.prefix_publisher.report()}
        fetched = role.peers.report()
        if fetched and (load.kv_tiers or fetched["fetched_blocks"]):  # shown where the tiers are
            load.kv_tiers = {**load.kv_tiers, "peer": fetched}
        return self.instance_info(), load

    def _rebind(self) -> None:
        if self._framework_cpus is not None:
            keep_off_engine_cpus(self.loop.thread_id, self._framework_cpus)

    # ---- several workers per instance --------------------------------------------------------------
    def _start_ranks(self, followers):
        """Rank 0 of a TP x PP instance: serve the rendezvous store, have the other ranks join
        and join too. Returns this rank's groups and a function that waits for the others to
        have loaded their shards; (None, None) for an instance of one worker."""
        if not followers:
            return None, None
        device = resolve_device(self.config.engine.device)
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
        p = self.config.engine.parallel
        place = RankPlace(0, p.tensor_parallel_size, 0, p.pipeline_parallel_size)
        groups = join_instance(place, self._world.store(), device, self.host, self.config.group_timeout_s)
        return groups, lambda: self.shards.finish_join(joining)

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def ready(self) -> dict:
        """Awaited by the launcher: the engine is loaded and the loop runs."""
        return {
            "instance_id": self.instance_id,
            "role": str(self.role.kind),
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": self.host,
        }

    async def shutdown(self) -> None:
        self.heartbeat.stop(self.instance_id)
        self.prefix_publisher.stop()
        self.rpc.close()
        self.loop.stop()
        if self.shards is not None:
            self.shards.shutdown()
            self._world.close()

    def set_heartbeat_enabled(self, enabled: bool) -> None:
        """Stop or resume heartbeats (draining an instance; also how tests simulate a lapse)."""
        self.heartbeat.set_enabled(enabled)


def _answer_of(call: Future) -> Future:
    """The answer of a call run on the engine thread: its result, or, when that is a Future
    (a first token, a pause), that Future's outcome once it has one."""
    answer: Future = Future()
    call.add_done_callback(lambda done: _follow(done, answer))
    return answer


def _follow(done: Future, answer: Future) -> None:
    if done.cancelled():
        answer.cancel()
    elif done.exception() is not None:
        answer.set_exception(done.exception())
    elif isinstance(done.result(), Future):
        done.result().add_done_callback(lambda inner: _follow(inner, answer))
    else:
        answer.set_result(done.result())
