"""Expert parallelism: whole experts split over an instance's ranks, tokens sent to them by all-to-all.

The group is the stage's tensor-parallel group (ParallelConfig.enable_expert_parallel, as vLLM
names it): attention stays split by heads, so after it every rank holds every token. Each rank
then takes its contiguous slice of the tokens, sends each of its (token, expert) pairs to the
rank holding that expert (rank r holds experts [r * E/ep, (r + 1) * E/ep)), runs the pairs it
receives through its experts, sends the outputs back, sums its slice's tokens, and all ranks
gather the slices. One layer costs four collectives: the pair counts, the pairs' rows (each with
its key) out, the outputs back, and the gather.

Rows arrive from the senders in rank order, each sender's in token order, and slices are
contiguous in rank order, so an expert's rows are the same matrix, in the same order, as on one
rank: expert parallelism changes where a product is computed, not its numbers.
"""

from __future__ import annotations

import torch

from disagg.engine.layers.expert_groups import pair_keys, sort_by_expert, weighted_sum
from disagg.engine.layers.moe_routing import Routing
from disagg.engine.layers.parallel import TPGroup


class ExpertDispatch:
    def __init__(self, group: TPGroup, num_experts: int):
        if num_experts % group.size:
            raise ValueError(
                f"enable_expert_parallel: num_experts={num_experts} is not divisible by the "
                f"{group.size} ranks of a stage (tensor_parallel_size)"
            )
        self.group = group
        self.num_local = num_experts // group.size
        self.first = group.rank * self.num_local  # this rank's first expert

    def token_range(self, num_tokens: int) -> tuple[int, int]:
        """[start, end) of the tokens this rank dispatches (the last ranks' may be empty)."""
        chunk = -(-num_tokens // self.group.size)
        start = min(num_tokens, self.group.rank * chunk)
        return start, min(num_tokens, start + chunk)

    def __call__(self, x: torch.Tensor, routing: Routing, prompt: torch.Tensor | None, experts) -> torch.Tensor:
        """x [tokens, hidden], the same on every rank -> the MoE output of every token."""
        start, end = self.token_range(x.shape[0])
        ids, k = routing.expert_ids[start:end], routing.expert_ids.shape[1]
        keys = pair_keys(ids, None if prompt is None else prompt[start:end])
        order = torch.argsort(keys, stable=True)
        owners = ids.flatten()[order] // self.num_local
        # Keys as the owner knows its experts: local index * 2 + is-prompt.
        local_keys = keys[order] - owners * (2 * self.num_local)
        send = torch.bincount(owners, minlength=self.group.size)
        send_counts, recv_counts = send.tolist(), self._exchange(send)
        # Each row travels with its key, the key's bytes as extra columns: one all-to-all.
        rows = with_keys(x.index_select(0, start + order // k), local_keys)
        rows, received_keys = without_keys(self.group.all_to_all(rows, send_counts, recv_counts), x.shape[1])
        outputs = self._run_received(rows, received_keys, experts, prompt is not None)
        back = self.group.all_to_all(outputs, recv_counts, send_counts)
        weights = routing.weights[start:end].flatten()[order]
        mine = weighted_sum(back, weights, order // k, end - start, x.dtype)
        return self._gather(mine, x.shape[0])

    def _exchange(self, send: torch.Tensor) -> list[int]:
        """How many rows each rank sends this one, from how many this one sends each."""
        ones = [1] * self.group.size
        return self.group.all_to_all(send, ones, ones).tolist()

    def _run_received(self, rows: torch.Tensor, keys: torch.Tensor, experts, with_decodes: bool) -> torch.Tensor:
        """The received rows through this rank's experts, answered in the order they came."""
        order, counts, decodes = sort_by_expert(keys, self.num_local, with_decodes)
        grouped = experts(rows.index_select(0, order), counts, decodes)
        out = torch.empty_like(grouped)
        out[order] = grouped
        return out

    def _gather(self, mine: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Every rank's slice, in rank order: all of x's tokens again."""
        chunk = -(-num_tokens // self.group.size)
        padded = mine.new_zeros(chunk, mine.shape[1])
        padded[: mine.shape[0]] = mine
        return torch.cat(self.group.all_gather(padded))[:num_tokens]


def with_keys(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """rows [m, hidden] with each int64 key's bytes appended as columns of rows' dtype."""
    columns = keys.contiguous().view(rows.dtype).view(rows.shape[0], keys.element_size() // rows.element_size())
    return torch.cat([rows, columns], dim=1)


def without_keys(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """with_keys' inverse: (rows [m, hidden], keys [m] int64)."""
    return packed[:, :hidden], packed[:, hidden:].contiguous().view(torch.int64).view(-1)
