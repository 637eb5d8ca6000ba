"""Rank 0's handle on the other ranks of its instance.

Each engine step rank 0 sends every other rank the step's chunks (plain copies) together with
the KV commands queued for that rank since the last call, then runs its own part; the replies
bring the last stage's logits and each rank's finished transfers. Calls to one actor run in the
order they are made, so a command always reaches a rank before any later step. Every wait has
a timeout: a rank that died or hangs fails the step instead of stalling the instance.
"""

from __future__ import annotations

import ray

from disagg.engine.distributed import RankPlace
from disagg.engine.step_chunks import portable
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVRank, KVTarget
from disagg.worker.shard_service import AddTargets, CatchUp, FinishTransfer, ShardCommand

STEP_TIMEOUT_S = 120.0  # one forward pass of a shard, with room for a slow first step
IDLE_POLL_S = 0.005  # how long an idle instance's other ranks wait for a transfer to finish


class ShardGroup:
    def __init__(self, actors: list[tuple[RankPlace, "ray.actor.ActorHandle"]], timeout_s: float = STEP_TIMEOUT_S):
        """`actors`: (place, Ray handle of a ShardService) of every other rank."""
        self.places = [place for place, _ in actors]
        self.actors = [actor for _, actor in actors]  # Ray handles of ShardService actors
        self.timeout_s = timeout_s
        self.kv_ranks: list[KVRank] = []
        self._commands: list[list[ShardCommand]] = [[] for _ in self.actors]
        self._results: list[TransferResult] = []
        # Set when a call to a rank failed: the ranks may no longer be in lockstep (one may be
        # dead, or stuck in a collective), so nothing more is sent; rank 0 leaves service.
        self.broken: str | None = None
        self.on_broken = None  # called once, with the reason, when the group breaks

    # ---- setup: every rank joins the instance's groups at once -----------------------------------
    def start_join(self, store_address: str) -> list:
        return [actor.join.remote(store_address) for actor in self.actors]

    def finish_join(self, pending: list) -> None:
        endpoints = ray.get(pending, timeout=self.timeout_s)
        self.kv_ranks = [
            KVRank(peer_id, address, p.tp_rank, p.pp_rank) for (peer_id, address), p in zip(endpoints, self.places)
        ]

    # ---- per step ------------------------------------------------------------------------------
    def submit(self, chunks) -> "_PendingStep":
        """Start the step on every other rank (disagg.engine.kv_connector.Followers)."""
        self._check()
        plain = portable(chunks)
        return _PendingStep(
            self, [actor.step.remote(plain, self._take_commands(i)) for i, actor in enumerate(self.actors)]
        )

    def sync(self) -> None:
        """No step to run: deliver queued commands and collect finished transfers. With no
        commands to deliver, each rank waits up to IDLE_POLL_S for a transfer to finish."""
        self._check()
        wait_s = 0.0 if self.has_commands() else IDLE_POLL_S
        refs = [actor.step.remote(None, self._take_commands(i), wait_s) for i, actor in enumerate(self.actors)]
        self._collect(refs)

    # ---- KV commands: queued, delivered with the next step (or sync) ---------------------------------
    def add_targets(self, rank_index: int, request_id: str, targets: list[KVTarget]) -> None:
        self._commands[rank_index].append(AddTargets(request_id, targets))

    def catch_up(self, request_id: str, block_ids: list[int], num_tokens: int) -> None:
        self._command_all(CatchUp(request_id, list(block_ids), num_tokens))

    def finish_transfer(self, request_id: str) -> None:
        self._command_all(FinishTransfer(request_id))

    def _command_all(self, command: ShardCommand) -> None:
        for commands in self._commands:
            commands.append(command)

    def has_commands(self) -> bool:
        return any(self._commands)

    # ---- calls that wait for the ranks -------------------------------------------------------------
    def expect(
        self, rank_index: int, request_id: str, block_ids: list[int], sources: dict[str, str], timeout: float | None
    ) -> int:
        """ShardService.expect on one rank now; its transfer id."""
        self._check()
        return self._get(self.actors[rank_index].expect.remote(request_id, block_ids, sources, timeout))

    def abort_transfers(self, request_id: str) -> None:
        """ShardService.abort_transfers on every other rank now, waiting for all. On a broken
        group it does nothing: the instance is leaving service and its ranks are being stopped."""
        if not self.broken:
            self._get([actor.abort_transfers.remote(request_id) for actor in self.actors])

    def take_results(self) -> list[TransferResult]:
        results, self._results = self._results, []
        return results

    def shutdown(self) -> None:
        try:
            ray.get([actor.shutdown.remote() for actor in self.actors], timeout=10)
        except Exception:  # dead ranks are killed by the launcher anyway
            pass

    def _take_commands(self, index: int) -> list[ShardCommand]:
        commands, self._commands[index] = self._commands[index], []
        return commands

    def _check(self) -> None:
        if self.broken:
            raise RuntimeError(f"instance out of service: {self.broken}")

    def _get(self, refs):
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except Exception as exc:
            self.mark_broken(f"a rank failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            raise

    def mark_broken(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            if self.on_broken is not None:
                self.on_broken(reason)

    def _collect(self, refs: list):
        replies = self._get(refs)
        for reply in replies:
            self._results.extend(reply.results)
        return next((r.logits for r in replies if r.logits is not None), None)


class _PendingStep:
    def __init__(self, group: ShardGroup, refs: list):
        self.group = group
        self.refs = refs

    def result(self):
        """Wait for every rank; the last stage's logits (None when rank 0 computes them)."""
        return self.group._collect(self.refs)
