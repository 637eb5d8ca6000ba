"""Messages over a TCP connection: how rank 0 drives a follower on another host, where no
shared memory reaches (disagg.worker.step_channel chooses).

Each follower on another host dials rank 0's listener once, when the instance starts; both sides
prove they hold the deployment key (disagg.auth) before anything else crosses, since the messages
are pickles that only processes of this deployment may send. A message is an 8-byte length and
its bytes. Every wait has a timeout; a peer that exits closes its socket, which fails the wait
at once (PeerGone).
"""

from __future__ import annotations

import socket
import struct
import time

from disagg.auth import caller_handshake, listener_handshake
from disagg.worker.peer_wait import ChannelTimeout, PeerGone

PURPOSE = "step-channel"
MORE_TIMEOUT_S = 30.0  # a message's rest follows its first bytes at the sender's pace
_LENGTH = struct.Struct("<Q")
_INDEX = struct.Struct("<I")


class SocketPipe:
    """Both directions of one connected stream socket."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step message is small and urgent
        self._sock = sock

    def send(self, payload, timeout_s: float) -> None:
        self._sock.settimeout(timeout_s)
        try:
            self._sock.sendall(_LENGTH.pack(memoryview(payload).nbytes))
            self._sock.sendall(payload)
        except (TimeoutError, socket.timeout) as exc:
            raise ChannelTimeout(f"the peer took no message within {timeout_s:.0f}s") from exc
        except OSError as exc:
            raise PeerGone(f"the peer's connection broke: {exc}") from exc

    def recv(self, timeout_s: float) -> bytearray | None:
        """The next message; None if none began within `timeout_s`."""
        header = bytearray(_LENGTH.size)
        if not self._fill(memoryview(header), timeout_s, first=True):
            return None
        message = bytearray(_LENGTH.unpack(header)[0])
        self._fill(memoryview(message), MORE_TIMEOUT_S, first=False)
        return message

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
            listener_handshake(sock, key, PURPOSE, timeout_s)
            index = _INDEX.unpack(_recv_exactly(sock, _INDEX.size))[0]
        except (ConnectionError, OSError):  # a stranger, or a follower that broke off: not a pipe
            sock.close()
            continue
        pipes[index] = SocketPipe(sock)
    return pipes


def connect_pipe(host: str, port: int, key: bytes, index: int, timeout_s: float) -> SocketPipe:
    """A follower: its pipe to rank 0's listener, as follower `index`."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        caller_handshake(sock, key, PURPOSE, timeout_s)
        sock.sendall(_INDEX.pack(index))
    except BaseException:
        sock.close()
        raise
    return SocketPipe(sock)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed before it said which follower it is")
        data += chunk
    return bytes(data)
