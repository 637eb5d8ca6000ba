"""A follower rank applies rank 0's KV commands by type, in order, before its part of the step,
and answers the transfer ids of those it expects; rank 0's ShardGroup queues them per rank and
delivers them with the next step."""

from __future__ import annotations

import pytest

from disagg.config import EngineConfig, ParallelConfig, Role, WorkerConfig
from disagg.engine.distributed import RankPlace
from disagg.kv_transfer.layout import KVTarget
from disagg.worker.shard_group import ShardGroup
from disagg.worker.shard import ShardActor
from disagg.worker.shard_service import AbortTransfers, AddTargets, CatchUp, Expect, FinishTransfer, ShardService


class RecordingSender:
    def __init__(self):
        self.calls = []
        self.registered = set()

    def add(self, request_id, targets):
        self.registered.add(request_id)
        self.calls.append(("add", request_id, targets))

    def catch_up(self, request_id, block_ids, num_tokens):
        self.calls.append(("catch_up", request_id, block_ids, num_tokens))

    def has_transfer(self, request_id):
        return request_id in self.registered

    def finish(self, request_id, first_token):
        self.calls.append(("finish", request_id, first_token))

    def has_finished(self):
        return False

    def expect(self, request_id, block_ids, sources, timeout):
        self.calls.append(("expect", request_id, block_ids, sources, timeout))
        return 40 + len(self.calls)

    def abort(self, request_id):
        self.calls.append(("abort", request_id))

    def poll(self):
        return []


def follower() -> ShardActor:
    parallel = ParallelConfig(tensor_parallel_size=2, tp_rank=1)
    return ShardActor(WorkerConfig("p", Role.PREFILL, EngineConfig(parallel=parallel)))


def test_commands_apply_by_type_in_order():
    rank = follower()
    assert isinstance(rank, ShardService)
    rank.endpoint = sender = RecordingSender()
    target = KVTarget("d", "addr", 1, [4], (0, 2), (1, 2))
    rank.run_step(
        None, [AddTargets("r", [target]), CatchUp("r", [4], 9), FinishTransfer("r"), FinishTransfer("unknown")]
    )
    assert sender.calls == [("add", "r", [target]), ("catch_up", "r", [4], 9), ("finish", "r", -1)]


def test_a_decode_rank_answers_the_transfer_ids_it_expects_and_aborts_in_order():
    rank = follower()
    rank.endpoint = receiver = RecordingSender()
    reply = rank.run_step(
        None, [Expect("r", [4], {"p": "a:1"}, 2.0), AbortTransfers("q"), Expect("s", [5], {"p": "a:1"}, None)]
    )
    assert reply.transfer_ids == [41, 43]
    assert [c[0] for c in receiver.calls] == ["expect", "abort", "expect"]


def test_an_unknown_command_is_refused():
    rank = follower()
    rank.endpoint = RecordingSender()
    with pytest.raises(TypeError, match="unknown shard command"):
        rank.run_step(None, [("add", "r", [])])


def test_the_group_queues_commands_per_rank_until_the_next_step():
    group = ShardGroup([(RankPlace(1, 2, 0, 1), object()), (RankPlace(0, 2, 1, 2), object())])
    target = KVTarget("d", "addr", 1, [4], (0, 2), (0, 1))
    group.add_targets(1, "r", [target])
    group.catch_up("r", [4], 9)
    group.finish_transfer("r")
    assert group.has_commands()
    assert group._take_commands(0) == [CatchUp("r", [4], 9), FinishTransfer("r")]
    assert group._take_commands(1) == [AddTargets("r", [target]), CatchUp("r", [4], 9), FinishTransfer("r")]
    assert not group.has_commands()
