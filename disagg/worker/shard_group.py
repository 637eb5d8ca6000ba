"""Rank 0's handle on the other ranks of its instance.

Each engine step rank 0 sends every other rank the step's chunks (plain copies) together with
the KV commands queued for each rank since the last step, then runs its own part; the answers
bring the last stage's logits and each rank's finished transfers. The steps go over rank 0's
step channel (disagg.worker.step_channel: shared memory on one host), not through Ray, whose
calls stay for the lifecycle (join, open_channel, shutdown).

A command always reaches a rank before any later step: the commands ride in the step's own
order, in the order they were queued. Those whose answer rank 0 needs at once (a decode rank's
`expect`, every rank's `abort_transfers`) go in an order of their own, sent and answered now,
between two steps, from rank 0's engine thread like every order. Every wait has a timeout: a
rank that died fails the step at once, one that hangs at its step timeout, instead of stalling
the instance.
"""

from __future__ import annotations

from collections.abc import Callable

import ray
import torch

from disagg.config import DEFAULT_STEP_TIMEOUT_S
from disagg.engine.distributed import RankPlace
from disagg.engine.step_chunks import portable
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVRank, KVTarget
from disagg.worker.instance_world import WorldAddress
from disagg.worker.shard_service import (
    AbortTransfers,
    AddTargets,
    CatchUp,
    Expect,
    FinishTransfer,
    JoinedRank,
    ShardCommand,
)
from disagg.worker.step_channel import OPEN_TIMEOUT_S, ChannelOffer, DriverChannel
from disagg.worker.step_messages import StepAnswer, StepOrder, decode_answer, encode_order

IDLE_POLL_S = 0.005  # how long an idle instance's other ranks wait for a transfer to finish


