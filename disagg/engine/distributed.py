"""The process groups that tie the workers of one TP x PP instance together.

Every instance of more than one worker gets its own small world, rendezvoused through a store
that rank 0 (the driver) serves (disagg.worker.instance_world: only the instance's ranks can use
it). Inside it: one tensor-parallel group per pipeline stage (the
all-reduce of the row-parallel layers) and one pipeline group per TP column (hidden states pass
from stage to stage). The groups are standalone ProcessGroup objects, not torch.distributed's
global world, so several instances, and the pairwise KV-transfer groups, live side by side in
one process. gloo carries CPU tensors, NCCL CUDA tensors.

Rank numbering is the KV resharding map's: rank = pp_rank * tp_size + tp_rank; rank 0 drives.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from disagg.config import DEFAULT_GROUP_TIMEOUT_S
from disagg.engine.layers.parallel import TPGroup

_PIPE_TAG = 7


@dataclass(frozen=True)
class RankPlace:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> "RankPlace":
        return cls(rank % tp_size, tp_size, rank // tp_size, pp_size)


class PipelineLink:
    """Point-to-point hand-off of (hidden states, residual) between consecutive stages."""

    def __init__(self, place: RankPlace, group: "dist.ProcessGroup | None"):
        self.place = place
        self.group = group

    def send_next(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        both = torch.stack([hidden, residual]).contiguous()
        self.group.send([both], self.place.pp_rank + 1, _PIPE_TAG).wait()

    def recv_prev(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        self.group.recv([both], self.place.pp_rank - 1, _PIPE_TAG).wait()
        return both[0], both[1]


@dataclass
class InstanceGroups:
    place: RankPlace
    tp: TPGroup
    pipe: PipelineLink
    store: "dist.Store"  # kept alive while the groups live


def join_instance(
    place: RankPlace,
    store: "dist.Store",
    device: torch.device,
    host: str,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
) -> InstanceGroups:
    """Build this rank's groups through the instance's `store`, gloo listening on this rank's
    `host`; blocks until every rank of each group has joined. Ranks run in lockstep, driven step
    by step by rank 0, so a gloo collective waits only as long as one forward pass of a peer:
    `timeout_s` (ServingConfig.group_timeout_s) bounds the wait when a peer dies mid-step."""
    timeout = timedelta(seconds=timeout_s)
    tp_pg = _group(dist.PrefixStore(f"tp{place.pp_rank}/", store), place.tp_rank, place.tp_size, device, host, timeout)
    pp_pg = _group(dist.PrefixStore(f"pp{place.tp_rank}/", store), place.pp_rank, place.pp_size, device, host, timeout)
    return InstanceGroups(place, TPGroup(place.tp_rank, place.tp_size, tp_pg), PipelineLink(place, pp_pg), store)


def _group(
    store: "dist.Store", rank: int, size: int, device: torch.device, host: str, timeout: timedelta
) -> "dist.ProcessGroup | None":
    if size == 1:
        return None
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ValueError("device: CUDA instances of several workers need a torch built with NCCL")
        return dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, options)
