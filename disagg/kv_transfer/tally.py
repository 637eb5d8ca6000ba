"""One request's transfer, seen from an instance of several ranks: each rank sends or receives
its own slice and reports its own result; the request's transfer is done when every rank's is,
and failed as soon as any rank's fails. Pure bookkeeping, held by rank 0's record of the request."""

from __future__ import annotations

from dataclasses import dataclass

from disagg.kv_transfer.endpoint import TransferResult


@dataclass
class RankTally:
    """A request's transfer until every rank reported (`remaining` of them have not)."""

    remaining: int
    first_token: int = -1
    seconds: float = 0.0
    num_bytes: int = 0
    token_ids: list[int] | None = None

    def add(self, result: TransferResult) -> TransferResult | None:
        """One rank's result in; the whole request's out once it is known (a failure at once)."""
        if not result.ok:
            return result
        self.remaining -= 1
        self.first_token = result.first_token if result.first_token >= 0 else self.first_token
        self.seconds = max(self.seconds, result.seconds)  # the ranks move their slices in parallel
        self.num_bytes += result.num_bytes
        self.token_ids = result.token_ids if result.token_ids is not None else self.token_ids
        if self.remaining > 0:
            return None
        return TransferResult(
            result.request_id, True, self.first_token, None, self.seconds, self.num_bytes, self.token_ids
        )
