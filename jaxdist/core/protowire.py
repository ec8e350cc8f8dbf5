"""Protobuf wire-format primitives: varints, length-delimited field prefixes, a field scanner.

The data plane writes and reads its large messages (``Frame``, ``Event``) partly by hand, so a
tensor's bytes go from the numpy buffer to the wire in one copy and come back as views of the
received bytes (see ``codec.tensor_pieces`` and ``codec.parse_tensor``). This module knows the
protobuf encoding only, nothing of jaxdist's messages. Everything it writes is plain protobuf:
any protobuf library reads it, and it reads what any protobuf library writes.
"""

from __future__ import annotations

from collections.abc import Iterator

from jaxdist.core.errors import CodecError

__all__ = ["I32", "I64", "LEN", "VARINT", "field_prefix", "fields", "read_varint", "varint"]

VARINT, I64, LEN, I32 = 0, 1, 2, 5  # the wire types jaxdist's messages use

_SMALL = [bytes([n]) for n in range(128)]


def varint(n: int) -> bytes:
    """The base-128 varint encoding of a non-negative integer."""
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field_prefix(field: int, length: int) -> bytes:
    """Tag and length of a length-delimited field (bytes, string, message) of ``length`` bytes."""
    return varint(field << 3 | LEN) + varint(length)


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """Decode the varint at ``pos``; return ``(value, position after it)``."""
    result = shift = 0
    n = len(buf)
    while True:
        if pos >= n:
            raise CodecError("malformed protobuf: truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise CodecError("malformed protobuf: varint longer than 10 bytes")


def fields(buf: bytes | memoryview, start: int = 0, end: int | None = None
           ) -> Iterator[tuple[int, int, int, int, int]]:
    """Scan the fields of one encoded message.

    Yields ``(field, wire_type, field_start, value, value_end)`` per field: for ``LEN`` fields
    ``value`` is where the payload starts and ``value_end`` where it ends; for ``VARINT`` it is
    the decoded integer; for fixed-width fields it is where the value starts. ``buf[field_start:
    value_end]`` is the whole field, tag included.

    Raises:
        CodecError: truncated or malformed bytes, or a group (deprecated, never used here).
    """
    pos = start
    end = len(buf) if end is None else end
    while pos < end:
        field_start = pos
        key, pos = read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise CodecError(f"malformed protobuf: field number 0 at byte {field_start}")
        if wire_type == VARINT:
            value, pos = read_varint(buf, pos)
            yield field, wire_type, field_start, value, pos
            continue
        if wire_type == LEN:
            length, pos = read_varint(buf, pos)
            value, pos = pos, pos + length
        elif wire_type == I64:
            value, pos = pos, pos + 8
        elif wire_type == I32:
            value, pos = pos, pos + 4
        else:
            raise CodecError(f"malformed protobuf: unsupported wire type {wire_type} at byte {field_start}")
        if pos > end:
            raise CodecError(f"malformed protobuf: field {field} at byte {field_start} runs past the end ({end})")
        yield field, wire_type, field_start, value, pos
