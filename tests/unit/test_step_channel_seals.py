"""The step channel across hosts (disagg.worker.socket_pipe) takes only messages sealed under the
deployment key, each once and in order: a message forged by someone without the key, changed on
the way, or replayed is refused (ForgedMessage) and never unpickled, and the connection closed.

Between the two ends sits a stand-in for an on-path attacker: it relays the sender's bytes as
they are, or injects its own."""

from __future__ import annotations

import pickle
import socket
import threading

import pytest

from disagg.auth import Seals, new_nonce
from disagg.worker.socket_pipe import PURPOSE, ForgedMessage, SocketPipe, accept_pipes, connect_pipe, listen
from disagg.worker.step_messages import StepOrder, decode_order, encode_order

KEY = b"k" * 32
TIMEOUT_S = 5.0


class OnPath:
    """sender -> [attacker] -> receiver, over socket pairs: what the sender writes, the attacker
    reads (`taken()`), and what it `inject`s, the receiver reads."""

    def __init__(self, key: bytes = KEY):
        caller_nonce, listener_nonce = new_nonce(), new_nonce()
        sender_end, self._tap = socket.socketpair()
        self._inject_end, receiver_end = socket.socketpair()
        self.sender = SocketPipe(sender_end, Seals.of(key, caller_nonce, listener_nonce, PURPOSE, "caller"))
        self.receiver = SocketPipe(receiver_end, Seals.of(key, caller_nonce, listener_nonce, PURPOSE, "listener"))

    def taken(self) -> bytes:
        self._tap.settimeout(TIMEOUT_S)
        return self._tap.recv(1 << 20)

    def inject(self, wire: bytes) -> None:
        self._inject_end.sendall(wire)

    def relay(self, payload: bytes) -> bytes:
        """The sender sends `payload`; the attacker passes it on as it is; its bytes on the wire."""
        self.sender.send(payload, TIMEOUT_S)
        wire = self.taken()
        self.inject(wire)
        return wire


def order(number: int) -> bytes:
    return encode_order(StepOrder(number, None, [[]]))


def test_a_relayed_message_arrives_as_sent():
    path = OnPath()
    path.relay(order(1))
    assert decode_order(path.receiver.recv(TIMEOUT_S)).number == 1


def test_a_replayed_message_is_refused():
    path = OnPath()
    wire = path.relay(order(1))
    assert decode_order(path.receiver.recv(TIMEOUT_S)).number == 1
    path.inject(wire)  # the same step's order again: a valid tag, but for message 1, not 2
    with pytest.raises(ForgedMessage):
        path.receiver.recv(TIMEOUT_S)


def test_messages_out_of_order_are_refused():
    path = OnPath()
    path.sender.send(order(1), TIMEOUT_S)
    first = path.taken()
    path.sender.send(order(2), TIMEOUT_S)
    second = path.taken()
    path.inject(second + first)
    with pytest.raises(ForgedMessage):
        path.receiver.recv(TIMEOUT_S)


class Bomb:
    """What an attacker's pickle would run on the receiver, were it unpickled."""

    ran = False

    def __reduce__(self):
        return (Bomb.detonate, ())

    @staticmethod
    def detonate():
        Bomb.ran = True


def test_a_forged_pickle_is_refused_and_never_unpickled():
    """Framed exactly as a message, sealed with a key other than the deployment's."""
    forger = OnPath(key=b"x" * 32)
    forger.sender.send(pickle.dumps(Bomb()), TIMEOUT_S)
    path = OnPath()
    path.inject(forger.taken())
    with pytest.raises(ForgedMessage):
        received = path.receiver.recv(TIMEOUT_S)
        pickle.loads(received)  # never reached
    assert not Bomb.ran


def test_a_changed_message_is_refused_and_the_connection_closed():
    path = OnPath()
    path.sender.send(order(1), TIMEOUT_S)
    wire = bytearray(path.taken())
    wire[-20] ^= 1  # a bit of the order's bytes
    path.inject(bytes(wire))
    with pytest.raises(ForgedMessage):
        path.receiver.recv(TIMEOUT_S)
    with pytest.raises(OSError):  # closed: nothing more is read from it
        path.receiver.recv(TIMEOUT_S)


def test_a_forged_length_is_refused_before_anything_is_allocated():
    path = OnPath()
    path.inject((1 << 62).to_bytes(8, "little") + bytes(16))  # 4 EiB, with a made-up tag
    with pytest.raises(ForgedMessage):
        path.receiver.recv(TIMEOUT_S)


def test_followers_over_tcp_are_sealed_end_to_end():
    """The real listener and dialler: the follower's index and every message after it sealed."""
    listener = listen("127.0.0.1")
    port = listener.getsockname()[1]
    opened = {}
    dialler = threading.Thread(target=lambda: opened.update(pipe=connect_pipe("127.0.0.1", port, KEY, 3, TIMEOUT_S)))
    dialler.start()
    pipes = accept_pipes(listener, 1, KEY, TIMEOUT_S)
    dialler.join(TIMEOUT_S)
    listener.close()
    assert list(pipes) == [3]
    pipes[3].send(order(5), TIMEOUT_S)
    assert decode_order(opened["pipe"].recv(TIMEOUT_S)).number == 5
    opened["pipe"].send(b"answer", TIMEOUT_S)
    assert pipes[3].recv(TIMEOUT_S) == b"answer"
