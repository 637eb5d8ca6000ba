"""The router's end of a request link to one instance (asyncio, on the frontend's event loop).

Calls name a method of a service class (disagg.rpc.services), never a string; the typed stubs
(disagg.rpc.stubs) are how the router makes them. `call()` sends a call and awaits its reply;
events (token deltas) go to the link's listener (`LinkListener.link_event`) as they arrive, on
the loop itself, so a token is in the gRPC stream's hands without a thread hop. The link is
dialled on first use and again after it broke; when it breaks, every call waiting on it fails
with WorkerLinkError and the listener hears it (`link_lost`: the streams end their requests).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Protocol

from disagg.auth import NONCE_BYTES, PROOF_BYTES, AuthenticationError, Seals, new_nonce, proof, verify
from disagg.errors import RemoteError, WorkerLinkError
from disagg.rpc.framing import ERROR, EVENT, LINK_PURPOSE, REPLY, encode, read_frame, sealed

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0


class LinkListener(Protocol):
    """Who hears what a link brings besides replies (disagg.router.directory.InstanceDirectory)."""

    def link_event(self, link: str, topic: str, payload) -> None:
        """An event the worker sent on link `link` (the client's name), on the event loop."""

    def link_lost(self, link: str) -> None:
        """Link `link` broke (the worker died, or closed it); calls waiting on it have failed."""


class _Deaf:
    def link_event(self, link: str, topic: str, payload) -> None:
        pass

    def link_lost(self, link: str) -> None:
        pass


class RpcClient:
    def __init__(self, address: str, key: bytes, name: str = "", listener: LinkListener | None = None):
        """`key`: the deployment's (disagg.auth); the worker must prove it holds it too.
        `listener`: hears the link's events and its loss, by `name` (default: nobody)."""
        self.address = address
        self.name = name or address
        self._key = key
        self._writer: asyncio.StreamWriter | None = None
        self._seals: Seals | None = None  # the link's, from its handshake
        self._reader_task: asyncio.Task | None = None
        self._dialing = asyncio.Lock()
        self._pending: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self.listener = listener if listener is not None else _Deaf()

    async def submit(self, method: Callable, *args) -> asyncio.Future:
        """Send a call now; the returned Future is its reply (the handler's return value, its
        exception as RemoteError, WorkerLinkError if the link breaks first). Cancelling it only
        stops waiting."""
        writer = await self._connected()
        call_id = next(self._call_ids)
        reply = asyncio.get_running_loop().create_future()
        self._pending[call_id] = reply
        reply.add_done_callback(lambda _: self._pending.pop(call_id, None))
        try:
            writer.write(sealed(encode((call_id, method.__name__, list(args))), self._seals.outgoing))
            await writer.drain()  # returns at once unless the worker stopped reading
        except (ConnectionError, OSError) as exc:
            reply.cancel()
            raise WorkerLinkError(f"link to {self.name} broke: {exc}", self.name) from exc
        except BaseException:
            reply.cancel()
            raise
        return reply

    async def call(self, method: Callable, *args, timeout_s: float):
        """Send a call and wait for its reply; TimeoutError after timeout_s."""
        return await asyncio.wait_for(await self.submit(method, *args), timeout_s)

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()
        self._writer = None

    async def _connected(self) -> asyncio.StreamWriter:
        if self._writer is not None:
            return self._writer
        async with self._dialing:
            if self._writer is None:
                host, port = self.address.rsplit(":", 1)
                try:
                    reader, writer, seals = await asyncio.wait_for(self._dial(host, int(port)), CONNECT_TIMEOUT_S)
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
                    raise WorkerLinkError(f"cannot reach {self.name} at {self.address}: {exc}", self.name) from exc
                except AuthenticationError as exc:  # a fake registration, or another deployment's worker
                    raise WorkerLinkError(f"refusing {self.name} at {self.address}: {exc}", self.name) from exc
                self._writer, self._seals = writer, seals
                self._reader_task = asyncio.create_task(
                    self._read_loop(reader, writer, seals.incoming), name=f"rpc-read-{self.name}"
                )
        return self._writer

    async def _dial(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Seals]:
        """Connect and run the mutual handshake (disagg.auth): nothing is sent to a worker that
        has not proved the key."""
        reader, writer = await asyncio.open_connection(host, port)
        try:
            caller_nonce = new_nonce()
            writer.write(caller_nonce)
            reply = await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
            worker_nonce, worker_proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
            verify(proof(self._key, "listener", caller_nonce, worker_nonce, LINK_PURPOSE), worker_proof, "the worker")
            writer.write(proof(self._key, "caller", caller_nonce, worker_nonce, LINK_PURPOSE))
        except BaseException:
            writer.close()
            raise
        return reader, writer, Seals.of(self._key, caller_nonce, worker_nonce, LINK_PURPOSE, "caller")

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seal) -> None:
        reason = "closed"
        try:
            while True:
                kind, key, value = await read_frame(reader, seal)
                if kind == EVENT:
                    self.listener.link_event(self.name, key, value)
                    continue
                reply = self._pending.get(key)
                if reply is None or reply.done():
                    continue  # its caller gave up (timeout, cancel)
                if kind == REPLY:
                    reply.set_result(value)
                elif kind == ERROR:
                    code, message = value
                    reply.set_exception(RemoteError(message, code, peer=self.name))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - end of stream, reset, or a frame we cannot read
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            self._lost(writer, reason)

    def _lost(self, writer: asyncio.StreamWriter, reason: str) -> None:
        writer.close()
        if self._writer is writer:
            self._writer = None
        (logger.info if reason == "closed" else logger.warning)("request link to %s lost (%s)", self.name, reason)
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(WorkerLinkError(f"link to {self.name} lost: {reason}", self.name))
        self.listener.link_lost(self.name)
