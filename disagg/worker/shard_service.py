"""What rank 0 of a multi-worker instance calls on its other ranks, and the commands it sends.

`ShardService` declares the ranks' lifecycle, called through Ray (disagg.worker.shard.ShardActor
implements it; disagg.worker.shard_group.ShardGroup calls it). The steps themselves go over rank
0's step channel (disagg.worker.step_channel), not through Ray. KV commands are plain frozen
data: rank 0 queues them and they ride along with the next step (or an order of their own, when
rank 0 needs their answer now), so a rank applies them, in order, before it computes that step.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVTarget
from disagg.worker.instance_world import WorldAddress
from disagg.worker.step_channel import ChannelInvite


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


@dataclass(frozen=True)
class Expect:
    """Decode rank: listen for this rank's slice of a request's KV (answered with its transfer id)."""

    request_id: str
    block_ids: list[int]
    sources: dict[str, str]  # peer id -> address of the prefill ranks holding this rank's slice
    timeout: float | None


@dataclass(frozen=True)
class AbortTransfers:
    """Give up on a request's transfers on this rank (a decode rank writes no more into its blocks)."""

    request_id: str


ShardCommand = AddTargets | CatchUp | FinishTransfer | Expect | AbortTransfers


@dataclass
class ShardReply:
    logits: torch.Tensor | None = None  # the sampled rows' logits (last stage, TP rank 0)
    results: list[TransferResult] = field(default_factory=list)
    transfer_ids: list[int] = field(default_factory=list)  # of the order's Expect commands, in order


@dataclass(frozen=True)
class JoinedRank:
    """What a rank tells rank 0 once it joined: its KV endpoint, and how to reach it per step."""

    peer_id: str
    kv_address: str  # empty for a colocated instance
    pid: int
    channel_key: str  # disagg.worker.step_channel.channel_key of its process


class ShardService(abc.ABC):
    @abc.abstractmethod
    def join(self, world: WorldAddress) -> JoinedRank:
        """Join the instance's groups (through rank 0's store, disagg.worker.instance_world) and
        load this rank's shard."""

    @abc.abstractmethod
    def open_channel(self, invite: ChannelInvite) -> None:
        """Open this rank's end of rank 0's step channel and start taking steps from it: apply
        rank 0's commands, run this rank's part of each step (none: wait up to the order's
        wait_s for a transfer to finish) and answer with this rank's finished transfers."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...
