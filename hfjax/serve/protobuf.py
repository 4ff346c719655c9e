"""A minimal protocol-buffers wire codec (proto3, schema-less): enough for `hfjax.serve.wire` to read and write the
few Tinker messages the SDK exchanges as protobuf, without a dependency on the protobuf package or the SDK."""

from __future__ import annotations

import struct
from collections.abc import Iterable

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5
_MASK64 = (1 << 64) - 1

Fields = dict[int, list[int | bytes]]


class ProtoError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ProtoError("varint longer than 10 bytes")


def decode(buf: bytes) -> Fields:
    """The message's fields by number, each a list of its occurrences: ints for varints, bytes for the rest."""
    fields: Fields = {}
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        value: int | bytes
        if wire_type == VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire_type in (FIXED64, FIXED32):
            size = 8 if wire_type == FIXED64 else 4
            value, pos = buf[pos : pos + size], pos + size
        elif wire_type == LEN:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ProtoError(f"unsupported wire type {wire_type} (field {number})")
        if pos > len(buf):
            raise ProtoError(f"truncated field {number}")
        fields.setdefault(number, []).append(value)
    return fields


def signed(value: int) -> int:
    """A varint read as a two's-complement int64 (int32 / int64 / enum fields)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def one_int(fields: Fields, number: int, default: int = 0) -> int:
    """The last occurrence of an int field (proto3: last one wins), as a signed int64."""
    values = [value for value in fields.get(number, []) if isinstance(value, int)]
    return signed(values[-1]) if values else default


def one_bytes(fields: Fields, number: int, default: bytes = b"") -> bytes:
    values = [value for value in fields.get(number, []) if isinstance(value, bytes)]
    return values[-1] if values else default


def one_str(fields: Fields, number: int) -> str:
    try:
        return one_bytes(fields, number).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ProtoError(f"field {number} is not UTF-8") from error


def one_double(fields: Fields, number: int) -> float:
    raw = one_bytes(fields, number)
    if not raw:
        return 0.0
    if len(raw) != 8:
        raise ProtoError(f"field {number} is not a double")
    return struct.unpack("<d", raw)[0]


def repeated_ints(fields: Fields, number: int) -> list[int]:
    """A repeated int field, packed (bytes) or not (one varint each)."""
    out: list[int] = []
    for value in fields.get(number, []):
        if isinstance(value, int):
            out.append(signed(value))
            continue
        pos = 0
        while pos < len(value):
            item, pos = _read_varint(value, pos)
            out.append(signed(item))
    return out


def messages(fields: Fields, number: int) -> list[Fields]:
    """A repeated (or single) message field, each occurrence decoded."""
    return [decode(value) for value in fields.get(number, []) if isinstance(value, bytes)]


def map_entries(fields: Fields, number: int) -> list[Fields]:
    """A map field's entries (messages with the key as field 1 and the value as field 2)."""
    return messages(fields, number)


def varint(value: int) -> bytes:
    value &= _MASK64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def int_field(number: int, value: int) -> bytes:
    return _key(number, VARINT) + varint(value)


def bytes_field(number: int, value: bytes) -> bytes:
    return _key(number, LEN) + varint(len(value)) + value


def str_field(number: int, value: str) -> bytes:
    return bytes_field(number, value.encode("utf-8"))


def double_field(number: int, value: float) -> bytes:
    return _key(number, FIXED64) + struct.pack("<d", value)


def packed_ints_field(number: int, values: Iterable[int]) -> bytes:
    payload = b"".join(varint(value) for value in values)
    return bytes_field(number, payload) if payload else b""
