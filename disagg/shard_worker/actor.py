"""A non-driver rank of a multi-worker instance (TP x PP > 1), as a Ray actor.

It holds its shard of the model, its slice of the KV cache and its own KV endpoint (each rank
moves its own slice). It schedules nothing: rank 0 calls `step` once per engine step with the
step's chunks, in order, and the rank runs its part, all ranks meeting in the all-reduces and
the stage hand-offs. The same call carries rank 0's KV commands for this rank and brings back
this rank's finished transfers.
"""

from __future__ import annotations

import threading

import torch

from disagg.config import Role, WorkerConfig
from disagg.engine.distributed import RankPlace, join_instance
from disagg.engine.engine import LLMEngine, resolve_device
from disagg.hosts.addressing import resolve_host
from disagg.kv_transfer.connector import assemble
from disagg.kv_transfer.receiver import KVReceiver
from disagg.kv_transfer.sender import KVSender
from disagg.kv_transfer.factory import make_transport
from disagg.worker.shard_service import AddTargets, CatchUp, FinishTransfer, ShardCommand, ShardReply, ShardService


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

    def join(self, store_address: str) -> tuple[str, str]:
        groups = join_instance(self.place, store_address, resolve_device(self.config.engine.device))
        built = assemble(
            self.config.engine,
            self.config.role,
            kv_timeout=self.config.kv_timeout_s,
            transport=None
            if self.config.role is Role.COLOCATED
            else make_transport(self.config.kv_transport, self.peer_id, self.config.link_key, self.host),
            groups=groups,
        )
        self.engine, self.endpoint = built.engine, built.endpoint
        if self.endpoint is None:
            return self.peer_id, ""
        self.endpoint.on_finished = self._finished.set
        return self.peer_id, self.endpoint.address()

    # ---- rank 0's calls, one at a time, in its order ------------------------------------------
    def step(self, chunks, commands: list[ShardCommand], wait_s: float = 0.0) -> ShardReply:
        for command in commands:
            self._apply(command)
        reply = ShardReply()
        if chunks:
            reply.logits = self.engine.runner.execute_shard(chunks)
        elif wait_s > 0 and self.endpoint is not None and not self.endpoint.has_finished():
            self._finished.wait(wait_s)
        self._finished.clear()
        if self.endpoint is not None:
            reply.results = self.endpoint.poll()
        return reply

    def _apply(self, command: ShardCommand) -> None:
        match command:
            case AddTargets(request_id, targets):
                self.endpoint.add(request_id, targets)
            case CatchUp(request_id, block_ids, num_tokens):
                self.endpoint.catch_up(request_id, block_ids, num_tokens)
            case FinishTransfer(request_id):
                if self.endpoint.has_transfer(request_id):
                    self.endpoint.finish(request_id, -1)  # rank 0 sends the first token; this rank only its KV
            case _:
                raise TypeError(f"unknown shard command {command!r}")

    def expect(self, request_id: str, block_ids: list[int], sources: dict[str, str], timeout: float | None) -> int:
        return self.endpoint.expect(request_id, block_ids, sources, timeout)

    def abort_transfers(self, request_id: str) -> None:
        self.endpoint.abort(request_id)

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
