"""Which slice of a tensor-parallel group this process is, and the collective it uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from disagg.engine.partition import shard_size


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: "dist.ProcessGroup | None" = None  # None when size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x across the group in place. The group is a standalone ProcessGroup (see
        disagg.engine.distributed), so its own method is called, not dist.all_reduce."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def shard(self, n: int, what: str) -> int:
        return shard_size(n, self.size, what)


SINGLE = TPGroup()
