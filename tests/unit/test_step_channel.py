"""Rank 0's step channel, without Ray: ShardGroup sends each step (with every rank's queued
commands) over shared-memory rings or, for ranks on another host, TCP, and gathers the answers;
a follower's error, or a follower process killed mid-step, fails the step at once and takes
the group out of service instead of hanging."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch

from disagg.engine.distributed import RankPlace
from disagg.engine.step_chunks import PortableChunk, RequestRef
from disagg.kv_transfer.endpoint import TransferResult
from disagg.worker.follower_loop import FollowerLoop
from disagg.worker.shard_group import ShardGroup
from disagg.worker.shard_service import AbortTransfers, CatchUp, Expect, FinishTransfer, ShardReply
from disagg.worker.step_channel import ChannelOffer, channel_key, open_follower_channel
from disagg.worker.step_messages import StepAnswer, decode_answer, encode_answer

KEY = b"k" * 32
PLACES = [RankPlace(1, 2, 0, 2), RankPlace(0, 2, 1, 2), RankPlace(1, 2, 1, 2)]  # ranks 1..3 of TP2 x PP2


def chunk(request_id: str = "r", tokens: int = 3) -> PortableChunk:
    return PortableChunk(RequestRef(request_id, [0, 1]), 0, tokens, list(range(tokens)), True)


class Follower:
    """A follower rank's loop with a stand-in for its engine: records what it ran; the rank at
    index 1 (the last stage's first TP rank) answers with logits."""

    def __init__(self, index: int):
        self.index = index
        self.ran: list[tuple] = []

    def run_step(self, chunks, commands, wait_s):
        self.ran.append((chunks, commands, wait_s))
        if chunks and chunks[0].request.request_id == "fail":
            raise ValueError("this rank broke")
        expected = [100 + self.index for c in commands if isinstance(c, Expect)]  # a receiver's transfer ids
        if self.index != 1 or not chunks:
            return ShardReply(None, [TransferResult(f"done-{self.index}", True)], expected)
        width = 1000 if chunks[0].request.request_id == "wide" else 8
        logits = torch.arange(width * len(chunks), dtype=torch.float32).view(len(chunks), width)
        return ShardReply(logits, [TransferResult(f"done-{self.index}", True)])


def group_over(shared_memory: bool, broken: list | None = None):
    """A ShardGroup and its three followers' loops, all in this process."""
    offer = ChannelOffer([(os.getpid(), channel_key())] * 3, "127.0.0.1", shared_memory=shared_memory)
    followers = [Follower(i) for i in range(3)]
    opened: dict = {}
    openers = [
        threading.Thread(target=lambda i=i: opened.update({i: open_follower_channel(offer.invites[i], KEY, 10)}))
        for i in range(3)
    ]
    for opener in openers:  # a TCP follower's open waits for rank 0 to accept
        opener.start()
    channel = offer.accept(KEY, 10)
    for opener in openers:
        opener.join(10)
    loops = [FollowerLoop(opened[i], i, followers[i].run_step, f"follower-{i}") for i in range(3)]
    for loop in loops:
        loop.start()
    group = ShardGroup(
        [(p, object()) for p in PLACES], timeout_s=10, on_broken=broken.append if broken is not None else None
    )
    group.channel = channel
    return group, followers, loops


@pytest.fixture(params=[True, False], ids=["shared-memory", "tcp"])
def driven(request):
    group, followers, loops = group_over(shared_memory=request.param)
    yield group, followers
    for loop in loops:
        loop.stop()
    group.channel.close()


def test_a_step_reaches_every_rank_with_its_own_commands(driven):
    group, followers = driven
    group.add_targets(2, "r", [])
    group.catch_up("r", [4], 9)
    logits = group.submit([chunk(), chunk("s", 1)]).result()
    assert torch.equal(logits, torch.arange(16, dtype=torch.float32).view(2, 8))
    for index, follower in enumerate(followers):
        chunks, commands, wait_s = follower.ran[-1]
        assert [c.request.request_id for c in chunks] == ["r", "s"] and wait_s == 0.0
        assert commands[-1] == CatchUp("r", [4], 9) and len(commands) == (2 if index == 2 else 1)
    assert sorted(r.request_id for r in group.take_results()) == ["done-0", "done-1", "done-2"]


def test_many_steps_and_syncs_go_in_order(driven):
    group, followers = driven
    for step in range(200):
        if step % 3 == 0:
            group.finish_transfer(f"r{step}")
            group.sync()
        else:
            assert group.submit([chunk(tokens=1 + step % 5)]).result().shape == (1, 8)
    ran = followers[0].ran
    assert len(ran) == 200
    assert [c for _, c, _ in ran if c] == [[FinishTransfer(f"r{s}")] for s in range(0, 200, 3)]
    assert len(group.take_results()) == 3 * 200


def test_a_decode_instances_reservation_reaches_every_rank_over_the_channel_not_ray(driven):
    """The handshake of a TP x PP decode instance: each other rank expects its own slice and
    answers its transfer id at once, in an order of its own (the group's actor handles here are
    plain objects: a Ray call would fail); an abort reaches every rank the same way."""
    group, followers = driven
    sources = [{"p/rank1": "a:1"}, {"p/rank2": "b:2"}, {"p/rank3": "c:3"}]
    assert group.expect("r", [4, 5], sources, 2.0) == [100, 101, 102]
    for index, follower in enumerate(followers):
        chunks, commands, wait_s = follower.ran[-1]
        assert chunks is None and wait_s == 0.0 and commands == [Expect("r", [4, 5], sources[index], 2.0)]
    group.abort_transfers("r")
    assert all(f.ran[-1][1] == [AbortTransfers("r")] for f in followers)


def test_a_sync_without_commands_lets_idle_ranks_wait_for_transfers(driven):
    group, followers = driven
    group.sync()
    assert followers[2].ran == [(None, [], pytest.approx(0.005))]


def test_orders_and_answers_bigger_than_their_rings_stream_through(driven):
    group, _ = driven
    logits = group.submit([chunk("wide", tokens=300) for i in range(2_000)]).result()  # 1.5 MB order, 8 MB logits
    assert logits.shape == (2_000, 1000) and logits[-1, -1].item() == 2_000 * 1000 - 1


def test_a_rank_that_fails_its_step_takes_the_group_out_of_service():
    broken: list = []
    group, _, loops = group_over(shared_memory=True, broken=broken)
    try:
        with pytest.raises(RuntimeError, match="this rank broke"):
            group.submit([chunk("fail")]).result()
        assert len(broken) == 1 and "rank 1 failed" in broken[0]
        with pytest.raises(RuntimeError, match="out of service"):
            group.submit([chunk()])
    finally:
        for loop in loops:
            loop.stop()


def test_answers_carry_logits_of_any_dtype_and_errors():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(3, 5).to(dtype)
        answer = decode_answer(
            bytearray(encode_answer(StepAnswer(7, ShardReply(logits, [TransferResult("r", False)]))))
        )
        assert answer.number == 7 and torch.equal(answer.reply.logits, logits)
        assert answer.reply.results == [TransferResult("r", False)]
    failed = decode_answer(bytearray(encode_answer(StepAnswer(8, ShardReply(), error="boom"))))
    assert failed.error == "boom" and failed.reply.logits is None


# ---- a follower in a process of its own, killed while it runs a step --------------------------------
FOLLOWER = """
import pickle, sys, time
from disagg.worker.follower_loop import FollowerLoop
from disagg.worker.shard_service import ShardReply
from disagg.worker.step_channel import open_follower_channel

def run_step(chunks, commands, wait_s):
    if chunks and chunks[0].request.request_id == "hang":
        time.sleep(600)  # stuck in a collective, say, until it is killed
    return ShardReply()

invite, key = pickle.loads(bytes.fromhex(sys.stdin.readline()))
loop = FollowerLoop(open_follower_channel(invite, key, 10), invite.index, run_step, "follower")
loop.start()
print("open", flush=True)
loop._thread.join()
"""


def follower_process() -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-c", FOLLOWER]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def invite_process(child: subprocess.Popen, invite) -> None:
    child.stdin.write(pickle.dumps((invite, KEY)).hex() + "\n")
    child.stdin.flush()


def fails_at_once_when_killed(group: ShardGroup, child: subprocess.Popen) -> None:
    """A step that `child` hangs in fails soon after it is killed, well before the group's timeout."""
    pending = group.submit([chunk("hang")])
    threading.Timer(0.3, child.kill).start()
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        pending.result()
    assert time.monotonic() - started < 5, "rank 0 waited for its timeout, not for the rank's exit"


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "tcp"])
def test_a_killed_rank_fails_the_step_at_once(shared_memory):
    child = follower_process()
    broken: list = []
    try:
        offer = ChannelOffer([(child.pid, channel_key())], "127.0.0.1", shared_memory=shared_memory)
        invite_process(child, offer.invites[0])
        group = ShardGroup([(PLACES[0], object())], timeout_s=120, on_broken=broken.append)
        group.channel = offer.accept(KEY, 30)
        assert child.stdout.readline().strip() == "open"
        assert group.submit([chunk()]).result() is None
        fails_at_once_when_killed(group, child)
        assert len(broken) == 1
    finally:
        child.kill()
        child.wait()


def test_a_killed_rank_fails_the_wait_for_another_ranks_answer():
    """Rank 0 waits for follower 0, which hangs (in a collective with the killed follower 1, say):
    follower 1's exit ends that wait too."""
    child = follower_process()
    released = threading.Event()

    def stuck_until_released(chunks, commands, wait_s):
        if chunks and chunks[0].request.request_id == "hang":
            released.wait(60)
        return ShardReply()

    loop = None
    try:
        offer = ChannelOffer([(os.getpid(), channel_key()), (child.pid, channel_key())], "127.0.0.1")
        invite_process(child, offer.invites[1])
        loop = FollowerLoop(open_follower_channel(offer.invites[0], KEY, 10), 0, stuck_until_released, "follower-0")
        loop.start()
        group = ShardGroup([(p, object()) for p in PLACES[:2]], timeout_s=120)
        group.channel = offer.accept(KEY, 30)
        assert child.stdout.readline().strip() == "open"
        fails_at_once_when_killed(group, child)
    finally:
        released.set()
        if loop is not None:
            loop.stop()
        child.kill()
        child.wait()
