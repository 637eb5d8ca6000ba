"""The request link between the router and a worker (disagg.rpc): real sockets on 127.0.0.1,
a worker-side server with threads and a router-side asyncio client, as in the service."""

from __future__ import annotations

import asyncio
import struct
import socket
import threading
import time
from concurrent.futures import Future

import pytest

from disagg.errors import RemoteError, RequestFailedError, WorkerLinkError
from disagg.rpc.client import RpcClient
from disagg.rpc.framing import MAX_FRAME_BYTES, REPLY, encode, recv_frame, sealed
from disagg.rpc.server import HELLO_TIMEOUT_S, RpcServer
from tests.support import LINK_KEY, authenticated_socket


class Arithmetic:
    """A service as the tests declare it (disagg.rpc.services declares the real ones)."""

    def add(self, a: int, b: int) -> int: ...
    def later(self, key: str) -> str: ...
    def fail(self, kind: str) -> None: ...
    def stream(self, n: int) -> int: ...
    def drop(self) -> None: ...


class ArithmeticWorker(Arithmetic):
    def __init__(self):
        self.pending: dict[str, Future] = {}
        self.rpc: RpcServer | None = None

    def add(self, a, b):
        return a + b

    def later(self, key):
        self.pending[key] = Future()
        return self.pending[key]

    def fail(self, kind):
        raise {
            "value": ValueError("prompt: empty"),
            "runtime": RuntimeError("engine broke"),
            "request": RequestFailedError("step failed on this request"),
        }[kind]

    def stream(self, n):
        for i in range(n):
            self.rpc.caller().send_event("tokens", [i])
        return n

    def drop(self):
        self.rpc.caller().close()


@pytest.fixture
def server():
    worker = ArithmeticWorker()
    closed_links = []
    srv = worker.rpc = RpcServer(
        worker, Arithmetic, LINK_KEY, "127.0.0.1", name="test", on_link_closed=closed_links.append
    )
    srv.pending = worker.pending
    srv.closed_links = closed_links
    yield srv
    srv.close()


