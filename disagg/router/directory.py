"""The router's view of the live instances: discovered from Redis, kept fresh by a background
task, with the router's own count of the work it has sent each one since.

An instance is healthy while its heartbeat key exists and no link to it has broken since: a
broken link takes it out of placement at once (`mark_failed`), not a heartbeat TTL later. It
returns when it registers at a new link address (relaunched), or when it still heartbeats at the
old one a TTL after the failure (it was alive: a dead process's key lapses within a TTL). When
Redis cannot be reached the last view is kept (requests in flight never touch Redis), and an
instance that comes back simply reappears. Each instance's request link (disagg.rpc) is dialled
on first use and kept, and the directory hears what it brings besides replies: the token deltas,
which it hands to the streams, and its loss. Its Ray actor handle is looked up by name once, for
lifecycle calls only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import ray

from disagg.config import ServingConfig
from disagg.errors import RegistryUnavailable
from disagg.kv_transfer.layout import KVLayout
from disagg.placement.latency_model import StepModel
from disagg.placement.online_fit import NEUTRAL_SEED, OnlineStepModel
from disagg.placement.profile import Profile, load_profile
from disagg.placement.predictor import Residual
from disagg.placement.prefill_queue import Decodes, QueuedPrompt
from disagg.placement.prefill_rate import PrefillRate
from disagg.prefix_index import PrefixIndex
from disagg.registry import InstanceView, LoadReport, Registry
from disagg.router.prompt_queue import PromptQueue
from disagg.router.streams import DecodeStreams
from disagg.rpc.client import RpcClient
from disagg.rpc.services import TOKENS_TOPIC
from disagg.rpc.stubs import DecodeStub, PeerStub, PrefillStub
from disagg.step_work import MeasuredStep
from disagg.supervision import supervised_task

logger = logging.getLogger(__name__)
STEP_INDEX_RESET = 1000  # a step index this far below the last learnt: a restarted worker's


@dataclass
class Instance:
    instance_id: str
    role: str
    actor: "ray.actor.ActorHandle"
    view: InstanceView
    rpc: RpcClient  # the request path: prefill, handshake, abort, token stream
    # What the router sent and has not seen finish (fresher than the instance's own report).
    outstanding_prefill_tokens: int = 0
    outstanding_requests: int = 0
    reserved_blocks: int = 0  # blocks reserved by the router since the last load report
    prefill_rate: PrefillRate = field(default_factory=PrefillRate)  # a prefill instance's pace, as measured here
    extra: dict = field(default_factory=dict)
    # The latency model (disagg.placement): its steps, fitted online from its reports; and what
    # its predictions missed of the requests' TTFT and TPOT as measured here.
    online: OnlineStepModel = field(default_factory=OnlineStepModel)
    ttft_residual: Residual = field(default_factory=Residual)
    tpot_residual: Residual = field(default_factory=Residual)
    prefill_budget: int = 512  # its engine's max_num_batched_tokens
    prefill_chunk_cap: int | None = None  # its engine's fair prefill cap (EngineConfig.prefill_chunk_cap); None: none
    prefill_by_work: bool = True  # its engine's caps count work (EngineConfig.long_prefill_by_work)
    block_size: int = 16
    outstanding_context_tokens: int = 0  # prompt tokens of the requests the router placed here and has not seen end
    # The prompts sent here, until their first token: the queue a new prompt's TTFT waits for.
    prompt_queue: PromptQueue = field(default_factory=PromptQueue)
    pending_requests: int = 0  # chosen for requests whose reservation has not been answered yet
    # Where prompts are warm: its last report's cached block hashes, and those of the prompts
    # sent here since (they will be cached by the time the next one comes).
    prefix_hashes: set = field(default_factory=set)
    # Where prompts are warm by the cluster-wide prefix index (disagg.prefix_index): every block
    # it holds, in its pool or a tier under it, as of the directory's latest read.
    indexed_hashes: set = field(default_factory=set)
    last_step_index: int = 0  # of the latest step learnt from
    # When this router's requests here ended (wall clock, as reports are stamped): its report
    # still counts those that ended after it was taken.
    ended_at: deque = field(default_factory=lambda: deque(maxlen=256))

    @property
    def prefill_service(self) -> PrefillStub:
        """This instance as a prefill instance (its role is "prefill")."""
        return PrefillStub(self.rpc)

    @property
    def decode_service(self) -> DecodeStub:
        """This instance as a decode or colocated instance."""
        return DecodeStub(self.rpc)

    @property
    def peer_service(self) -> PeerStub:
        """This instance as a lender or fetcher of cached prefix blocks (disagg.router.peer_fetch)."""
        return PeerStub(self.rpc)

    @property
    def kv_address(self) -> str:
        return self.view.info.kv_address

    @property
    def kv_layout(self) -> KVLayout:
        """Every rank's KV endpoint (one for an instance of one worker)."""
        info = self.view.info
        if info.kv_ranks:
            return KVLayout.from_list(info.tensor_parallel_size, info.pipeline_parallel_size, info.kv_ranks)
        return KVLayout.single(info.instance_id, info.kv_address)

    # ---- the load a placement policy reads (disagg.placement.policies.InstanceLoad) -------------
    @property
    def free_blocks(self) -> int:
        return self.view.load.num_free_blocks - self.reserved_blocks

    @property
    def queued_prefill_tokens(self) -> int:
        """Its own last report plus what the router sent since."""
        return self.view.load.queued_prefill_tokens + self.outstanding_prefill_tokens

    @property
    def num_requests(self) -> int:
        return self.view.load.num_running + self.outstanding_requests

    # ---- what the latency model reads (disagg.placement.predictor) -------------------------------
    @property
    def step_model(self) -> StepModel:
        return self.online.model

    def ttft_residual_ms(self, model_ms: float) -> float:
        return self.ttft_residual.value_for(model_ms)

    def tpot_residual_ms(self, model_ms: float) -> float:
        return self.tpot_residual.value_for(model_ms)

    @property
    def prefill_calibrated(self) -> bool:
        return self.online.calibrated("prefill")

    @property
    def decode_calibrated(self) -> bool:
        return self.online.calibrated("decode")

    @property
    def decode_batch(self) -> int:
        """Requests decoding here or about to: its report, or what this router placed if more,
        and those it has just chosen it for."""
        load = self.view.load
        reported = load.num_running + load.num_waiting_for_kv - self.ended_since(load.updated_at)
        return max(reported, self.outstanding_requests) + self.pending_requests

    def ended_since(self, stamp: float) -> int:
        return sum(1 for t in self.ended_at if t > stamp)

    # ---- the router's own counts of what it sent here (its reports lag by up to a heartbeat) ------
    def admit_prefill(self, num_tokens: int) -> None:
        """A prompt of `num_tokens` sent here to prefill, until its first token (`release_prefill`)."""
        self.outstanding_prefill_tokens += num_tokens

    def release_prefill(self, num_tokens: int) -> None:
        self.outstanding_prefill_tokens -= num_tokens

    def await_reservation(self) -> None:
        """Chosen for a request whose reservation has not been answered (concurrent choices see it)."""
        self.pending_requests += 1

    def reservation_answered(self) -> None:
        self.pending_requests -= 1

    def admit(self, num_prompt_tokens: int, num_blocks: int = 0) -> None:
        """A request of `num_prompt_tokens` decodes here from now on (reserving `num_blocks` of
        its free blocks until the next report counts them), until `release`."""
        self.outstanding_requests += 1
        self.outstanding_context_tokens += num_prompt_tokens
        self.reserved_blocks += num_blocks

    def release(self, num_prompt_tokens: int) -> None:
        """One of this router's requests here ended (or moved away): out of its counts."""
        self.outstanding_requests = max(0, self.outstanding_requests - 1)
        self.outstanding_context_tokens = max(0, self.outstanding_context_tokens - num_prompt_tokens)
        self.ended_at.append(time.time())

    @property
    def decode_context_tokens(self) -> int:
        return max(self.view.load.decode_context_tokens, self.outstanding_context_tokens)

    @property
    def queued_prompts(self) -> list[QueuedPrompt]:
        """What this router sent and has not seen the first token of (fresher than its report,
        which lags by up to a heartbeat)."""
        return self.prompt_queue.prompts

    @property
    def queue_progress_ms(self) -> float:
        backlog_since = self.view.load.updated_at if self.backlog_tokens else math.inf
        return self.prompt_queue.progress_ms(backlog_since)

    @property
    def backlog_tokens(self) -> int:
        """Prompt tokens its last report had queued beyond this router's prompts there then
        (another frontend's, or prompts preempted to be computed again)."""
        load = self.view.load
        return max(0, load.queued_prefill_tokens - self.prompt_queue.tokens_at(load.updated_at))

    @property
    def riding_decodes(self) -> Decodes | None:
        """The requests decoding here, whose tokens share each step with prompt chunks (those
        still queued for their prefill are not decoding yet); None on a prefill instance."""
        if self.role == "prefill":
            return None
        queued = self.queued_prompts
        batch = self.decode_batch - len(queued)
        return Decodes(max(0, batch), max(0, self.decode_context_tokens - sum(p.num_tokens for p in queued)))

    @property
    def arriving_tokens_per_ms(self) -> float:
        return self.prompt_queue.tokens_per_ms()

    @property
    def predicted_queue_tokens(self) -> int:
        """Prompt tokens to compute before a new one."""
        return self.prompt_queue.num_new_tokens + self.backlog_tokens

    def cached_tokens(self, block_hashes) -> int:
        """Tokens of the prompt's leading blocks that it holds (block hashes as BlockManager's)."""
        hits = 0
        for h in block_hashes:
            if h not in self.prefix_hashes and h not in self.indexed_hashes:
                break
            hits += 1
        return hits * self.block_size

    def learn_report(self, report: LoadReport) -> None:
        """A new load report: it counts the blocks reserved before it was taken already."""
        self.reserved_blocks = 0
        self.learn_steps(report)
        self.prefix_hashes = set(report.prefix_hashes)

    def learn_steps(self, report: LoadReport) -> None:
        """The steps of the report not learnt from before (reports overlap: see the worker's)."""
        for entry in report.steps:
            try:
                step = MeasuredStep.from_list(entry)
            except (TypeError, ValueError):
                continue  # a malformed entry teaches nothing
            index = step.index
            if index > self.last_step_index or index < self.last_step_index - STEP_INDEX_RESET:
                self.last_step_index = index  # (far below: the worker restarted, counting anew)
                self.online.observe(step)


