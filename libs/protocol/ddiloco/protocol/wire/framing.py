"""Protobuf's encoding of length-delimited fields, written and read by hand for chunk messages.

A chunk's data is nearly all of every byte the service moves. Built as a protobuf message, a
4 MiB chunk is copied three times on its way out (into bytes, into the message, into the
serialized string) and twice on its way in (parsing, reading the field back); for a 64 MiB
fragment that is 90-120 ms of copying on the sending side and 55-85 ms on the receiving side
(see docs/benchmarks.md). Chunk messages are therefore written and read by hand (``stubs`` puts
them together from the pieces here). The bytes are exactly the ones protobuf writes (its encoder
emits fields in field-number order; a test compares the two), so any protobuf implementation
reads them. Reading takes the data out only where it is written as protobuf writes it (one data
field, shortest varints for its key and length and the message's, at most ``MAX_FIELDS``
fields); the other fields are parsed by protobuf at the depth they have in the message, and
anything else goes to protobuf's parser whole. So what is read, and every error, is protobuf's
own (tests compare the two).

This module knows the encoding, not the messages: field numbers come from the caller, and it
imports no protobuf.
"""

from __future__ import annotations

LEN = 2
"""Protobuf's wire type of length-delimited fields."""
MAX_VARINT_BYTES = 10
MAX_FIELDS = 16
"""A chunk has 5 fields; a message with more is left to protobuf's parser rather than scanned in
Python (the scan runs on the event loop: millions of tiny fields would stall it for seconds)."""


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field_key(number: int) -> bytes:
    """The key of length-delimited field ``number``."""
    return varint(number << 3 | LEN)


def read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it); (-1, end + 1) for a varint that runs past ``end`` or is too long."""
    value = shift = 0
    for i in range(pos, min(end, pos + MAX_VARINT_BYTES)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return -1, end + 1


def read_length(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """A length written as protobuf writes it (the shortest varint): (length, where the bytes
    start); (-1, 0) for anything else, which the caller leaves to protobuf's parser."""
    size, body = read_varint(raw, pos, end)
    if size < 0 or body - pos != len(varint(size)) or body + size > end:
        return -1, 0
    return size, body


def find_bytes_field(raw: bytes, start: int, number: int) -> tuple[int, int, int] | None:
    """Where the one length-delimited field ``number`` of the message ``raw[start:]`` is, when it
    is written as protobuf writes it: (where its key starts, where its bytes start, where they
    end). None for anything else: no such field, a repeated one (the last one wins), one written
    unlike protobuf, a broken message, groups, invalid wire types, more than ``MAX_FIELDS``
    fields; the caller hands those to protobuf's parser."""
    key = field_key(number)
    end, pos, found = len(raw), start, None
    for _ in range(MAX_FIELDS):
        if pos == end:
            break
        k, after_key = read_varint(raw, pos, end)
        wire_type, field = k & 7, k >> 3
        if k < 0:
            return None
        if wire_type == 0:
            _, after = read_varint(raw, after_key, end)
        elif wire_type == 1:
            after = after_key + 8
        elif wire_type == 5:
            after = after_key + 4
        elif wire_type == LEN:
            wanted = field == number
            size, body = (read_length if wanted else read_varint)(raw, after_key, end)
            if size < 0 or (wanted and (found is not None or raw[pos:after_key] != key)):
                return None  # broken, repeated (the last one wins) or written unlike protobuf: its parser decides
            after = body + size
            if wanted:
                found = (pos, body, after)
        else:
            return None  # groups and invalid wire types
        if after > end:
            return None
        pos = after
    else:
        if pos != end:
            return None  # more fields than a chunk has: not worth scanning in Python
    return found


def unwrap(raw: bytes, key: bytes) -> int | None:
    """Where the bytes of ``raw``'s one field start, when ``raw`` is that field alone (its key
    ``key``, its length the shortest varint, nothing after it); None for anything else."""
    if raw[:len(key)] != key:
        return None
    size, body = read_length(raw, len(key), len(raw))
    if size < 0 or body + size != len(raw):
        return None
    return body
