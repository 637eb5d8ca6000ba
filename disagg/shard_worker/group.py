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
from disagg.kv_transfer.layout import KVRank

STEP_TIMEOUT_S = 120.0  # one forward pass of a shard, with room for a slow first step


class ShardGroup:
    def __init__(self, actors: list[tuple[RankPlace, "ray.actor.ActorHandle"]], timeout_s: float = STEP_TIMEOUT_S):
        self.places = [place for place, _ in actors]
        self.actors = [actor for _, actor in actors]
        self.timeout_s = timeout_s
        self.kv_ranks: list[KVRank] = []
        self._commands: list[list[tuple]] = [[] for _ in self.actors]
        self._results: list[TransferResult] = []

    # ---- setup: every rank joins the instance's groups at once -----------------------------------
    def start_join(self, store_address: str) -> list:
        return [actor.join.remote(store_address) for actor in self.actors]

    def finish_join(self, pending: list) -> None:
        endpoints = ray.get(pending, timeout=self.timeout_s)
        self.kv_ranks = [KVRank(peer_id, address, p.tp_rank, p.pp_rank) for (peer_id, address), p in zip(endpoints, self.places)]

    # ---- per step ------------------------------------------------------------------------------
    def submit(self, chunks) -> "_PendingStep":
        """Start the step on every other rank (the model runner's `followers` hook)."""
        plain = portable(chunks)
        return _PendingStep(self, [actor.step.remote(plain, self._take_commands(i)) for i, actor in enumerate(self.actors)])

    def sync(self, wait_s: float = 0.0) -> None:
        """No step to run: deliver queued commands and collect finished transfers (each rank
        waits up to wait_s for one)."""
        refs = [actor.step.remote(None, self._take_commands(i), wait_s) for i, actor in enumerate(self.actors)]
        self._collect(refs)

    def command(self, rank_index: int, name: str, *args) -> None:
        self._commands[rank_index].append((name, *args))

    def command_all(self, name: str, *args) -> None:
        for i in range(len(self.actors)):
            self.command(i, name, *args)

    def has_commands(self) -> bool:
        return any(self._commands)

    def call_all(self, method: str, *args) -> list:
        """Run one method on every other rank now and wait for all (handshake, cancel)."""
        return ray.get([getattr(actor, method).remote(*args) for actor in self.actors], timeout=self.timeout_s)

    def call(self, rank_index: int, method: str, *args):
        return ray.get(getattr(self.actors[rank_index], method).remote(*args), timeout=self.timeout_s)

    def take_results(self) -> list[TransferResult]:
        results, self._results = self._results, []
        return results

    def shutdown(self) -> None:
        try:
            ray.get([actor.shutdown.remote() for actor in self.actors], timeout=10)
        except Exception:  # dead ranks are killed by the launcher anyway
            pass

    def _take_commands(self, index: int) -> list[tuple]:
        commands, self._commands[index] = self._commands[index], []
        return commands

    def _collect(self, refs: list):
        replies = ray.get(refs, timeout=self.timeout_s)
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
