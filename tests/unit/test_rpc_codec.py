"""The request link's fixed-schema frames (disagg.rpc.codec, disagg.rpc.framing): every message
type survives the trip as it was, and nothing else is decoded, a pickle least of all."""

from __future__ import annotations

import asyncio
import os
import pickle
import struct

import msgpack
import pytest

from disagg.kv_transfer.layout import KVLayout, KVRank
from disagg.request import SamplingParams, StructuredOutput
from disagg.rpc.codec import Codec, FrameError
from disagg.rpc.framing import CODEC, decode, encode, sealed
from disagg.rpc.messages import PrefillResult, Reservation, TokenDelta
from disagg.rpc.server import RpcServer
from disagg.rpc.services import PrefillService
from tests.support import LINK_KEY, authenticated_socket


def roundtrip(value):
    return CODEC.decode(CODEC.encode(value))


def test_every_message_type_comes_back_equal():
    layout = KVLayout(1, 2, (KVRank("p/rank0", "127.0.0.1:1", 0, 0), KVRank("p/rank1", "127.0.0.1:2", 0, 1)))
    values = [
        TokenDelta(
            "r1",
            [5, 6],
            text="hi",
            logprobs=[-0.5, -1.0],
            finished=True,
            finish_reason="stop",
            num_output_tokens=2,
            decode_s=0.25,
        ),
        PrefillResult("r2", 7, "x", None, False, None, 12, 0, 0.001, 0.05),
        Reservation(3, [4, 5], {"d/rank0": 3}, layout),
        SamplingParams(temperature=0.0, max_tokens=4, stop=["\n"], seed=3, logprobs=1),
        SamplingParams(structured=StructuredOutput("regex", "[0-9]+"), resumed_tokens=2),
    ]
    for value in values:
        assert roundtrip(value) == value
    back = roundtrip(layout)
    assert isinstance(back.ranks, tuple) and hash(back) == hash(layout)  # frozen, hashable as sent


def test_frames_carry_calls_with_messages_inside():
    call = (7, "prefill", ["r1", [1, 2, 3], SamplingParams(max_tokens=2)])
    assert decode(encode(call)[4:]) == (7, "prefill", ["r1", [1, 2, 3], SamplingParams(max_tokens=2)])


def test_a_class_outside_the_schema_is_refused_both_ways():
    class Stranger:
        pass

    with pytest.raises(TypeError, match="not a message type"):
        CODEC.encode([Stranger()])
    forged = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Popen", [["sh", "-c", "true"]]])))
    with pytest.raises(FrameError, match="unknown message type"):
        CODEC.decode(forged)


def test_a_message_with_other_fields_or_bad_values_is_refused():
    three_fields = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["TokenDelta", ["r", [1], "x"]])))
    with pytest.raises(FrameError, match="expected"):
        CODEC.decode(three_fields)
    bad_params = CODEC.encode(SamplingParams()).replace(msgpack.packb(1.0), msgpack.packb(-2.0), 1)  # temperature -2
    with pytest.raises(FrameError, match="temperature"):
        CODEC.decode(bad_params)
    with pytest.raises(FrameError):
        CODEC.decode(msgpack.packb({1: "an int key"}))
    with pytest.raises(FrameError):
        Codec((TokenDelta,)).decode(CODEC.encode(SamplingParams()))  # each codec knows only its own types


def test_a_pickle_sent_on_a_link_is_never_unpickled(tmp_path):
    flag = tmp_path / "executed"

    class Exploit:
        def __reduce__(self):
            return (os.mkdir, (str(flag),))

    class Prefill(PrefillService):
        pass

    server = RpcServer(Prefill(), PrefillService, LINK_KEY, "127.0.0.1", name="pickle")
    body = pickle.dumps((1, "prefill", (Exploit(),)))
    try:
        raw, seals = authenticated_socket(server.address)
        with raw:  # a frame sealed as a router would: only the codec stands in the way
            raw.sendall(sealed(struct.pack(">I", len(body)) + body, seals.outgoing))
            raw.settimeout(5)
            assert raw.recv(1) == b""  # the worker hung up on a frame it could not read
    finally:
        server.close()
    assert not flag.exists()
    with pytest.raises(FrameError):
        decode(body)


