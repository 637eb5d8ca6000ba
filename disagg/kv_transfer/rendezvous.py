"""Where the two workers of a KV pair meet to build their process group: a small key-value store
per worker that only a pair it belongs to can use.

A TCPStore answers anyone who reaches its port. This store first hears which pair the caller
comes for (`a@address/b@address`, a < b, which must start with the store's own worker), then runs the
deployment's handshake bound to that pair (disagg.auth): a process without the deployment key
never gets a key read or written, and an authenticated peer sees only its own pair's keys. The
pair's lowest worker owns the store: it uses it in-process (`Rendezvous.pair_store`), the other
worker over one connection (`connect_pair_store`). Both are `torch.distributed.Store`s, which
gloo and NCCL rendezvous through; the values are small (addresses, NCCL unique ids).

    caller -> store   pair name (frame), handshake, then (op, key, args...) frames
    store -> caller   open (1 byte: 1, or 0 when the store's worker has closed its transport),
                      then one (ok, value or message) frame per op
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from datetime import timedelta

import msgpack
import torch.distributed as dist

from disagg.auth import AuthenticationError, caller_handshake, listener_handshake
from disagg.logs import ThrottledLog

logger = logging.getLogger(__name__)
_refusals = ThrottledLog(logger)  # anyone who reaches the port can make one
HANDSHAKE_TIMEOUT_S = 5.0
MAX_FRAME_BYTES = 1 << 20  # keys and values are addresses and ids
MAX_CONNECTIONS = 1024  # one per pair whose peer is the caller: bounded by the deployment's size
MAX_WAIT_S = 600.0
_HEADER = struct.Struct(">I")


class RendezvousClosed(RuntimeError):
    """The store's worker has closed its transport: nobody is coming."""


# ---- the store's contents --------------------------------------------------------------------------
class _Table:
    """Keys to bytes with the semantics of a torch.distributed Store; waits are bounded."""

    def __init__(self):
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def do(self, op: str, key: str, *args):
        with self._changed:
            if op == "set":
                self._values[key] = _checked_bytes(args[0])
            elif op == "get":
                self._wait([key], args[0])
                return self._values[key]
            elif op == "add":
                value = int(self._values.get(key, b"0")) + int(args[0])
                self._values[key] = str(value).encode()
                return value
            elif op == "check":
                return all(k in self._values for k in args[0])
            elif op == "wait":
                self._wait(args[0], args[1])
            elif op == "compare_set":
                return self._compare_set(key, *args)
            elif op == "delete":
                return self._values.pop(key, None) is not None
            else:
                raise ValueError(f"unknown store operation {op!r}")
            self._changed.notify_all()
            return None

    def _wait(self, keys: list[str], timeout_s: float) -> None:
        if not self._changed.wait_for(lambda: all(k in self._values for k in keys), min(timeout_s, MAX_WAIT_S)):
            raise TimeoutError(f"keys {keys} not set within {timeout_s:.1f}s")

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        expected, desired = _checked_bytes(expected), _checked_bytes(desired)
        current = self._values.get(key)
        if (current is None and expected == b"") or current == expected:
            self._values[key] = desired
            self._changed.notify_all()
            return desired
        return expected if current is None else current


def _checked_bytes(value) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"store values are bytes, got {type(value).__name__}")
    return value


# ---- the Store gloo and NCCL see -----------------------------------------------------------------
class PairStore(dist.Store):
    """One pair's keys, whether in-process or over a connection (`do` is the difference)."""

    def __init__(self, do, timeout_s: float, close=lambda: None):
        super().__init__()
        self._do = do
        self._timeout_s = timeout_s
        self.close = close  # ends the connection, if any (the pair is discarded)

    def set(self, key, value):
        self._do("set", key, value if isinstance(value, bytes) else str(value).encode())

    def get(self, key):
        return self._do("get", key, self._timeout_s)

    def add(self, key, amount):
        return self._do("add", key, int(amount))

    def check(self, keys):
        return self._do("check", "", list(keys))

    def wait(self, keys, timeout=None):
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else self._timeout_s
        self._do("wait", "", list(keys), seconds)

    def compare_set(self, key, expected, desired):
        return self._do("compare_set", key, _bytes(expected), _bytes(desired))

    def delete_key(self, key):
        return self._do("delete", key)

    def set_timeout(self, timeout):
        self._timeout_s = timeout.total_seconds()


def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


