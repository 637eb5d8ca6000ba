"""Messages over a TCP connection: how rank 0 drives a follower on another host, where no
shared memory reaches (disagg.worker.step_channel chooses).

Each follower on another host dials rank 0's listener once, when the instance starts; both sides
prove they hold the deployment key (disagg.auth) before anything else crosses. The messages are
pickles that only processes of this deployment may send, and the network between hosts is not
trusted: every message is sealed (disagg.auth.Seals: a key per direction derived from the
deployment key and the handshake's nonces, and a tag per frame over its number in that direction
and its bytes). A message is its 8-byte length and that length's tag, then its bytes and their
tag; the length is checked before anything is allocated for it, the bytes before anyone unpickles
them. A message forged, changed, replayed or reordered on the way fails its check: the connection
is closed (ForgedMessage) and the step fails, as when the peer is gone. Every wait has a timeout;
a peer that exits closes its socket, which fails the wait at once (PeerGone).
"""

from __future__ import annotations

import socket
import struct
import time

from disagg.auth import TAG_BYTES, AuthenticationError, Seals, caller_handshake, listener_handshake
from disagg.worker.peer_wait import ChannelTimeout, PeerGone

PURPOSE = "step-channel"
MORE_TIMEOUT_S = 30.0  # a message's rest follows its first bytes at the sender's pace
ONE_WRITE_BYTES = 64 << 10  # messages up to this size go out in one write
_LENGTH = struct.Struct("<Q")
_INDEX = struct.Struct("<I")


class ForgedMessage(PeerGone):
    """A message failed its check (forged, changed, replayed or reordered on the way): the
    connection is closed, since nothing more on it can be trusted."""


class SocketPipe:
    """Both directions of one connected stream socket, each message sealed with `seals` (the
    handshake's, as this side sees them). Each direction is used by one thread at a time."""

    def __init__(self, sock: socket.socket, seals: Seals):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step message is small and urgent
        self._sock = sock
        self._seals = seals

    def send(self, payload, timeout_s: float) -> None:
        header = _LENGTH.pack(memoryview(payload).nbytes)
        seal = self._seals.outgoing
        self._sock.settimeout(timeout_s)
        try:
            self._send_parts([header, seal.tag(header), payload, seal.tag(payload)])
        except (TimeoutError, socket.timeout) as exc:
            raise ChannelTimeout(f"the peer took no message within {timeout_s:.0f}s") from exc
        except OSError as exc:
            raise PeerGone(f"the peer's connection broke: {exc}") from exc

    def _send_parts(self, parts: list) -> None:
        """One write for a small message (a step's order: one packet, not four); a large one
        (an answer with logits) is not copied."""
        if memoryview(parts[2]).nbytes <= ONE_WRITE_BYTES:
            self._sock.sendall(b"".join(parts))
            return
        for part in parts:
            self._sock.sendall(part)

    def recv(self, timeout_s: float) -> bytearray | None:
        """The next message; None if none began within `timeout_s`; ForgedMessage if it fails
        its check."""
        header = bytearray(_LENGTH.size + TAG_BYTES)
        if not self._fill(memoryview(header), timeout_s, first=True):
            return None
        length = self._checked(header[_LENGTH.size :], header[: _LENGTH.size])
        message = bytearray(_LENGTH.unpack(length)[0])
        tag = bytearray(TAG_BYTES)
        self._fill(memoryview(message), MORE_TIMEOUT_S, first=False)
        self._fill(memoryview(tag), MORE_TIMEOUT_S, first=False)
        return self._checked(tag, message)

    def _checked(self, tag: bytearray, part: bytearray) -> bytearray:
        try:
            self._seals.incoming.check(bytes(tag), part)
        except AuthenticationError as exc:
            self.close()
            raise ForgedMessage(f"the step channel refused a message: {exc}") from None
        return part

    def _fill(self, view: memoryview, timeout_s: float, first: bool) -> bool:
        received, deadline = 0, time.monotonic() + timeout_s
        while received < len(view):
            self._sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                n = self._sock.recv_into(view[received:])
            except (TimeoutError, socket.timeout):
                if first and received == 0:
                    return False
                raise ChannelTimeout("a message stopped half way") from None
            except OSError as exc:
                raise PeerGone(f"the peer's connection broke: {exc}") from exc
            if n == 0:
                raise PeerGone("the peer closed the connection")
            received += n
        return True

    def close(self) -> None:
        self._sock.close()


def listen(host: str) -> socket.socket:
    """Rank 0's listener on a free port of `host`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family, backlog=64)


def accept_pipes(listener: socket.socket, count: int, key: bytes, timeout_s: float) -> dict[int, SocketPipe]:
    """Rank 0: the pipes of `count` followers, by the follower index each one names."""
    pipes: dict[int, SocketPipe] = {}
    deadline = time.monotonic() + timeout_s
    while len(pipes) < count:
        listener.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            sock, _ = listener.accept()
        except (TimeoutError, socket.timeout) as exc:
            raise ChannelTimeout(f"{count - len(pipes)} followers did not connect within {timeout_s:.0f}s") from exc
        try:
            pipe = SocketPipe(sock, listener_handshake(sock, key, PURPOSE, timeout_s))
            index = _follower_index(pipe, timeout_s)
        except (ConnectionError, OSError):  # a stranger, or a follower that broke off: not a pipe
            sock.close()
            continue
        pipes[index] = pipe
    return pipes


def connect_pipe(host: str, port: int, key: bytes, index: int, timeout_s: float) -> SocketPipe:
    """A follower: its pipe to rank 0's listener, as follower `index`."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        pipe = SocketPipe(sock, caller_handshake(sock, key, PURPOSE, timeout_s))
        pipe.send(_INDEX.pack(index), timeout_s)  # sealed like every message after it
    except BaseException:
        sock.close()
        raise
    return pipe


def _follower_index(pipe: SocketPipe, timeout_s: float) -> int:
    """The index a follower's first message names."""
    message = pipe.recv(timeout_s)
    if message is None or len(message) != _INDEX.size:
        raise ConnectionError("the follower did not say which it is")
    return _INDEX.unpack(message)[0]
