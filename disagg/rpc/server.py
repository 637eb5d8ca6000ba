"""The worker's end of request links: a listening socket on rank 0 of an instance, serving the
methods its service declares (disagg.rpc.services).

Each router that connects gets a `Link` and a reader thread. A call runs its method on that
thread (`caller()` is then the link that called); methods only hand work to the engine thread
(`StepLoop.submit`) and return a Future,
whose reply is sent by whichever thread completes it: the engine thread itself, so a first
token leaves the process without waking any other thread. Token streams go the same way
(`Link.send_event` after each step), one frame per step per router.

A send waits at most `send_timeout_s` for room in the socket: a router that stops reading
that long loses its link (and learns it from the closed socket), the engine never stalls longer.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future

from disagg.auth import AuthenticationError, FrameSeal, listener_handshake
from disagg.errors import RequestFailedError, grpc_code_name
from disagg.logs import ThrottledLog
from disagg.rpc.framing import ERROR, EVENT, LINK_PURPOSE, REPLY, FrameError, encode, recv_frame, sealed
from disagg.rpc.services import method_names

logger = logging.getLogger(__name__)
_refusals = ThrottledLog(logger)  # anyone who reaches the port can make one
HELLO_TIMEOUT_S = 5.0


class Link:
    """One router's connection; `send` may be called from any thread."""

    def __init__(self, sock: socket.socket, peer: str, seal: FrameSeal, on_close: Callable[["Link"], None]):
        """`on_close`: called once, with the link, when it closes (from whichever thread closes it)."""
        self.peer = peer
        self._sock = sock
        self._seal = seal  # tags frames in the order they are sent: used under _lock
        self._lock = threading.Lock()
        self.closed = False
        self._on_close = on_close

    def send(self, message: tuple) -> bool:
        """False if the link is gone (or broke now)."""
        try:
            frame = encode(message)
        except Exception as exc:  # noqa: BLE001 - a value the codec cannot encode must not kill the link
            if message[0] != REPLY:
                raise
            frame = encode((ERROR, message[1], ("INTERNAL", f"reply not serializable: {exc}")))
        with self._lock:
            if self.closed:
                return False
            try:
                self._sock.sendall(sealed(frame, self._seal))
                return True
            except OSError as exc:
                logger.warning("request link to %s broke while sending: %s", self.peer, exc)
        self.close()
        return False

    def send_event(self, topic: str, payload) -> bool:
        return self.send((EVENT, topic, payload))

    def reply(self, call_id: int, value) -> None:
        self.send((REPLY, call_id, value))

    def reply_error(self, call_id: int, exc: BaseException) -> None:
        code = grpc_code_name(exc)
        if code == "INTERNAL" and not isinstance(exc, RequestFailedError):
            code = "UNAVAILABLE"  # the worker failed, not the request: the router may retry elsewhere
        self.send((ERROR, call_id, (code, f"{type(exc).__name__}: {exc}")))

    def reply_when_done(self, call_id: int, future: Future) -> None:
        def done(f: Future) -> None:
            if f.cancelled():
                self.send((ERROR, call_id, ("CANCELLED", "the request was aborted")))
            elif f.exception() is not None:
                self.reply_error(call_id, f.exception())
            else:
                self.reply(call_id, f.result())

        future.add_done_callback(done)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread
            except OSError:
                pass
            self._sock.close()
        self._on_close(self)


class RpcServer:
    """Serves `service`, an implementation of the service class `interface`: each method declared
    there returns its reply, or a concurrent Future of it."""

    def __init__(
        self,
        service: object,
        interface: type,
        key: bytes,
        host: str = "127.0.0.1",
        name: str = "",
        send_timeout_s: float = 10.0,
        on_link_closed: Callable[[Link], None] = lambda link: None,
    ):
        """`key`: the deployment's (disagg.auth); only a caller that proves it gets a frame read.
        `on_link_closed`: called with each link that closes (its router went away, or broke)."""
        self.handlers: dict[str, Callable] = {method: getattr(service, method) for method in method_names(interface)}
        self._calling = threading.local()  # the link whose call runs on this thread
        self._key = key
        self.name = name
        self.send_timeout_s = send_timeout_s
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._links: set[Link] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self._on_link_closed = on_link_closed
        threading.Thread(target=self._accept_loop, name=f"rpc-accept-{name}", daemon=True).start()

    def caller(self) -> Link:
        """Inside a method: the link of the router that called it (its tokens and replies go there)."""
        return self._calling.link

    def close(self) -> None:
        self._stopped = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"), name=f"rpc-link-{self.name}", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            seals = listener_handshake(sock, self._key, LINK_PURPOSE, HELLO_TIMEOUT_S)
        except (ConnectionError, OSError) as exc:
            _refusals.warning("request link from %s refused: %s", peer, exc)
            sock.close()
            return
        sock.settimeout(self.send_timeout_s)
        link = Link(sock, peer, seals.outgoing, on_close=self._forget)
        with self._lock:
            self._links.add(link)
        try:
            while True:
                call_id, method, args = recv_frame(sock, seals.incoming, is_open=lambda: not link.closed)
                if not (isinstance(call_id, int) and isinstance(method, str) and isinstance(args, list)):
                    raise FrameError("a call is (call id, method name, arguments)")
                self._dispatch(link, call_id, method, args)
        except AuthenticationError as exc:  # a frame changed on the way: nothing more is trusted
            logger.warning("request link from %s: %s; closing it", peer, exc)
        except (ConnectionError, OSError):
            pass  # the router went away (or we closed): its requests are aborted by on_close
        except Exception as exc:  # noqa: BLE001 - garbage (FrameError) from a peer that knew the token
            logger.warning("request link from %s: bad frame (%s); closing it", peer, exc)
        link.close()

    def _dispatch(self, link: Link, call_id: int, method: str, args: list) -> None:
        handler = self.handlers.get(method)
        self._calling.link = link
        try:
            if handler is None:
                raise ValueError(f"unknown method {method!r}")
            result = handler(*args)
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the link serves on
            link.reply_error(call_id, exc)
            return
        finally:
            self._calling.link = None
        if isinstance(result, Future):
            link.reply_when_done(call_id, result)
        else:
            link.reply(call_id, result)

    def _forget(self, link: Link) -> None:
        with self._lock:
            self._links.discard(link)
        self._on_link_closed(link)
