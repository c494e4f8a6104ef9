"""Chunk messages are written and read by ``ddiloco.protocol.wire`` itself, not by protobuf.

What must hold: the bytes written are protobuf's own, a chunk's data is read without a copy, and
any bytes read give what protobuf's parser gives (the same message, or the same error), whatever
order the fields come in, whatever unknown fields ride along, however the bytes are damaged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.fragments.chunking import Chunk, Reassembler, TransferHeader, split
from ddiloco.fragments.codec import make_codec
from ddiloco.fragments.errors import FragmentError
from ddiloco.fragments.partition import TensorSpec, partition_tensors
from ddiloco.fragments.payload import decode_fragment, encode_fragment
from ddiloco.protocol import wire
from ddiloco.protocol.wire.convert import pb
from ddiloco.protocol.wire.framing import varint

SETTINGS = settings(max_examples=60, deadline=None)

HEADER = TransferHeader(kind="contribution", fragment_id=3, version=7, sequence=11, tokens=512, steps=4,
                        codec="fp32", tensors=(TensorSpec("w", (2, 3), "float32"),), num_values=6)

# (serializer, parser, reference message type, dataclass conversion) of each place a chunk travels
KINDS: dict[str, tuple[Any, Any, Any, Any]] = {
    "learner": (wire.serialize_learner_message, wire.parse_learner_message, pb.LearnerMessage,
                wire.learner_message_from_pb),
    "synchronizer": (wire.serialize_synchronizer_message, wire.parse_synchronizer_message, pb.SynchronizerMessage,
                     wire.synchronizer_message_from_pb),
    "fetch": (wire.serialize_fragment_chunk, wire.parse_fragment_chunk, pb.FragmentChunk, wire.chunk_from_pb),
}
_TO_PB = {"learner": wire.learner_message_to_pb, "synchronizer": wire.synchronizer_message_to_pb,
          "fetch": wire.chunk_to_pb}

chunks = st.builds(
    Chunk, transfer_id=st.integers(0, 2**64 - 1), index=st.integers(0, 2**32 - 1),
    data=st.binary(max_size=300) | st.binary(min_size=1, max_size=300).map(lambda b: memoryview(b)[1:]),
    crc32c=st.integers(0, 2**32 - 1), header=st.none() | st.just(HEADER),
    digest=st.just(b"") | st.binary(min_size=16, max_size=16))  # a trailing digest, on a transfer's last chunk


def _outcome(convert: Any, parse: Any, raw: bytes) -> tuple[str, Any]:
    """What reading ``raw`` gives: the chunk's fields or another message, or the error's type."""
    try:
        msg = convert(parse(raw))
    except (wire.MalformedMessage, FragmentError) as exc:
        return "error", type(exc)
    if isinstance(msg, Chunk):
        return "chunk", (msg.transfer_id, msg.index, bytes(msg.data), msg.crc32c, msg.header)
    return "other", msg


def _same_as_protobuf(kind: str, raw: bytes) -> tuple[str, Any]:
    _, parse, reference, convert = KINDS[kind]
    ours, theirs = _outcome(convert, parse, raw), _outcome(convert, reference.FromString, raw)
    assert ours == theirs, f"{kind}: read {ours}, protobuf reads {theirs}"
    return ours


def _wrap(kind: str, body: bytes) -> bytes:
    """``body`` (a serialized FragmentChunk) as the chunk field of ``kind``'s message."""
    if kind == "fetch":
        return body
    return bytes([2 << 3 | 2]) + varint(len(body)) + body  # chunk is field 2 in both messages


@SETTINGS
@given(chunk=chunks, kind=st.sampled_from(sorted(KINDS)))
def test_a_chunk_is_written_as_protobuf_writes_it(chunk: Chunk, kind: str) -> None:
    serialize = KINDS[kind][0]
    assert serialize(chunk) == _TO_PB[kind](chunk).SerializeToString()
    # protobuf messages pass through unchanged, so tests and old callers may still write them
    assert serialize(_TO_PB[kind](chunk)) == _TO_PB[kind](chunk).SerializeToString()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_read_chunk_keeps_its_data_where_it_arrived(kind: str) -> None:
    serialize, parse, _, convert = KINDS[kind]
    payload = bytes(range(256)) * 40
    for chunk in split(HEADER, payload, transfer_id=5, max_chunk_bytes=3000):
        raw = serialize(chunk)
        parsed = parse(raw)
        assert isinstance(parsed, wire.SplitChunk)
        assert parsed.data.obj is raw  # a view of the received message, not a copy
        back = convert(parsed)
        assert (back.transfer_id, back.index, bytes(back.data), back.crc32c, back.header) == (
            chunk.transfer_id, chunk.index, bytes(chunk.data), chunk.crc32c, chunk.header)


def _field(**values: Any) -> bytes:
    return pb.FragmentChunk(**values).SerializeToString()


