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
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

KEY_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size


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


def listener_handshake(sock: socket.socket, key: bytes, purpose: str, timeout_s: float) -> None:
    """The listening side, on a blocking socket: returns once the caller proved the key."""
    sock.settimeout(timeout_s)
    caller_nonce = _recv(sock, NONCE_BYTES)
    listener_nonce = new_nonce()
    sock.sendall(listener_nonce + proof(key, "listener", caller_nonce, listener_nonce, purpose))
    verify(proof(key, "caller", caller_nonce, listener_nonce, purpose), _recv(sock, PROOF_BYTES), "the caller")


def caller_handshake(sock: socket.socket, key: bytes, purpose: str, timeout_s: float) -> None:
    """The calling side, on a blocking socket: returns once both sides proved the key."""
    sock.settimeout(timeout_s)
    caller_nonce = new_nonce()
    sock.sendall(caller_nonce)
    reply = _recv(sock, NONCE_BYTES + PROOF_BYTES)
    listener_nonce, listener_proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    verify(proof(key, "listener", caller_nonce, listener_nonce, purpose), listener_proof, "the listener")
    sock.sendall(proof(key, "caller", caller_nonce, listener_nonce, purpose))


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
