"""Which slice of a tensor-parallel group this process is, and the collectives it uses: the
all-reduce of row-parallel layers, and the all-to-all and all-gather of expert parallelism
(layers/expert_parallel.py), whose experts are split over the same ranks."""

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

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of x [sum(send_counts), ...] sent in rank order (send_counts[r] rows to rank r);
        returns the rows received, [sum(recv_counts), ...], in the senders' rank order."""
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        self.group.alltoall_base(out, x.contiguous(), recv_counts, send_counts, dist.AllToAllOptions()).wait()
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (all of one shape), in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return parts

    def shard(self, n: int, what: str) -> int:
        return shard_size(n, self.size, what)


SINGLE = TPGroup()
