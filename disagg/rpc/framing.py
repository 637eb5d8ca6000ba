"""Frames on a request link: a 4-byte big-endian length, then a 3-element array in the link's
fixed-schema encoding (disagg.rpc.codec; the message classes are disagg.rpc.messages'). A peer
and the worker must first prove to each other that they hold the deployment key
(disagg.auth, purpose LINK_PURPOSE): no frame is read from, or sent to, anyone else. Each frame
then ends with its tag (disagg.auth.Seals: TAG_BYTES over its number and its bytes), so that one
changed, replayed or reordered on the way closes the link.

    router -> worker   (call_id, method, args)
    worker -> router   (REPLY, call_id, value) | (ERROR, call_id, exception) | (EVENT, topic, payload)
"""

from __future__ import annotations

import socket
import struct

from disagg.auth import TAG_BYTES, FrameSeal
from disagg.rpc.codec import Codec, FrameError
from disagg.rpc.messages import MESSAGE_TYPES

REPLY, ERROR, EVENT = 0, 1, 2
MAX_FRAME_BYTES = 64 << 20  # a step's token deltas or a long prompt are far below this
LINK_PURPOSE = "request-link"
_HEADER = struct.Struct(">I")
CODEC = Codec(MESSAGE_TYPES)


def encode(message: tuple) -> bytes:
    """The frame without its tag (`sealed` adds it, in the order frames are sent)."""
    body = CODEC.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"message of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    return _HEADER.pack(len(body)) + body


def sealed(frame: bytes, seal: FrameSeal) -> bytes:
    return frame + seal.tag(frame)


def body_length(header: bytes) -> int:
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return length


def decode(body: bytes) -> tuple:
    message = CODEC.decode(body)
    if not isinstance(message, list) or len(message) != 3:
        raise FrameError("a frame must hold 3 elements")
    return tuple(message)


def recv_exactly(sock: socket.socket, n: int, is_open=lambda: True) -> bytes:
    """Blocking read of n bytes; ConnectionError at end of stream. The socket's timeout only
    bounds each wait, so that a closed link is noticed (`is_open`): an idle link is fine."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            if is_open():
                continue
            raise ConnectionError("link closed") from None
        if k == 0:
            raise ConnectionError("peer closed the link")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, seal: FrameSeal, is_open=lambda: True) -> tuple:
    header = recv_exactly(sock, _HEADER.size, is_open)
    body = recv_exactly(sock, body_length(header), is_open)
    seal.check(recv_exactly(sock, TAG_BYTES, is_open), header, body)
    return decode(body)


async def read_frame(reader, seal: FrameSeal) -> tuple:
    """The same from an asyncio StreamReader."""
    header = await reader.readexactly(_HEADER.size)
    body = await reader.readexactly(body_length(header))
    seal.check(await reader.readexactly(TAG_BYTES), header, body)
    return decode(body)
