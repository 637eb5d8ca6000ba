"""The deployment key, and how two processes of one deployment prove to each other that they hold it.

`disagg serve` makes one random key per deployment and hands it to every worker in its actor
arguments (never a command line, never Redis). Every connection of the request path and of the
KV rendezvous opens with a mutual challenge-response: each side sends a fresh nonce and answers
the other's with an HMAC over both nonces, its role and what the connection is for (`purpose`).
The key never crosses the wire, a recorded exchange cannot be replayed, and a stranger who
registers a fake instance in Redis learns nothing and gets no frame read (nor is any of its
frames read: the caller checks the listener's proof before it sends anything).

    caller -> listener   nonce_c (32 bytes)
    listener -> caller   nonce_l (32) + proof("listener")
    caller -> listener   proof("caller")

After it, a connection that carries frames may seal them (`Seals`): each direction has its own
key, derived from the deployment key and both nonces, and every frame a tag over its number in
that direction and its bytes. A frame changed, dropped, replayed or reordered on the way fails
its check; the connection is then closed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
from dataclasses import dataclass

KEY_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
TAG_BYTES = 16  # a truncated HMAC-SHA256: 128 bits against forgery


class AuthenticationError(ConnectionError):
    """The other side does not hold the deployment key (or the connection broke mid-handshake)."""


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, side: str, caller_nonce: bytes, listener_nonce: bytes, purpose: str) -> bytes:
    if len(key) < 16:
        raise ValueError("key: a deployment key has at least 16 bytes")
    message = b"|".join([side.encode(), caller_nonce, listener_nonce, purpose.encode()])
    return hmac.new(key, message, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes, who: str) -> None:
    if not hmac.compare_digest(expected, got):
        raise AuthenticationError(f"{who} does not hold this deployment's key")


class FrameSeal:
    """One direction of a connection: tags its frames in order (the sender), or checks them in
    the same order (the receiver). Not thread-safe: the caller orders its frames."""

    def __init__(self, key: bytes):
        self._key = key
        self._count = 0

    def tag(self, *parts) -> bytes:
        """The tag of the next frame, made of `parts` (bytes-like, hashed in order, not joined)."""
        mac = hmac.new(self._key, self._count.to_bytes(8, "big"), hashlib.sha256)
        for part in parts:
            mac.update(part)
        self._count += 1
        return mac.digest()[:TAG_BYTES]

    def check(self, tag: bytes, *parts) -> None:
        if not hmac.compare_digest(self.tag(*parts), tag):
            raise AuthenticationError("a frame failed its integrity check (changed, replayed or out of order)")


@dataclass
class Seals:
    """A connection's two directions, as one side sees them."""

    outgoing: FrameSeal
    incoming: FrameSeal

    @classmethod
    def of(cls, key: bytes, caller_nonce: bytes, listener_nonce: bytes, purpose: str, side: str) -> "Seals":
        to_listener = FrameSeal(proof(key, "frames to listener", caller_nonce, listener_nonce, purpose))
        to_caller = FrameSeal(proof(key, "frames to caller", caller_nonce, listener_nonce, purpose))
        return cls(to_listener, to_caller) if side == "caller" else cls(to_caller, to_listener)


def listener_handshake(sock: socket.socket, key: bytes, purpose: str, timeout_s: float) -> Seals:
    """The listening side, on a blocking socket: returns once the caller proved the key."""
    sock.settimeout(timeout_s)
    caller_nonce = _recv(sock, NONCE_BYTES)
    listener_nonce = new_nonce()
    sock.sendall(listener_nonce + proof(key, "listener", caller_nonce, listener_nonce, purpose))
    verify(proof(key, "caller", caller_nonce, listener_nonce, purpose), _recv(sock, PROOF_BYTES), "the caller")
    return Seals.of(key, caller_nonce, listener_nonce, purpose, "listener")


def caller_handshake(sock: socket.socket, key: bytes, purpose: str, timeout_s: float) -> Seals:
    """The calling side, on a blocking socket: returns once both sides proved the key."""
    sock.settimeout(timeout_s)
    caller_nonce = new_nonce()
    sock.sendall(caller_nonce)
    reply = _recv(sock, NONCE_BYTES + PROOF_BYTES)
    listener_nonce, listener_proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    verify(proof(key, "listener", caller_nonce, listener_nonce, purpose), listener_proof, "the listener")
    sock.sendall(proof(key, "caller", caller_nonce, listener_nonce, purpose))
    return Seals.of(key, caller_nonce, listener_nonce, purpose, "caller")


def _recv(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except OSError as exc:  # a timeout included: a caller that says nothing is a stranger
            raise AuthenticationError(f"handshake broke off: {exc}") from exc
        if not chunk:
            raise AuthenticationError("the other side closed the connection during the handshake")
        data += chunk
    return bytes(data)