async def settled(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


class Heard:
    """A link's listener: its events and its losses, as they came."""

    def __init__(self):
        self.events, self.lost = [], []

    def link_event(self, link, topic, payload):
        self.events.append((topic, payload))

    def link_lost(self, link):
        self.lost.append(link)


def client_of(srv: RpcServer, key: bytes = LINK_KEY, listener: Heard | None = None) -> RpcClient:
    return RpcClient(srv.address, key, name="worker", listener=listener)


def test_calls_are_answered_and_replies_do_not_wait_for_each_other(server):
    async def scenario():
        client = client_of(server)
        assert await client.call(Arithmetic.add, 2, 3, timeout_s=5) == 5
        slow = await client.submit(Arithmetic.later, "a")
        assert await client.call(Arithmetic.add, 1, 1, timeout_s=5) == 2  # answered while "a" is pending
        # Completed from another thread, as the engine thread completes a first token.
        threading.Thread(target=lambda: server.pending["a"].set_result("first token")).start()
        assert await asyncio.wait_for(slow, 5) == "first token"
        await client.close()

    asyncio.run(scenario())


def test_errors_keep_their_status_code_and_the_link_keeps_serving(server):
    async def scenario():
        client = client_of(server)
        with pytest.raises(RemoteError, match="prompt: empty") as bad:
            await client.call(Arithmetic.fail, "value", timeout_s=5)
        assert bad.value.grpc_code_name == "INVALID_ARGUMENT"
        with pytest.raises(RemoteError, match="engine broke") as broken:
            await client.call(Arithmetic.fail, "runtime", timeout_s=5)
        assert broken.value.grpc_code_name == "UNAVAILABLE"  # the worker failed, not the request
        with pytest.raises(RemoteError, match="on this request") as own:
            await client.call(Arithmetic.fail, "request", timeout_s=5)
        assert own.value.grpc_code_name == "INTERNAL"  # the request's own fault: not retried elsewhere

        def no_such_method(): ...

        with pytest.raises(RemoteError, match="unknown method"):
            await client.call(no_such_method, timeout_s=5)
        cancelled = await client.submit(Arithmetic.later, "c")
        await client.call(Arithmetic.add, 0, 0, timeout_s=5)  # one reader thread per link: "c" is registered by now
        server.pending["c"].cancel()  # the worker aborted the request
        with pytest.raises(RemoteError, match="aborted") as aborted:
            await asyncio.wait_for(cancelled, 5)
        assert aborted.value.grpc_code_name == "CANCELLED"
        assert await client.call(Arithmetic.add, 20, 22, timeout_s=5) == 42
        await client.close()

    asyncio.run(scenario())


def test_events_arrive_in_order_before_the_reply(server):
    async def scenario():
        heard = Heard()
        client = client_of(server, listener=heard)
        assert await client.call(Arithmetic.stream, 50, timeout_s=5) == 50
        assert heard.events == [("tokens", [i]) for i in range(50)]
        await client.close()

    asyncio.run(scenario())


def test_a_wait_times_out_and_leaves_nothing_pending(server):
    async def scenario():
        client = client_of(server)
        with pytest.raises(asyncio.TimeoutError):
            await client.call(Arithmetic.later, "never", timeout_s=0.2)
        assert client._pending == {}
        assert await client.call(Arithmetic.add, 1, 2, timeout_s=5) == 3
        await client.close()

    asyncio.run(scenario())


def test_a_wrong_key_is_refused_and_others_are_unaffected(server):
    async def scenario():
        intruder = client_of(server, key=bytes(32))
        with pytest.raises(WorkerLinkError):
            await intruder.call(Arithmetic.add, 1, 2, timeout_s=5)
        client = client_of(server)
        assert await client.call(Arithmetic.add, 1, 2, timeout_s=5) == 3
        await client.close()

    asyncio.run(scenario())


def test_garbage_after_the_handshake_closes_that_link_only(server):
    raw, _ = authenticated_socket(server.address)
    with raw:
        raw.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
        raw.settimeout(5)
        assert raw.recv(1) == b""  # the worker hung up on a frame it will not read
    assert asyncio.run(settled(lambda: len(server.closed_links) == 1))

    async def scenario():
        client = client_of(server)
        assert await client.call(Arithmetic.add, 1, 2, timeout_s=5) == 3
        await client.close()

    asyncio.run(scenario())


def call_frame(call_id: int, a: int, b: int) -> bytes:
    return encode((call_id, "add", [a, b]))


@pytest.mark.parametrize("tamper", ["flip a bit", "replay", "forged tag"])
def test_a_frame_changed_or_replayed_on_the_way_closes_that_link(server, tamper):
    """After the handshake every frame carries a tag over its number and bytes: a sealed call
    is answered; one altered, sent twice or tagged without the seals ends the link (the worker answers nothing
    more on it, and serves other links)."""
    before = len(server.closed_links)
    raw, seals = authenticated_socket(server.address)
    with raw:
        raw.settimeout(5)
        first = sealed(call_frame(1, 2, 3), seals.outgoing)
        raw.sendall(first)
        assert recv_frame(raw, seals.incoming) == (REPLY, 1, 5)  # a sealed call, and its sealed reply
        if tamper == "flip a bit":
            frame = bytearray(sealed(call_frame(2, 2, 3), seals.outgoing))
            frame[-20] ^= 1
            raw.sendall(bytes(frame))
        elif tamper == "replay":
            raw.sendall(first)
        else:  # a frame made without the link's seals
            raw.sendall(call_frame(2, 2, 3) + bytes(16))
        assert raw.recv(1) == b""
    assert asyncio.run(settled(lambda: len(server.closed_links) == before + 1))


def test_a_broken_link_fails_waiting_calls_and_is_dialled_again(server):
    async def scenario():
        heard = Heard()
        client = client_of(server, listener=heard)
        waiting = await client.submit(Arithmetic.later, "w")
        with pytest.raises(WorkerLinkError):
            await client.call(Arithmetic.drop, timeout_s=5)  # the worker closes the link mid-call
        with pytest.raises(WorkerLinkError):
            await asyncio.wait_for(waiting, 5)
        assert heard.lost == ["worker"]
        assert await settled(
            lambda: len(server.closed_links) == 1
        )  # the worker learns it too (it aborts that router's requests)
        assert await client.call(Arithmetic.add, 3, 4, timeout_s=5) == 7  # a new link
        await client.close()

    asyncio.run(scenario())


def test_a_dead_worker_is_a_link_error(server):
    async def scenario():
        client = client_of(server)
        assert await client.call(Arithmetic.add, 1, 1, timeout_s=5) == 2
        waiting = await client.submit(Arithmetic.later, "x")
        server.close()
        with pytest.raises(WorkerLinkError):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(WorkerLinkError):
            await client.call(Arithmetic.add, 1, 1, timeout_s=5)  # nobody listens any more
        await client.close()

    asyncio.run(scenario())


def test_a_worker_that_cannot_prove_the_key_is_refused_before_anything_is_sent():
    """A fake instance registered in Redis: the router checks its proof and sends it no call."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = []

    def fake_worker():
        sock, _ = listener.accept()
        with sock:
            sock.settimeout(5)
            received.append(sock.recv(32))  # the router's nonce
            sock.sendall(bytes(64))  # a nonce and a proof it cannot make
            try:
                while chunk := sock.recv(1 << 16):
                    received.append(chunk)
            except OSError:
                pass

    thread = threading.Thread(target=fake_worker, daemon=True)
    thread.start()

    async def scenario():
        client = RpcClient(f"127.0.0.1:{listener.getsockname()[1]}", LINK_KEY, name="fake")
        with pytest.raises(WorkerLinkError, match="does not hold"):
            await client.call(Arithmetic.add, 1, 2, timeout_s=5)

    asyncio.run(scenario())
    thread.join(timeout=5)
    listener.close()
    assert [len(chunk) for chunk in received] == [32]  # the nonce, then nothing: no frame was sent


def test_a_caller_that_says_nothing_is_dropped_after_the_hello_timeout(server):
    with socket.create_connection(("127.0.0.1", int(server.address.rsplit(":", 1)[1]))) as raw:
        raw.settimeout(HELLO_TIMEOUT_S + 5)
        started = time.monotonic()
        assert raw.recv(1) == b""
        assert time.monotonic() - started < HELLO_TIMEOUT_S + 2


def test_every_stub_method_is_a_method_its_service_declares():
    """A stub calling a method its service does not declare is refused by every worker, and the
    router swallows a failed abort: such a gap would leave aborted requests running."""
    from disagg.rpc.services import DecodeService, PrefillService, method_names
    from disagg.rpc.stubs import DecodeStub, PrefillStub

    for stub, service in ((DecodeStub, DecodeService), (PrefillStub, PrefillService)):
        called = {name for name in vars(stub) if callable(vars(stub)[name]) and not name.startswith("_")}
        assert called <= method_names(service), (
            f"{stub.__name__} calls undeclared {sorted(called - method_names(service))}"
        )
