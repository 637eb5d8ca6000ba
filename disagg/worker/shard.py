"""A non-driver rank of a multi-worker instance (TP x PP > 1), as a Ray actor.

It holds its shard of the model, its slice of the KV cache and its own KV endpoint (each rank
moves its own slice). It schedules nothing: rank 0 sends it each engine step's chunks over the
step channel, in order, and the rank's follower loop runs its part (`run_step`), all ranks
meeting in the all-reduces and the stage hand-offs. The same order carries rank 0's KV commands
for this rank and the answer brings back this rank's finished transfers (and the transfer ids of
those it was told to expect).

Ray calls the lifecycle (join, open_channel, shutdown) on the actor's own thread, beside the
follower loop's: a lock lets a call and a step run only one at a time.
"""

from __future__ import annotations

import os
import threading

import torch

from disagg.config import WorkerConfig
from disagg.engine.distributed import RankPlace, join_instance
from disagg.engine.engine import LLMEngine, resolve_device
from disagg.hosts.addressing import resolve_host
from disagg.kv_transfer.connector import assemble
from disagg.kv_transfer.factory import role_transports
from disagg.kv_transfer.receiver import KVReceiver
from disagg.kv_transfer.sender import KVSender
from disagg.worker.follower_loop import FollowerLoop
from disagg.worker.instance_world import WorldAddress, connect_world
from disagg.worker.shard_service import (
    AbortTransfers,
    AddTargets,
    CatchUp,
    Expect,
    FinishTransfer,
    JoinedRank,
    ShardCommand,
    ShardReply,
    ShardService,
)
from disagg.worker.step_channel import OPEN_TIMEOUT_S, ChannelInvite, channel_key, open_follower_channel


class ShardActor(ShardService):
    def __init__(self, config: WorkerConfig):
        torch.set_num_threads(config.num_threads)
        p = config.engine.parallel
        self.config = config
        self.place = RankPlace(p.tp_rank, p.tensor_parallel_size, p.pp_rank, p.pipeline_parallel_size)
        self.peer_id = f"{config.instance_id}/rank{self.place.rank}"
        self.host = resolve_host(config.host)  # None: this node's IP (multi-node)
        self.engine: LLMEngine | None = None
        self.endpoint: KVSender | KVReceiver | None = None
        self._finished = threading.Event()
        self._lock = threading.Lock()  # a step and a lifecycle call never overlap
        self.loop: FollowerLoop | None = None

    def join(self, world: WorldAddress) -> JoinedRank:
        store = connect_world(world, self.config.link_key, self.config.group_timeout_s)
        device = resolve_device(self.config.engine.device)
        groups = join_instance(self.place, store, device, self.host, self.config.group_timeout_s)
        config = self.config
        transports = role_transports(
            config.kv_transport, config.role, self.peer_id, config.link_key, self.host, config.engine.device,
            one_rank=False,
        )  # fmt: skip
        built = assemble(
            config.engine,
            config.role,
            kv_timeout=config.kv_timeout_s,
            transport=transports.kv,
            groups=groups,
            wake=self._finished.set,
        )
        self.engine, self.endpoint = built.engine, built.endpoint
        address = self.endpoint.address() if self.endpoint is not None else ""
        return JoinedRank(self.peer_id, address, os.getpid(), channel_key())

    def open_channel(self, invite: ChannelInvite) -> None:
        channel = open_follower_channel(invite, self.config.link_key, OPEN_TIMEOUT_S)
        self.loop = FollowerLoop(
            channel, invite.index, self.run_step, f"steps-{self.peer_id}", step_timeout_s=self.config.step_timeout_s
        )
        self.loop.start()

    # ---- rank 0's steps and calls, one at a time, in its order ------------------------------------
    def run_step(self, chunks, commands: list[ShardCommand], wait_s: float = 0.0) -> ShardReply:
        """Apply rank 0's commands, run this rank's part of the step (none: wait up to wait_s
        for a transfer to finish) and report this rank's finished transfers."""
        with self._lock:
            return self._run_step(chunks, commands, wait_s)

    def _run_step(self, chunks, commands: list[ShardCommand], wait_s: float) -> ShardReply:
        reply = ShardReply()
        for command in commands:
            self._apply(command, reply)
        if chunks:
            reply.logits = self.engine.runner.execute_shard(chunks)
        elif wait_s > 0 and self.endpoint is not None and not self.endpoint.has_finished():
            self._finished.wait(wait_s)
        self._finished.clear()
        if self.endpoint is not None:
            reply.results = self.endpoint.poll()
        return reply

    def _apply(self, command: ShardCommand, reply: ShardReply) -> None:
        match command:
            case AddTargets(request_id, targets):
                self.endpoint.add(request_id, targets)
            case CatchUp(request_id, block_ids, num_tokens):
                self.endpoint.catch_up(request_id, block_ids, num_tokens)
            case FinishTransfer(request_id):
                if self.endpoint.has_transfer(request_id):
                    self.endpoint.finish(request_id, -1)  # rank 0 sends the first token; this rank only its KV
            case Expect(request_id, block_ids, sources, timeout):
                reply.transfer_ids.append(self.endpoint.expect(request_id, block_ids, sources, timeout))
            case AbortTransfers(request_id):
                self.endpoint.abort(request_id)
            case _:
                raise TypeError(f"unknown shard command {command!r}")

    def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        if self.endpoint is not None:
            self.endpoint.close()
