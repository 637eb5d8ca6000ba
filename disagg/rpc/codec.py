"""Fixed-schema encoding of the request link's values: msgpack, with the message dataclasses as an
extension type (class name, then the field values in declaration order).

Nothing from the network is unpickled: a frame decodes to primitives (None, bools, numbers,
strings, bytes, lists, string-keyed maps) and instances of the classes the codec was given, built
field by field through their constructors (which validate, as SamplingParams does). Anything else
is a FrameError, as is a message with the wrong number of fields.
"""

from __future__ import annotations

import dataclasses

import msgpack

_MESSAGE = 1  # the msgpack extension code of a message dataclass


class FrameError(ValueError):
    """The peer sent something that is not a frame of this protocol."""


@dataclasses.dataclass(frozen=True)
class _Schema:
    cls: type
    fields: tuple[str, ...]
    tuple_fields: frozenset[str]  # msgpack has one array type: these are rebuilt as tuples


class Codec:
    def __init__(self, message_types: tuple[type, ...]):
        self._by_class = {cls: _schema(cls) for cls in message_types}
        self._by_name = {cls.__name__: schema for cls, schema in self._by_class.items()}

    def encode(self, value) -> bytes:
        return msgpack.packb(value, default=self._pack_message, use_bin_type=True)

    def decode(self, data: bytes):
        try:
            return msgpack.unpackb(data, ext_hook=self._unpack_message, raw=False, strict_map_key=True)
        except FrameError:
            raise
        except Exception as exc:  # malformed msgpack, a non-string map key, a constructor refusing its fields
            raise FrameError(f"undecodable frame: {type(exc).__name__}: {exc}") from None

    def _pack_message(self, value):
        schema = self._by_class.get(type(value))
        if schema is None:
            raise TypeError(f"{type(value).__name__} is not a message type of this link")
        body = [type(value).__name__, [getattr(value, name) for name in schema.fields]]
        return msgpack.ExtType(_MESSAGE, msgpack.packb(body, default=self._pack_message, use_bin_type=True))

    def _unpack_message(self, code: int, data: bytes):
        if code != _MESSAGE:
            raise FrameError(f"unknown extension type {code}")
        name, values = msgpack.unpackb(data, ext_hook=self._unpack_message, raw=False, strict_map_key=True)
        schema = self._by_name.get(name)
        if schema is None:
            raise FrameError(f"unknown message type {name!r}")
        if not isinstance(values, list) or len(values) != len(schema.fields):
            raise FrameError(f"{name}: expected {len(schema.fields)} fields")
        kwargs = dict(zip(schema.fields, values))
        for name in schema.tuple_fields:
            if isinstance(kwargs[name], list):
                kwargs[name] = tuple(kwargs[name])
        return schema.cls(**kwargs)


def _schema(cls: type) -> _Schema:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__}: message types are dataclasses")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    tuples = frozenset(f.name for f in fields if str(f.type).startswith("tuple"))
    return _Schema(cls, tuple(f.name for f in fields), tuples)