def _unknown(number: int, wire_type: int) -> bytes:
    body = {0: varint(300), 1: b"\x01" * 8, 2: varint(3) + b"abc", 5: b"\x02" * 4}[wire_type]
    return varint(number << 3 | wire_type) + body


@SETTINGS
@given(order=st.permutations(range(5)), data=st.lists(st.binary(max_size=40), min_size=0, max_size=3),
       unknown=st.lists(st.tuples(st.integers(6, 2000), st.sampled_from([0, 1, 2, 5])), max_size=3),
       kind=st.sampled_from(sorted(KINDS)))
def test_any_valid_encoding_reads_as_protobuf_reads_it(order: list[int], data: list[bytes],
                                                       unknown: list[tuple[int, int]], kind: str) -> None:
    """Fields in any order, the data field absent, empty or repeated (protobuf keeps the last),
    unknown fields of every wire type: each reads the same as through protobuf's parser."""
    header = pb.FragmentChunk()
    header.header.CopyFrom(wire.header_to_pb(HEADER))
    fields = [_field(transfer_id=9), _field(index=2), header.SerializeToString(), _field(crc32c=77),
              b"".join(_unknown(n, t) for n, t in unknown)]
    data_fields = [varint(4 << 3 | 2) + varint(len(d)) + d for d in data]
    body = b"".join(fields[i] for i in order[:3]) + b"".join(data_fields) + b"".join(fields[i] for i in order[3:])
    outcome, _ = _same_as_protobuf(kind, _wrap(kind, body))
    assert outcome == "chunk"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_damaged_bytes_fail_or_read_as_protobuf_reads_them(kind: str) -> None:
    """Every truncation and every single-byte change of a serialized chunk: the same message or the
    same error as protobuf's parser (lengths that run past the end, broken varints, wrong wire
    types, a chunk field that is not the whole message...)."""
    serialize = KINDS[kind][0]
    raw = serialize(split(HEADER, bytes(range(40)), transfer_id=300, max_chunk_bytes=64)[0])
    outcomes = set()
    for cut in range(len(raw)):
        outcomes.add(_same_as_protobuf(kind, raw[:cut])[0])
    for at in range(len(raw)):
        for value in (0x00, 0x01, 0x02, 0x05, 0x07, 0x22, 0x7F, 0x80, 0xFF):
            damaged = raw[:at] + bytes([value]) + raw[at + 1:]
            outcomes.add(_same_as_protobuf(kind, damaged)[0])
    assert {"chunk", "error"} <= outcomes  # both ways were exercised


def test_a_message_with_more_than_the_chunk_reads_as_protobuf_reads_it() -> None:
    """A oneof set twice keeps the last value: a chunk followed by a heartbeat is a heartbeat, a
    heartbeat followed by a chunk is a chunk."""
    chunk = wire.serialize_learner_message(split(HEADER, b"xyz" * 10, transfer_id=1)[0])
    beat = wire.learner_message_to_pb(wire.Heartbeat(step=3, tokens_total=4, tokens_per_s=1.0,
                                                     step_time_s=0.5)).SerializeToString()
    assert _same_as_protobuf("learner", chunk + beat)[0] == "other"
    assert _same_as_protobuf("learner", beat + chunk)[0] == "chunk"
    assert _same_as_protobuf("learner", chunk + chunk)[0] == "chunk"


def _overlong(value: int, size: int) -> bytes:
    """``value`` as a varint padded to ``size`` bytes: valid in form, longer than protobuf writes."""
    out = bytearray()
    for i in range(size):
        out.append((value >> (7 * i)) & 0x7F | (0x80 if i < size - 1 else 0))
    return bytes(out)


@pytest.mark.parametrize("size", [2, 5, 6, 10])
@pytest.mark.parametrize("padded", ["data key", "data length", "chunk key", "chunk length"])
def test_padded_varints_read_as_protobuf_reads_them(padded: str, size: int) -> None:
    """Keys and lengths the reader takes out by hand, written longer than they need be: protobuf
    accepts some such encodings and refuses others; the reader answers exactly as it does."""
    data = b"hello"
    data_key = _overlong(4 << 3 | 2, size) if padded == "data key" else b"\x22"
    data_len = _overlong(len(data), size) if padded == "data length" else bytes([len(data)])
    body = _field(transfer_id=5) + data_key + data_len + data + _field(crc32c=7)
    chunk_key = _overlong(2 << 3 | 2, size) if padded == "chunk key" else b"\x12"
    chunk_len = _overlong(len(body), size) if padded == "chunk length" else varint(len(body))
    for kind in ("learner", "synchronizer"):
        _same_as_protobuf(kind, chunk_key + chunk_len + body)
    if padded.startswith("data"):
        _same_as_protobuf("fetch", body)


def _nested_groups(depth: int) -> bytes:
    """An unknown field of ``depth`` nested groups (field 15: start group 0x7B, end group 0x7C)."""
    return b"\x7b" * depth + b"\x7c" * depth


