"""What rank 0's role asks of the other ranks of its instance (TP x PP), each of which moves its
own slice of the KV. Rank 0 queues commands that ride with the next step, or runs one round
now over its step channel; disagg.worker.shard_group.ShardGroup implements it."""

from __future__ import annotations

from typing import Protocol

from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVRank, KVTarget


class OtherRanks(Protocol):
    kv_ranks: list[KVRank]  # every other rank's KV endpoint, by index (rank 1 first)

    # ---- prefill: delivered with the next step, before it computes -------------------------------
    def add_targets(self, rank_index: int, request_id: str, targets: list[KVTarget]) -> None: ...

    def catch_up(self, request_id: str, block_ids: list[int], num_tokens: int) -> None: ...

    def finish_transfer(self, request_id: str) -> None: ...

    def has_commands(self) -> bool: ...

    # ---- decode, and both: answered now ----------------------------------------------------------
    def expect(
        self, request_id: str, block_ids: list[int], sources: list[dict[str, str]], timeout: float | None
    ) -> list[int]:
        """Each other rank listens for its slice (`sources[i]`: rank index i's, peer id ->
        address); their transfer ids, by index."""

    def abort_transfers(self, request_id: str) -> None:
        """Every other rank gives up on the request's transfers (a decode rank writes no more
        into its blocks) before this returns."""

    def sync(self) -> None:
        """No step to run: deliver queued commands and collect finished transfers."""

    def take_results(self) -> list[TransferResult]:
        """The other ranks' finished transfers since the last call."""