# ---- the owner's side ----------------------------------------------------------------------------
class Rendezvous:
    """This worker's store: `pair_store` in-process, and a listener for the pairs' other workers."""

    def __init__(self, worker_id: str, key: bytes, host: str):
        self.worker_id = worker_id
        self._key = key
        self._tables: dict[str, _Table] = {}
        self._lock = threading.Lock()
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        self.port = self._listener.getsockname()[1]
        self.own_address = ""  # how peers name this worker in pair names; set by the transport
        threading.Thread(target=self._accept_loop, name=f"kv-rendezvous-{worker_id}", daemon=True).start()

    def pair_store(self, pair_name: str, timeout_s: float) -> PairStore:
        table = self._table(pair_name)
        return PairStore(table.do, timeout_s)

    def close(self) -> None:
        self.closed = True  # later callers learn it from the open byte
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _table(self, pair_name: str) -> _Table:
        with self._lock:
            return self._tables.setdefault(pair_name, _Table())

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # closed
            if not self._connections.acquire(blocking=False):
                _refusals.warning(
                    "kv rendezvous %s: refusing %s, %d connections open", self.worker_id, peer[0], MAX_CONNECTIONS
                )
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, peer[0]), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            with sock:
                sock.settimeout(HANDSHAKE_TIMEOUT_S)
                pair_name = _recv_frame(sock)
                # The owner is the pair's lower worker id, so the name starts with it (ids may hold "/").
                if not isinstance(pair_name, str) or not pair_name.startswith(f"{self.worker_id}@{self.own_address}/"):
                    raise AuthenticationError(f"pair {pair_name[:200]!r} does not start with this worker")
                listener_handshake(sock, self._key, f"kv-rendezvous/{pair_name}", HANDSHAKE_TIMEOUT_S)
                sock.sendall(b"\0" if self.closed else b"\1")
                if not self.closed:
                    self._serve_ops(sock, self._table(pair_name))
        except (ConnectionError, OSError, ValueError) as exc:  # includes AuthenticationError, garbage
            _refusals.warning("kv rendezvous %s: connection from %s ended: %s", self.worker_id, peer, exc)
        finally:
            self._connections.release()

    @staticmethod
    def _serve_ops(sock: socket.socket, table: _Table) -> None:
        sock.settimeout(None)  # a pair's connection lasts as long as the pair
        while True:
            try:
                request = _recv_frame(sock)
            except ConnectionError:
                return  # the peer closed its side: its pair is gone
            try:
                op, key, *args = request
                reply = [True, table.do(str(op), str(key), *args)]
            except Exception as exc:  # noqa: BLE001 - the caller's store op raises it
                reply = [False, f"{type(exc).__name__}: {exc}"]
            _send_frame(sock, reply)


# ---- the other worker's side ---------------------------------------------------------------------
def connect_pair_store(host: str, port: int, pair_name: str, key: bytes, timeout_s: float) -> PairStore:
    """A store on the owner's rendezvous, for `pair_name`; OSError if unreachable, AuthenticationError
    if the owner does not hold the key, RendezvousClosed if the owner has closed its transport."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        _send_frame(sock, pair_name)
        caller_handshake(sock, key, f"kv-rendezvous/{pair_name}", timeout_s)
        if _recv_exactly(sock, 1) != b"\1":
            raise RendezvousClosed("the peer has closed its transport")
    except BaseException:
        sock.close()
        raise
    table = _RemoteTable(sock)
    return PairStore(table.do, timeout_s, close=sock.close)


class _RemoteTable:
    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._lock = threading.Lock()  # one op at a time on the connection

    def do(self, op: str, key: str, *args):
        wait_s = args[-1] if op in ("get", "wait") else 0.0
        with self._lock:
            self._sock.settimeout(wait_s + HANDSHAKE_TIMEOUT_S)
            try:
                _send_frame(self._sock, [op, key, *args])
                ok, value = _recv_frame(self._sock)
            except OSError as exc:
                raise RuntimeError(f"kv rendezvous connection lost: {exc}") from exc
        if not ok:
            raise RuntimeError(f"kv rendezvous {op} {key!r}: {value}")
        return value


# ---- frames --------------------------------------------------------------------------------------
def _send_frame(sock: socket.socket, value) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_frame(sock: socket.socket):
    (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return msgpack.unpackb(_recv_exactly(sock, length), raw=False)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return bytes(data)
