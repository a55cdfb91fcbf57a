"""Forward and Backward on the trainer's side without the generated classes' copies.

A trainer relays megabytes of frames per microbatch and looks inside none of them. Through the
generated classes each frame is copied into the message's arena, serialized out of it, parsed
back into an arena and copied out again as a Python `bytes`: four copies per hop on top of grpc's
own. Here the requests are serialized by joining their encoded fields (one copy) and the replies
parsed into dataclasses whose bytes fields are `memoryview`s of the bytes grpc received (none), so
a stage's output goes into the next stage's request without existing twice in between.

Only what the Stage client sends and receives on its hot path is handled: ForwardRequest and
BackwardRequest are encoded, ForwardReply and BackwardReply decoded, all proto3 scalars, strings
and bytes. Field numbers, types and presence come from the generated descriptors, so the .proto
stays the single source; tests hold both directions equal to the generated classes', and for any
input this decoder accepts, protobuf's parses the same values. Parsing is strict where protobuf
is lenient in ways a worker never needs (groups, over-long varints are refused, with a
`WireMessageError`); unknown fields and wire types that do not match a known field are skipped,
as protobuf does.

Imports nothing of ours except the generated module beside it; the dataclasses are the Stage
adapter's (protos/stage_adapter.py), which uses this module in its client stub.
"""

from __future__ import annotations

import struct
from types import MappingProxyType
from typing import Any, Mapping

from google.protobuf.descriptor import FieldDescriptor

from agora.protos import stage_pb2

__all__ = ["WireMessageError", "RELAYED", "encode_message", "decode_message"]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MASK64 = (1 << 64) - 1
_DOUBLE = struct.Struct("<d")
_FLOAT = struct.Struct("<f")


class WireMessageError(ValueError):
    """Bytes that are not a message this module decodes."""


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= _MASK64
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _layout(message_cls: type) -> dict[str, tuple[int, int, Any]]:
    """Per field name: (number, wire type, descriptor) from the generated descriptor."""
    layout = {}
    for field in message_cls.DESCRIPTOR.fields:
        kind = {FieldDescriptor.TYPE_STRING: _LEN, FieldDescriptor.TYPE_BYTES: _LEN,
                FieldDescriptor.TYPE_DOUBLE: _I64, FieldDescriptor.TYPE_FLOAT: _I32}.get(field.type, _VARINT)
        if field.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_DOUBLE,
                              FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_UINT32,
                              FieldDescriptor.TYPE_UINT64):
            raise TypeError(f"{message_cls.__name__}.{field.name}: type {field.type} not handled here")
        layout[field.name] = (field.number, kind, field)
    return layout


# The messages handled here, and their layouts (read-only, built once from the descriptors).
RELAYED = (stage_pb2.ForwardRequest, stage_pb2.BackwardRequest, stage_pb2.ForwardReply, stage_pb2.BackwardReply)
_LAYOUTS: Mapping[type, Mapping[str, tuple[int, int, Any]]] = MappingProxyType(
    {cls: MappingProxyType(_layout(cls)) for cls in RELAYED})
_DEFAULTS = MappingProxyType({FieldDescriptor.TYPE_BYTES: b"", FieldDescriptor.TYPE_STRING: "",
                              FieldDescriptor.TYPE_BOOL: False, FieldDescriptor.TYPE_DOUBLE: 0.0,
                              FieldDescriptor.TYPE_FLOAT: 0.0, FieldDescriptor.TYPE_UINT32: 0,
                              FieldDescriptor.TYPE_UINT64: 0})


def encode_message(value: Any, message_cls: type) -> bytes:
    """The serialized `message_cls` of dataclass `value` (proto3: defaults left out unless optional and set)."""
    pieces: list[bytes | memoryview] = []
    for name, (number, kind, field) in _LAYOUTS[message_cls].items():
        item = getattr(value, name)
        if item is None or (not field.has_presence and not item):
            continue
        tag = _varint(number << 3 | kind)
        if kind == _LEN:
            data = item.encode() if isinstance(item, str) else item
            pieces += [tag, _varint(len(data)), data]
        elif kind == _I64:
            pieces += [tag, _DOUBLE.pack(item)]
        elif kind == _I32:
            pieces += [tag, _FLOAT.pack(item)]
        else:
            pieces += [tag, _varint(int(item))]
    return b"".join(pieces)


def _read_varint(view: memoryview, position: int) -> tuple[int, int]:
    result = shift = 0
    for _ in range(10):
        if position >= len(view):
            raise WireMessageError("truncated varint")
        byte = view[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result & _MASK64, position
        shift += 7
    raise WireMessageError("varint longer than 10 bytes")


def decode_message(data: bytes, message_cls: type, dataclass_cls: type) -> Any:
    """`dataclass_cls` from serialized `message_cls`; bytes fields are memoryviews of `data`."""
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    by_number = {number: (name, kind, field) for name, (number, kind, field) in _LAYOUTS[message_cls].items()}
    values: dict[str, Any] = {}
    position = 0
    while position < len(view):
        key, position = _read_varint(view, position)
        number, kind = key >> 3, key & 7
        if number == 0 or number > 2**29 - 1:
            raise WireMessageError(f"invalid field number {number}")
        if kind == _VARINT:
            item, position = _read_varint(view, position)
        elif kind == _I64:
            if position + 8 > len(view):
                raise WireMessageError("truncated 64-bit field")
            item, position = view[position:position + 8], position + 8
        elif kind == _I32:
            if position + 4 > len(view):
                raise WireMessageError("truncated 32-bit field")
            item, position = view[position:position + 4], position + 4
        elif kind == _LEN:
            length, position = _read_varint(view, position)
            if position + length > len(view):
                raise WireMessageError(f"field {number}: {length} bytes declared, {len(view) - position} present")
            item, position = view[position:position + length], position + length
        else:
            raise WireMessageError(f"field {number}: wire type {kind} (groups) not accepted")
        known = by_number.get(number)
        if known is None or known[1] != kind:
            continue  # unknown, or a wire type that does not match the field: skipped, as protobuf does
        name, _, field = known
        if field.type == FieldDescriptor.TYPE_BYTES:
            values[name] = item
        elif field.type == FieldDescriptor.TYPE_STRING:
            try:
                values[name] = str(item, "utf-8")
            except UnicodeDecodeError:
                raise WireMessageError(f"{name}: invalid UTF-8") from None
        elif field.type == FieldDescriptor.TYPE_DOUBLE:
            values[name] = _DOUBLE.unpack(item)[0]
        elif field.type == FieldDescriptor.TYPE_FLOAT:
            values[name] = _FLOAT.unpack(item)[0]
        elif field.type == FieldDescriptor.TYPE_BOOL:
            values[name] = bool(item)
        elif field.type == FieldDescriptor.TYPE_UINT32:
            values[name] = item & 0xFFFFFFFF
        else:
            values[name] = item
    for name, (_, kind, field) in _LAYOUTS[message_cls].items():
        if name not in values:
            values[name] = None if field.has_presence else _DEFAULTS[field.type]
    return dataclass_cls(**values)