def test_the_server_dispatches_only_what_its_service_declares():
    class Prefill(PrefillService):
        def abort(self, request_id: str) -> bool:
            return request_id == "known"

        def debug_dump(self):  # public, but not part of the service
            return "secret"

    server = RpcServer(Prefill(), PrefillService, LINK_KEY, "127.0.0.1", name="dispatch")
    assert set(server.handlers) == {"prefill", "set_kv_targets", "abort"}

    async def scenario():
        from disagg.errors import RemoteError
        from disagg.rpc.client import RpcClient
        from disagg.rpc.stubs import PrefillStub

        link = RpcClient(server.address, LINK_KEY)
        assert await PrefillStub(link).abort("known", timeout_s=5) is True

        def debug_dump(): ...

        with pytest.raises(RemoteError, match="unknown method"):
            await link.call(debug_dump, timeout_s=5)
        await link.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()


def test_a_requests_priority_reaches_the_worker_in_every_call_that_queues_it():
    """Through the stubs, the frames and the server's dispatch: the priority the router sends is
    the one the worker's engine gets (a prefill, the decode handshake, a whole request, a live
    move's target), and a call without one is standard."""
    from disagg.request import PRIORITY_VALUES
    from disagg.rpc.client import RpcClient
    from disagg.rpc.services import DecodeService
    from disagg.rpc.stubs import DecodeStub, PrefillStub

    seen: list[tuple[str, object]] = []

    class Prefill(PrefillService):
        def prefill(self, request_id, prompt_token_ids, params, priority=0):
            seen.append(("prefill", priority))
            return PrefillResult(request_id, 7, "", None, False, None, len(prompt_token_ids), 0, 0.0, 0.0)

    class Decode(DecodeService):
        def reserve(self, request_id, prompt_token_ids, params, prefill, kv_wait_s, priority=0):
            seen.append(("reserve", priority))

        def submit(self, request_id, prompt_token_ids, params, priority=0):
            seen.append(("submit", priority))

        def reserve_migration(
            self, request_id, token_ids, params, num_prompt_tokens, source, capacity, wait, priority=0
        ):
            seen.append(("reserve_migration", priority))

    prefill_server = RpcServer(Prefill(), PrefillService, LINK_KEY, "127.0.0.1", name="prefill")
    decode_server = RpcServer(Decode(), DecodeService, LINK_KEY, "127.0.0.1", name="decode")
    critical, sheddable = PRIORITY_VALUES["critical"], PRIORITY_VALUES["sheddable"]
    layout = KVLayout(1, 1, (KVRank("p/rank0", "127.0.0.1:1", 0, 0),))
    params = SamplingParams(max_tokens=2)

    async def scenario():
        links = [RpcClient(prefill_server.address, LINK_KEY), RpcClient(decode_server.address, LINK_KEY)]
        prefill, decode = PrefillStub(links[0]), DecodeStub(links[1])
        assert (await (await prefill.prefill("r", [1, 2], params, critical))).token_id == 7
        await decode.reserve("r", [1, 2], params, layout, 1.0, sheddable, timeout_s=5)
        await decode.submit("r", [1, 2], params, critical, timeout_s=5)
        await decode.reserve_migration("r", [1, 2, 3], params, 2, layout, 8, 1.0, sheddable, timeout_s=5)
        await decode.submit("r", [1, 2], params, timeout_s=5)
        for link in links:
            await link.close()

    try:
        asyncio.run(scenario())
    finally:
        prefill_server.close()
        decode_server.close()
    assert seen == [
        ("prefill", critical),
        ("reserve", sheddable),
        ("submit", critical),
        ("reserve_migration", sheddable),
        ("submit", PRIORITY_VALUES["standard"]),
    ]
