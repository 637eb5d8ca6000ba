"""What rank 0 of a multi-worker instance calls on its other ranks, and the commands it sends.

`ShardService` declares the ranks' interface (disagg.shard_worker.ShardActor implements it;
disagg.worker.shard_group.ShardGroup calls it). KV commands are plain frozen data: rank 0
queues them and they ride along with the next step, so a rank applies them, in order, before
it computes that step.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVTarget


@dataclass(frozen=True)
class AddTargets:
    """Prefill rank: where this rank's slice of a request's KV goes."""

    request_id: str
    targets: list[KVTarget]


@dataclass(frozen=True)
class CatchUp:
    """Prefill rank: targets came after `num_tokens` positions were computed; send those now."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True)
class FinishTransfer:
    """Prefill rank: the prompt is done; end the request's transfers (rank 0 sends the first token)."""

    request_id: str


ShardCommand = AddTargets | CatchUp | FinishTransfer


@dataclass
class ShardReply:
    logits: torch.Tensor | None = None  # the sampled rows' logits (last stage, TP rank 0)
    results: list[TransferResult] = field(default_factory=list)


class ShardService(abc.ABC):
    @abc.abstractmethod
    def join(self, store_address: str) -> tuple[str, str]:
        """Join the instance's groups and load this rank's shard; this rank's KV endpoint (peer
        id, address), the address empty for a colocated instance."""

    @abc.abstractmethod
    def step(self, chunks, commands: list[ShardCommand], wait_s: float = 0.0) -> ShardReply:
        """Apply rank 0's commands, run this rank's part of the step (none: wait up to wait_s
        for a transfer to finish) and report this rank's finished transfers."""

    @abc.abstractmethod
    def expect(self, request_id: str, block_ids: list[int], sources: dict[str, str], timeout: float | None) -> int:
        """Decode rank: listen for this rank's slice of a request's KV; returns the transfer id."""

    @abc.abstractmethod
    def abort_transfers(self, request_id: str) -> None:
        """Give up on a request's transfers on this rank (a decode rank writes no more into its blocks)."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...
