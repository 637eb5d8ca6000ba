"""One request's transfer, seen from an instance of several ranks: each rank sends or receives
its own slice and reports its own result; the request's transfer is done when every rank's is,
and failed as soon as any rank's fails. Pure bookkeeping, used on rank 0."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.kv_transfer.endpoint import TransferResult


@dataclass
class _Pending:
    remaining: int
    first_token: int = -1
    seconds: float = 0.0
    num_bytes: int = 0
    token_ids: list[int] | None = None


@dataclass
class TransferTally:
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def expect(self, request_id: str, num_ranks: int) -> None:
        self._pending[request_id] = _Pending(num_ranks)

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def add(self, results: list[TransferResult]) -> list[TransferResult]:
        """Per-rank results in; whole-request results out (each request reported once)."""
        done = []
        for result in results:
            pending = self._pending.get(result.request_id)
            if pending is None:
                continue  # already reported (failed), or not a tallied request
            if not result.ok:
                del self._pending[result.request_id]
                done.append(result)
                continue
            pending.remaining -= 1
            pending.first_token = result.first_token if result.first_token >= 0 else pending.first_token
            pending.seconds = max(pending.seconds, result.seconds)  # the ranks move their slices in parallel
            pending.num_bytes += result.num_bytes
            pending.token_ids = result.token_ids if result.token_ids is not None else pending.token_ids
            if pending.remaining == 0:
                del self._pending[result.request_id]
                done.append(
                    TransferResult(
                        result.request_id,
                        True,
                        pending.first_token,
                        None,
                        pending.seconds,
                        pending.num_bytes,
                        pending.token_ids,
                    )
                )
        return done