@dataclass(frozen=True)
class _Failure:
    role: str
    rpc_address: str  # the link that broke
    at: float  # time.monotonic() when it broke
    link_broke: bool = True  # False: its heartbeat lapsed (it, or Redis, may be back at the same address)


def directory_for(config: ServingConfig, registry: Registry, namespace: str, link_key: bytes,
                  streams: DecodeStreams, prefix_index: PrefixIndex | None = None) -> InstanceDirectory:  # fmt: skip
    """The directory a frontend (or the controller) keeps of `config`'s instances; a frontend's
    reads the cluster's prefix index too (placement by cached prefix)."""
    prefill_engine = config.pool_engine_config(config.prefill)
    return InstanceDirectory(
        registry,
        namespace,
        link_key,
        streams,
        heartbeat_ttl_s=config.heartbeat_ttl_s,
        recovery_timeout_s=config.recovery_timeout_s,
        profile=load_profile(config.profile) if config.profile else None,
        prefill_budget=prefill_engine.max_num_batched_tokens,
        prefill_chunk_cap=prefill_engine.prefill_chunk_cap,
        prefill_by_work=prefill_engine.long_prefill_by_work,
        block_size=config.engine.block_size,
        prefix_index=prefix_index,
    )


class InstanceDirectory:
    def __init__(
        self,
        registry: Registry,
        namespace: str,
        link_key: bytes,
        streams: DecodeStreams,
        refresh_interval_s: float = 0.5,
        heartbeat_ttl_s: float = 3.0,
        recovery_timeout_s: float = 60.0,
        profile: Profile | None = None,
        prefill_budget: int = 512,
        block_size: int = 16,
        prefill_chunk_cap: int | None = None,
        prefill_by_work: bool = True,
        prefix_index: PrefixIndex | None = None,
    ):
        """`prefix_index`: the cluster-wide index read at each refresh (None: the heartbeats'
        summaries only). `profile`: seeds each instance's latency model (its TP x PP entry) until the
        instance's own steps are fitted; `prefill_budget`: the prefill engines' tokens a step;
        `prefill_chunk_cap`: their fair prefill cap (None: none); `prefill_by_work`: whether
        those caps count work (EngineConfig.long_prefill_by_work). `streams`: where the links'
        token deltas go."""
        self.profile = profile
        self.prefill_budget = prefill_budget
        self.prefill_chunk_cap = prefill_chunk_cap
        self.prefill_by_work = prefill_by_work
        self.block_size = block_size
        self.registry = registry
        self._link_key = link_key  # the deployment's (disagg.auth): every link proves it, both ways
        self.streams = streams
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.recovery_timeout_s = recovery_timeout_s
        self._failed: dict[str, _Failure] = {}
        self._learnt: dict[str, Instance] = {}  # instances gone from the registry, kept for their models
        self.namespace = namespace
        self.refresh_interval_s = refresh_interval_s
        self._instances: dict[str, Instance] = {}
        self._held_out: set[str] = set()
        self._task: asyncio.Task | None = None
        self._links: dict[str, RpcClient] = {}  # request-link address -> its client, reused when an instance comes back
        self.last_refresh_ok = 0.0
        self.prefix_index = prefix_index
        self.index_entries = 0  # blocks the index listed at its latest read, all instances together

    def healthy(self, role: str) -> list[Instance]:
        """The role's instances in placement (a draining one is not: it is on its way out, nor
        one held out of it: being switched to another pool)."""
        return [
            i
            for i in self._instances.values()
            if i.role == role and not i.view.load.draining and i.instance_id not in self._held_out
        ]

    def hold_out(self, instance_id: str) -> None:
        """Out of placement at once (its report says it is draining only a heartbeat later)."""
        self._held_out.add(instance_id)

    def release(self, instance_id: str) -> None:
        self._held_out.discard(instance_id)

    def draining(self, role: str) -> list[Instance]:
        return [i for i in self._instances.values() if i.role == role and i.view.load.draining]

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def all(self) -> list[Instance]:
        return list(self._instances.values())

    def mark_failed(self, instance_id: str) -> None:
        """A link to it broke: out of placement until it is back (see the module's docstring)."""
        inst = self._instances.pop(instance_id, None)
        if inst is not None:
            self._learnt[instance_id] = inst
            logger.warning("instance %s failed (its link broke, or it said so); out of placement", instance_id)
            self._failed[instance_id] = _Failure(inst.role, inst.view.info.rpc_address, time.monotonic())

    # ---- what the links bring besides replies (disagg.rpc.client.LinkListener) ---------------------
    def link_event(self, link: str, topic: str, payload) -> None:
        """A worker's event on the link to instance `link`: a step's token deltas."""
        if topic == TOKENS_TOPIC:
            self.streams.deliver(link, payload)

    def link_lost(self, link: str) -> None:
        """The link to instance `link` broke: it failed, and so did every request streaming from it."""
        self.mark_failed(link)
        self.streams.lost(link)

    def is_failed(self, instance: Instance) -> bool:
        failed = self._failed.get(instance.instance_id)
        return failed is not None and failed.rpc_address == instance.view.info.rpc_address

    def recovering(self, role: str) -> bool:
        """An instance of `role` failed less than `recovery_timeout_s` ago and may come back
        (relaunched): worth waiting for rather than refusing requests."""
        now = time.monotonic()
        return any(f.role == role and now - f.at < self.recovery_timeout_s for f in self._failed.values())

    async def wait_healthy(self, role: str, timeout_s: float) -> bool:
        """Until an instance of `role` is in placement. False after timeout_s, or as soon as none
        is and none may come back (every one that failed left for good)."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy(role):
            if time.monotonic() >= deadline or not self.recovering(role):
                return False
            await asyncio.sleep(min(self.refresh_interval_s, max(0.0, deadline - time.monotonic())))
        return True

    async def start(self) -> None:
        await self.refresh()
        self._task = supervised_task("instance-directory", self._refresh_forever)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for link in self._links.values():
            await link.close()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            await self.refresh()

    async def refresh(self) -> None:
        try:
            views = await asyncio.to_thread(self.registry.instances)
        except RegistryUnavailable as exc:
            logger.warning("registry unreachable, keeping the last view of %d instances: %s", len(self._instances), exc)
            return
        self.last_refresh_ok = time.monotonic()
        seen = set()
        for view in views:
            seen.add(view.info.instance_id)
            self._update(view)
        for instance_id in set(self._instances) - seen:
            logger.info("instance %s left (heartbeat lapsed, or deregistered)", instance_id)
            inst = self._instances.pop(instance_id)
            self._learnt[instance_id] = inst  # what its model learnt holds should it come back
            # It may come back (a relaunch, or Redis restarted empty): new requests wait for it.
            failure = _Failure(inst.role, inst.view.info.rpc_address, time.monotonic(), link_broke=False)
            self._failed.setdefault(instance_id, failure)
        awaited = set(self._failed) - seen
        if awaited:
            await self._forget_departed(awaited)
        await self._read_prefix_index()

    async def _read_prefix_index(self) -> None:
        """Each instance's blocks by the cluster-wide index. Unreadable: the last read stands
        (a stale entry costs a request a recompute, never an error)."""
        if self.prefix_index is None:
            return
        try:
            index = await asyncio.to_thread(self.prefix_index.read, list(self._instances))
        except RegistryUnavailable:
            return
        for instance_id, held in index.items():
            instance = self._instances.get(instance_id)
            if instance is not None:
                instance.indexed_hashes = set(held)
        self.index_entries = sum(len(held) for held in index.values())

    async def _forget_departed(self, awaited: set[str]) -> None:
        """Of the failed instances awaited, those that deregistered left on purpose (drained, or
        lost a rank): nothing to wait for."""
        try:
            departed = await asyncio.to_thread(self.registry.departed, awaited)
        except RegistryUnavailable:
            return
        for instance_id in departed:
            logger.info("instance %s left service (deregistered): not waited for", instance_id)
            del self._failed[instance_id]
            self._learnt.pop(instance_id, None)

    def _new_model(self, tp: int, pp: int) -> OnlineStepModel:
        if self.profile is not None and self.profile.has(tp, pp):
            return OnlineStepModel(self.profile.step_model(tp, pp), seeded_from_profile=True)
        return OnlineStepModel(NEUTRAL_SEED)

    def _join_pool(self, instance: Instance, before: Instance) -> None:
        """An instance that switched roles is predicted as its new pool's peers are (in the old
        role it never ran the new role's steps), and its residuals start from theirs."""
        peers = [i for i in self._instances.values() if i.role == instance.role and i is not before]
        instance.online = _pool_model(instance.role, peers, before.online)
        instance.ttft_residual = Residual(seed_ms=_median(p.ttft_residual.value for p in peers))
        instance.tpot_residual = Residual(seed_ms=_median(p.tpot_residual.value for p in peers))

    def _update(self, view: InstanceView) -> None:
        failed = self._failed.get(view.info.instance_id)
        if failed is not None:
            same_address = view.info.rpc_address == failed.rpc_address
            if failed.link_broke and same_address and time.monotonic() - failed.at < self.heartbeat_ttl_s:
                return  # the dead process's last heartbeat, still in Redis
            del self._failed[view.info.instance_id]
        known = self._instances.get(view.info.instance_id)
        same_role = known is not None and known.role == view.info.role  # else it switched: anew in its pool
        if same_role and known.view.info.rpc_address == view.info.rpc_address:
            if view.load.updated_at != known.view.load.updated_at:
                known.learn_report(view.load)
            known.view = view
            return
        try:
            actor = ray.get_actor(view.info.actor_name, namespace=self.namespace)
        except ValueError:
            logger.warning(
                "instance %s is registered but its actor %s is gone", view.info.instance_id, view.info.actor_name
            )
            return
        info = view.info
        link = self._links.get(info.rpc_address)
        if link is None:
            link = RpcClient(info.rpc_address, self._link_key, name=info.instance_id, listener=self)
            self._links[info.rpc_address] = link
        instance = Instance(
            info.instance_id,
            info.role,
            actor,
            view,
            link,
            prefill_budget=self.prefill_budget,
            prefill_chunk_cap=self.prefill_chunk_cap,
            prefill_by_work=self.prefill_by_work,
            block_size=self.block_size,
        )
        known = known or self._learnt.pop(info.instance_id, None)
        if known is not None and known.role != info.role:  # switched pools (disagg.router.replanning)
            self._join_pool(instance, known)
        elif known is not None:  # the same instance back (at a new address): what was learnt of it holds
            instance.online, instance.ttft_residual, instance.tpot_residual = (
                known.online,
                known.ttft_residual,
                known.tpot_residual,
            )
        else:
            instance.online = self._new_model(info.tensor_parallel_size, info.pipeline_parallel_size)
            peers = [i for i in self._instances.values() if i.role == info.role]
            instance.ttft_residual = Residual(seed_ms=_median(p.ttft_residual.value for p in peers))
            instance.tpot_residual = Residual(seed_ms=_median(p.tpot_residual.value for p in peers))
        instance.learn_report(view.load)
        self._instances[info.instance_id] = instance


def _pool_model(role: str, peers: list[Instance], fallback: OnlineStepModel) -> OnlineStepModel:
    """A switched instance's model in its new pool: that of a peer fitted on the pool's steps
    (the same engine on the same kind of host; its own steps refine it from there), or what it
    learnt in its old pool."""
    kind = "decode" if role == "decode" else "prefill"
    for peer in peers:
        if peer.online.calibrated(kind):
            return OnlineStepModel(peer.online.model, seeded_from_profile=True)
    return fallback


def _median(values) -> float:
    """0 for none."""
    values = list(values)
    return statistics.median(values) if values else 0.0