@pytest.mark.parametrize("depth", [90, 97, 98, 99, 100, 101])
def test_nesting_limits_are_the_whole_messages(depth: int) -> None:
    """Protobuf limits how deep messages nest; the fields read beside the data meet the limit at
    the depth they have in the whole message, not one level higher."""
    header = wire.header_to_pb(HEADER).SerializeToString() + _nested_groups(depth)
    body = _field(transfer_id=1) + b"\x1a" + varint(len(header)) + header + b"\x22\x03abc"
    for kind in sorted(KINDS):
        _same_as_protobuf(kind, _wrap(kind, body))


def test_only_messages_of_at_most_16_fields_are_scanned() -> None:
    """The scan runs on the event loop, field by field in Python: a message of more fields than a
    chunk has (a million tiny ones would stall the loop for seconds) goes to protobuf's parser
    whole, and reads as protobuf reads it."""
    for fields, split_here in ((15, True), (16, False), (1_000_000, False)):
        body = b"\x08\x00" * fields + b"\x22\x03abc"  # ``fields`` transfer ids, then the data
        raw = _wrap("learner", body)
        assert isinstance(wire.parse_learner_message(raw), wire.SplitChunk) is split_here
        assert _same_as_protobuf("learner", raw)[0] == "chunk"


# -- chunks framed once, when encoded ------------------------------------------------------------


@SETTINGS
@given(chunk=chunks)
def test_a_framed_chunk_is_written_as_the_same_bytes_without_another_copy(chunk: Chunk) -> None:
    framed = wire.frame_chunks([chunk])[0]
    assert (framed.transfer_id, framed.index, bytes(framed.data), framed.crc32c, framed.header, framed.digest) == (
        chunk.transfer_id, chunk.index, bytes(chunk.data), chunk.crc32c, chunk.header, chunk.digest)
    for kind, (serialize, _, _, _) in KINDS.items():
        raw = serialize(framed)
        assert raw == serialize(chunk), kind
        if kind != "fetch":  # the Sync stream's messages: the frame itself, as it is
            assert raw is framed.framed()


def test_a_framed_chunk_changed_afterwards_is_written_anew() -> None:
    chunk = wire.frame_chunks(split(HEADER, bytes(range(200)), transfer_id=5, max_chunk_bytes=64))[0]
    changes = {"data": b"other data", "crc32c": 77, "transfer_id": 6, "index": 1, "header": None,
               "digest": b"d" * 16}
    for field, value in changes.items():
        changed = dataclasses.replace(chunk, **{field: value})
        assert changed.framed() is None, field
        for kind, (serialize, parse, _, convert) in KINDS.items():
            back = convert(parse(serialize(changed)))
            assert getattr(back, field) == value or bytes(getattr(back, field)) == value, (kind, field)
    with_crc = chunk.with_crc32c()
    assert with_crc.framed() is None and with_crc.crc32c != 0
    back = wire.learner_message_from_pb(wire.parse_learner_message(wire.serialize_learner_message(with_crc)))
    assert back.crc32c == with_crc.crc32c


@pytest.mark.parametrize("kind", ["learner", "synchronizer"])
def test_a_received_chunk_is_relayed_as_the_message_it_came_in(kind: str) -> None:
    serialize, parse, _, convert = KINDS[kind]
    raw = serialize(Chunk(9, 0, bytes(range(100)), 0, HEADER))
    received = convert(parse(raw))
    assert received.framed() is raw
    for other, (send, _, _, _) in KINDS.items():  # either direction of the Sync stream
        out = send(received)
        assert out == (raw if other != "fetch" else wire.serialize_fragment_chunk(Chunk(9, 0, bytes(range(100)), 0,
                                                                                         HEADER)))
    fetched = wire.chunk_from_pb(wire.parse_fragment_chunk(wire.serialize_fragment_chunk(received)))
    assert fetched.frame is None  # a bare FragmentChunk is no Sync-stream message


def test_fp32_values_framed_when_encoded_are_copied_once_and_may_change_afterwards() -> None:
    values = torch.randn(5000)
    layout = partition_tensors({"w": values}, 1)
    kept = values.clone()
    chunks = encode_fragment(values, layout[0], codec=make_codec("fp32"), kind="contribution", version=0,
                             transfer_id=1, max_chunk_bytes=4096, frame=wire.frame_chunks)
    assert all(c.framed() is not None for c in chunks)
    values.fill_(7.0)  # the caller's buffer moves on; the chunks hold their own copy
    reassembler = Reassembler(max_chunk_bytes=4096)
    transfer = None
    for c in chunks:
        transfer = reassembler.feed(wire.learner_message_from_pb(
            wire.parse_learner_message(wire.serialize_learner_message(c))))
    assert transfer is not None
    assert torch.equal(decode_fragment(transfer, layout), kept)
