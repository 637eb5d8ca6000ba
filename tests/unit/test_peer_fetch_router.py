"""The router's side of peer block fetch with stand-in links (the workers' side is
tests/integration/test_peer_fetch.py): the three calls in order when the rule says fetch, and
every failure (a stale index entry, a dead holder, a holder that never answers) ending in no
fetch and both sides told to drop it, never in an error."""

from __future__ import annotations

import asyncio
import time

from disagg.errors import WorkerLinkError
from disagg.kv_transfer.layout import KVLayout
from disagg.placement.peer_fetch import FetchRate
from disagg.registry import InstanceInfo, InstanceView, LoadReport
from disagg.router.directory import Instance, InstanceDirectory
from disagg.router.peer_fetch import PeerFetch
from disagg.router.streams import DecodeStreams
from disagg.rpc.messages import Reservation

BS = 16
HASHES = list(range(10))
PROMPT = list(range(10 * BS + 1))


class Link:
    """A request link that answers each call by method name from `answers` (a value, an
    exception to raise, or "hang"), and records the calls."""

    def __init__(self, name: str, answers: dict):
        self.name, self.answers, self.calls = name, answers, []

    async def call(self, method, *args, timeout_s: float):
        self.calls.append(method.__name__)
        answer = self.answers.get(method.__name__)
        if answer == "hang":
            await asyncio.sleep(timeout_s)
            raise asyncio.TimeoutError
        if isinstance(answer, Exception):
            raise answer
        return answer


def instance(instance_id: str, role: str, held: int, answers: dict) -> Instance:
    info = InstanceInfo(instance_id, role, "a", "", "random:tiny")
    inst = Instance(instance_id, role, None, InstanceView(info, LoadReport(), 0.0), Link(instance_id, answers))
    inst.indexed_hashes = set(HASHES[:held])
    return inst


def setup(holder_answers: dict, prefill_answers: dict | None = None):
    directory = InstanceDirectory(None, "test", b"k" * 32, DecodeStreams())
    slot = Reservation(1, [-1, -1, 5, 6, 7, 8, 9, 10, 11, 12], {"p0-import": 1}, KVLayout.single("p0-import", "x"))
    prefill = instance("p0", "prefill", 2, prefill_answers or {"reserve_peer_import": slot, "abort": True})
    holder = instance("d0", "decode", 10, {"peer_export_layout": KVLayout.single("d0-export", "y"), **holder_answers})
    directory._instances = {"p0": prefill, "d0": holder}
    fetch = PeerFetch(directory, BS, 1024, FetchRate(1e12, 0.0), timeout_s=0.5)
    return fetch, prefill, holder


def run(fetch: PeerFetch, prefill: Instance) -> int:
    async def go():
        got = await fetch.fetch("r", PROMPT, HASHES, prefill)
        await asyncio.sleep(0.01)  # the aborts, sent in the background
        return got

    return asyncio.run(go())


def test_a_fetch_asks_the_holder_then_the_prefill_then_the_holder_to_send():
    fetch, prefill, holder = setup({"export_prefix": True})
    assert run(fetch, prefill) == 10 * BS  # the prompt's tokens its prefill finds cached now
    assert holder.rpc.calls == ["peer_export_layout", "export_prefix"] and prefill.rpc.calls == ["reserve_peer_import"]
    assert run(fetch, prefill) == 10 * BS and holder.rpc.calls.count("peer_export_layout") == 1  # asked once


def test_a_stale_index_entry_costs_no_fetch_and_is_not_asked_again():
    fetch, prefill, holder = setup({"export_prefix": False, "abort": True})
    assert run(fetch, prefill) == 0
    assert prefill.rpc.calls[-1] == "abort" and holder.rpc.calls[-1] == "abort"  # both drop it now
    assert holder.cached_tokens(HASHES) == 2 * BS  # what it did not lend is not counted on
    assert fetch.plan(prefill, HASHES, len(PROMPT)) is None


def test_a_dead_holder_or_one_that_never_answers_costs_no_fetch_within_the_timeout():
    dead, prefill, _ = setup({"export_prefix": WorkerLinkError("link broke", "d0"), "abort": True})
    assert run(dead, prefill) == 0
    slow, prefill, holder = setup({"export_prefix": "hang", "abort": True})
    started = time.monotonic()
    assert run(slow, prefill) == 0 and time.monotonic() - started < 1.5
    assert holder.rpc.calls[-1] == "abort"


def test_no_room_on_the_prefill_instance_or_nothing_worth_fetching_asks_no_holder_to_send():
    fetch, prefill, holder = setup({"export_prefix": True}, {"reserve_peer_import": None, "abort": True})
    assert run(fetch, prefill) == 0 and "export_prefix" not in holder.rpc.calls
    slow_link = PeerFetch(fetch.directory, BS, 1024, FetchRate(1.0, 0.0), timeout_s=0.5)  # a byte a second
    _, prefill, holder = setup({"export_prefix": True})
    slow_link.directory._instances = {"p0": prefill, "d0": holder}
    assert run(slow_link, prefill) == 0 and holder.rpc.calls == []


def test_a_holder_that_lends_nothing_is_asked_once():
    fetch, prefill, holder = setup({"peer_export_layout": None, "abort": True})
    assert run(fetch, prefill) == 0 and holder.rpc.calls[0] == "peer_export_layout"
    holder.indexed_hashes = set(HASHES)  # the index lists its blocks again
    assert fetch.plan(prefill, HASHES, len(PROMPT)) is None
