"""A non-driver rank of a multi-worker instance (TP x PP > 1), as a Ray actor.

It holds its shard of the model and its slice of the KV cache, and its own KV endpoint (a sender
on a prefill instance, a receiver on a decode instance), since each rank moves its own slice.
It schedules nothing: rank 0 (the prefill or decode actor) calls `step` once per engine step
with the step's chunks, in order, and the rank runs its part, all ranks meeting in the
all-reduces and the stage hand-offs. The same call carries rank 0's KV commands for this rank
and brings back this rank's finished transfers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from disagg.hosts.addressing import resolve_host
from disagg.config import EngineConfig, Role
from disagg.engine.distributed import RankPlace, join_instance
from disagg.engine.engine import LLMEngine, resolve_device
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.receiver import KVReceiver
from disagg.kv_transfer.sender import KVSender
from disagg.kv_transfer.torch_dist import TorchDistTransport


@dataclass
class ShardReply:
    logits: torch.Tensor | None = None  # the sampled rows' logits (last stage, TP rank 0)
    results: list[TransferResult] = field(default_factory=list)


class ShardActor:
    def __init__(self, instance_id: str, engine_config: EngineConfig, role: str, *, host: str | None = "127.0.0.1", kv_timeout_s: float = 30.0, num_threads: int = 1):
        torch.set_num_threads(num_threads)
        p = engine_config.parallel
        self.place = RankPlace(p.tp_rank, p.tensor_parallel_size, p.pp_rank, p.pipeline_parallel_size)
        self.peer_id = f"{instance_id}/rank{self.place.rank}"
        self.config = engine_config
        self.role = role
        self.host = resolve_host(host)  # None: this node's IP (multi-node)
        self.kv_timeout_s = kv_timeout_s
        self.engine: LLMEngine | None = None
        self.endpoint: KVSender | KVReceiver | None = None
        self._finished = threading.Event()

    def join(self, store_address: str) -> tuple[str, str]:
        """Join the instance's groups (rank 0 joins at the same time), load this rank's shard;
        returns this rank's KV endpoint (peer id, address), empty for a colocated instance."""
        groups = join_instance(self.place, store_address, resolve_device(self.config.device))
        role = {"prefill": Role.PREFILL, "decode": Role.DECODE}.get(self.role, Role.COLOCATED)
        self.engine = LLMEngine(self.config.replace(role=role), groups=groups)
        if role is Role.COLOCATED:
            return self.peer_id, ""
        model = self.engine.model
        offsets = dict(layer_offset=model.start_layer, head_offset=self.place.tp_rank * self.engine.kv_cache.tensor.shape[2], timeout=self.kv_timeout_s)
        transport = TorchDistTransport(self.peer_id, self.host)
        if role is Role.PREFILL:
            self.endpoint = KVSender(transport, self.engine.kv_cache, **offsets)
            self.engine.runner.on_layer = self.endpoint.on_layer
            self.engine.runner.on_forward_done = self.endpoint.on_step_end
        else:
            self.endpoint = KVReceiver(transport, self.engine.kv_cache, **offsets)
        self.endpoint.on_finished = self._finished.set
        return self.peer_id, transport.address()

    # ---- rank 0's calls, one at a time, in its order ------------------------------------------
    def step(self, chunks, commands: list[tuple], wait_s: float = 0.0) -> ShardReply:
        """Apply rank 0's KV commands, run this rank's part of the step (if any), and report
        finished transfers; with no step, wait up to wait_s for one to finish."""
        for name, *args in commands:
            getattr(self, f"_{name}")(*args)
        reply = ShardReply()
        if chunks:
            reply.logits = self.engine.runner.execute_shard(chunks)
        elif wait_s > 0 and self.endpoint is not None and not self.endpoint.has_finished():
            self._finished.wait(wait_s)
        self._finished.clear()
        if self.endpoint is not None:
            reply.results = self.endpoint.poll()
        return reply

    def expect(self, request_id: str, block_ids: list[int], sources: dict[str, str], timeout: float | None) -> int:
        """Decode rank: listen for this rank's slice of a request's KV (the handshake)."""
        return self.endpoint.expect(request_id, block_ids, sources, timeout)

    def cancel(self, request_id: str) -> None:
        """Decode rank: stop writing into the request's blocks (rank 0 is about to free them)."""
        self.endpoint.cancel(request_id)

    def abort(self, request_id: str) -> None:
        """Prefill rank: give up on the request's transfers."""
        self.endpoint.abort(request_id)

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()

    # ---- commands --------------------------------------------------------------------------------
    def _add(self, request_id: str, targets) -> None:
        self.endpoint.add(request_id, targets)

    def _catch_up(self, request_id: str, block_ids: list[int], num_tokens: int) -> None:
        self.endpoint.catch_up(request_id, block_ids, num_tokens)

    def _finish(self, request_id: str) -> None:
        if self.endpoint.has_transfer(request_id):
            self.endpoint.finish(request_id, -1)  # rank 0 sends the first token; this rank only its KV