class ShardGroup:
    def __init__(
        self,
        actors: list[tuple[RankPlace, "ray.actor.ActorHandle"]],
        timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        *,
        host: str = "127.0.0.1",
        link_key: bytes = b"",
        device: torch.device | None = None,
        on_broken: Callable[[str], None] | None = None,
    ):
        """`actors`: (place, Ray handle of a ShardService) of every other rank. `host`: where
        rank 0 listens for ranks on other hosts, which prove they hold `link_key`; `device`:
        where the logits the last stage sends belong; `on_broken`: called once, with the reason,
        when the group breaks."""
        self.places = [place for place, _ in actors]
        self.actors = [actor for _, actor in actors]  # Ray handles of ShardService actors
        self.timeout_s = timeout_s
        self.host = host
        self.link_key = link_key
        self.device = device
        self.kv_ranks: list[KVRank] = []
        self.channel: DriverChannel | None = None  # open once the ranks joined
        self._commands: list[list[ShardCommand]] = [[] for _ in self.actors]
        self._results: list[TransferResult] = []
        self._step_number = 0
        self._answers: list[StepAnswer] = []  # the latest order's, by rank index
        # Set when a call to a rank failed: the ranks may no longer be in lockstep (one may be
        # dead, or stuck in a collective), so nothing more is sent; rank 0 leaves service.
        self.broken: str | None = None
        self.on_broken = on_broken

    # ---- setup: every rank joins the instance's groups at once -----------------------------------
    def start_join(self, world: WorldAddress) -> list:
        return [actor.join.remote(world) for actor in self.actors]

    def finish_join(self, pending: list) -> None:
        """Wait for the ranks to have joined, then open the step channel to them."""
        joined: list[JoinedRank] = ray.get(pending, timeout=self.timeout_s)
        self.kv_ranks = [KVRank(j.peer_id, j.kv_address, p.tp_rank, p.pp_rank) for j, p in zip(joined, self.places)]
        offer = ChannelOffer([(j.pid, j.channel_key) for j in joined], self.host)
        opening = [actor.open_channel.remote(invite) for actor, invite in zip(self.actors, offer.invites)]
        self.channel = offer.accept(self.link_key, OPEN_TIMEOUT_S)
        ray.get(opening, timeout=OPEN_TIMEOUT_S)

    # ---- per step: over the step channel -------------------------------------------------------------
    def submit(self, chunks) -> "_PendingStep":
        """Start the step on every other rank (disagg.engine.kv_connector.Followers)."""
        return _PendingStep(self, self._send(portable(chunks), wait_s=0.0))

    def sync(self) -> None:
        """No step to run: deliver queued commands and collect finished transfers. With no
        commands to deliver, each rank waits up to IDLE_POLL_S for a transfer to finish."""
        wait_s = 0.0 if self.has_commands() else IDLE_POLL_S
        self._collect(self._send(None, wait_s))

    def _round_trip(self) -> list[StepAnswer]:
        """Deliver the queued commands now, in an order with no step; every rank's answer."""
        number = self._send(None, 0.0)
        self._collect(number)
        return self._answers

    def _send(self, chunks, wait_s: float) -> int:
        """Send the step's order (with every rank's queued commands); the step's number."""
        self._check()
        self._step_number += 1
        commands = [self._take_commands(i) for i in range(len(self.actors))]
        order = StepOrder(self._step_number, chunks, commands, wait_s)
        self._guarded(lambda: self.channel.send(encode_order(order), self.timeout_s))
        return order.number

    def _collect(self, number: int):
        """Every rank's answer to step `number`; the last stage's logits, if a rank sent them."""
        answers = self._guarded(lambda: [decode_answer(p, self.device) for p in self.channel.recv_all(self.timeout_s)])
        for place, answer in zip(self.places, answers):
            self._check_answer(place, answer, number)
        for answer in answers:
            self._results.extend(answer.reply.results)
        self._answers = answers
        return next((a.reply.logits for a in answers if a.reply.logits is not None), None)

    def _check_answer(self, place: RankPlace, answer: StepAnswer, number: int) -> None:
        if answer.error is None and answer.number == number:
            return
        what = answer.error or f"answered step {answer.number} to step {number}"
        self.mark_broken(f"rank {place.rank} failed: {what}")
        raise RuntimeError(f"rank {place.rank} of the instance failed its step: {what}")

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

    # ---- commands answered now, over the step channel ------------------------------------------------
    def expect(
        self, request_id: str, block_ids: list[int], sources: list[dict[str, str]], timeout: float | None
    ) -> list[int]:
        """Every other rank listens for its slice of a request's KV (`sources[i]`: rank index i's
        peers); their transfer ids, by index."""
        for commands, rank_sources in zip(self._commands, sources):
            commands.append(Expect(request_id, list(block_ids), rank_sources, timeout))
        return [answer.reply.transfer_ids[-1] for answer in self._round_trip()]

    def abort_transfers(self, request_id: str) -> None:
        """Every other rank gives up on the request's transfers, before this returns. On a broken
        group it does nothing: the instance is leaving service and its ranks are being stopped."""
        if not self.broken:
            self._command_all(AbortTransfers(request_id))
            self._round_trip()

    def take_results(self) -> list[TransferResult]:
        results, self._results = self._results, []
        return results

    def shutdown(self) -> None:
        try:
            ray.get([actor.shutdown.remote() for actor in self.actors], timeout=10)
        except Exception:  # dead ranks are killed by the launcher anyway
            pass
        if self.channel is not None:
            self.channel.close()

    def _take_commands(self, index: int) -> list[ShardCommand]:
        commands, self._commands[index] = self._commands[index], []
        return commands

    def _check(self) -> None:
        if self.broken:
            raise RuntimeError(f"instance out of service: {self.broken}")

    def _guarded(self, call):
        """`call()`; any failure breaks the group."""
        try:
            return call()
        except Exception as exc:
            self.mark_broken(f"a rank failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            raise

    def mark_broken(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            if self.on_broken is not None:
                self.on_broken(reason)


class _PendingStep:
    def __init__(self, group: ShardGroup, number: int):
        self.group = group
        self.number = number

    def result(self):
        """Wait for every rank; the last stage's logits (None when rank 0 computes them)."""
        return self.group._collect(self.number)
