"""The Synchronizer service's RPCs as gRPC sees them: the serializers and deserializers of their
messages, the client stub and the server's registration that use them.

Chunk messages are written and read by hand around ``framing`` (their data never copied by
protobuf); every other message, and every field of a chunk but its data, by protobuf.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from ddiloco.fragments.chunking import Chunk, Frame
from ddiloco.protocol.wire.convert import SplitChunk, header_to_pb
from ddiloco.protocol.wire.framing import field_key, find_bytes_field, unwrap, varint
from ddiloco.v1 import synchronizer_pb2 as pb
from ddiloco.v1 import synchronizer_pb2_grpc as pb_grpc

MalformedMessage = DecodeError
"""Raised while reading a stream whose bytes are not a protobuf message of the expected type."""

SynchronizerServicer = pb_grpc.SynchronizerServicer
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Synchronizer"].full_name

# ---------------------------------------------------------------------------------------------
# Chunk messages on the wire, without protobuf touching the data (see ``framing``)
# ---------------------------------------------------------------------------------------------

_DATA_FIELD = pb.FragmentChunk.DESCRIPTOR.fields_by_name["data"].number
_DATA_KEY = field_key(_DATA_FIELD)
_CHUNK_KEYS: dict[type[Message], bytes] = {
    pb.LearnerMessage: field_key(pb.LearnerMessage.DESCRIPTOR.fields_by_name["chunk"].number),
    pb.SynchronizerMessage: field_key(pb.SynchronizerMessage.DESCRIPTOR.fields_by_name["chunk"].number),
}


def _chunk_parts(c: Chunk) -> tuple[list[bytes | memoryview], int, int]:
    """The serialized FragmentChunk of ``c`` as parts to join, its length, and where its data
    starts in it."""
    data = c.data
    if not isinstance(data, bytes):  # lengths count bytes, whatever the view's format
        view = memoryview(data)
        data = view.cast("B") if view.c_contiguous else view.tobytes()
    before = pb.FragmentChunk(transfer_id=c.transfer_id, index=c.index)
    if c.header is not None:
        before.header.CopyFrom(header_to_pb(c.header))
    parts: list[bytes | memoryview] = [before.SerializeToString()]
    if len(data):
        parts += [_DATA_KEY + varint(len(data)), data]
    data_at = sum(len(p) for p in parts) - len(data)
    parts.append(pb.FragmentChunk(crc32c=c.crc32c, digest=c.digest).SerializeToString())
    return parts, sum(len(p) for p in parts), data_at


# A chunk is field ``chunk`` of the Sync stream's messages in both directions, with the same
# number: one framed message serves a learner's chunk and a synchronizer's.
_SYNC_CHUNK_KEY = _CHUNK_KEYS[pb.LearnerMessage]
if _CHUNK_KEYS[pb.SynchronizerMessage] != _SYNC_CHUNK_KEY:  # pragma: no cover - the .proto's promise
    raise ImportError("LearnerMessage.chunk and SynchronizerMessage.chunk must have the same field number")


def _serialize_chunk(c: Chunk, outer: type[Message] | None) -> bytes:
    """``c`` as a FragmentChunk, or as the chunk of an ``outer`` message."""
    if outer is not None and (framed := c.framed()) is not None:
        return framed
    parts, size, _ = _chunk_parts(c)
    if outer is not None:
        parts.insert(0, _CHUNK_KEYS[outer] + varint(size))
    return b"".join(parts)


def frame_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """The chunks written now as Sync-stream messages, each one's data a view into its message.

    Each byte is copied once, here (from a codec's output, or straight from a tensor's memory
    that the caller may change afterwards), and not again when the chunk is written to a stream:
    the serializer hands the message to gRPC as it is. A chunk changed afterwards
    (``dataclasses.replace``, ``Chunk.with_crc32c``) or sent on FetchState is serialized anew."""
    out = []
    for c in chunks:
        parts, size, data_at = _chunk_parts(c)
        head = _SYNC_CHUNK_KEY + varint(size)
        message = b"".join([head, *parts])
        start, n = len(head) + data_at, len(parts[2]) if len(parts) == 4 else 0
        data = memoryview(message)[start:start + n]
        out.append(Chunk(c.transfer_id, c.index, data, c.crc32c, c.header,
                         Frame(message, (c.transfer_id, c.index, c.crc32c, c.header, data, c.digest)), c.digest))
    return out


def _split_chunk(raw: bytes, start: int, outer: type[Message] | None) -> SplitChunk | None:
    """``raw[start:]`` as a FragmentChunk whose one data field is written as protobuf writes it,
    the data not copied; None for anything else (the caller hands that to protobuf's parser).
    The other fields are parsed by protobuf, inside ``outer``'s chunk field when given, so depth
    limits and errors are the ones the whole message would meet."""
    found = find_bytes_field(raw, start, _DATA_FIELD)
    if found is None:
        return None
    key_at, body, after = found
    rest = raw[start:key_at] + raw[after:]
    if outer is None:
        parsed = pb.FragmentChunk.FromString(rest)
    else:
        parsed = outer.FromString(_CHUNK_KEYS[outer] + varint(len(rest)) + rest).chunk
    # inside a Sync-stream message of nothing else (``_split_message``), the message as received is
    # the chunk's frame: a relay sends it on as it is
    return SplitChunk(parsed, memoryview(raw)[body:after], raw if outer is not None else None)


def _split_message(raw: bytes, outer: type[Message]) -> SplitChunk | None:
    """``raw`` as an ``outer`` message whose only field is its chunk (see ``_split_chunk``)."""
    body = unwrap(raw, _CHUNK_KEYS[outer])
    return None if body is None else _split_chunk(raw, body, outer)


def serialize_learner_message(msg: Chunk | pb.LearnerMessage) -> bytes:
    """The Sync stream's request serializer: a chunk by hand, any other message by protobuf."""
    if isinstance(msg, Chunk):
        return _serialize_chunk(msg, pb.LearnerMessage)
    return msg.SerializeToString()


def serialize_synchronizer_message(msg: Chunk | pb.SynchronizerMessage) -> bytes:
    if isinstance(msg, Chunk):
        return _serialize_chunk(msg, pb.SynchronizerMessage)
    return msg.SerializeToString()


def serialize_fragment_chunk(msg: Chunk | pb.FragmentChunk) -> bytes:
    if isinstance(msg, Chunk):
        return _serialize_chunk(msg, None)
    return msg.SerializeToString()


def parse_learner_message(raw: bytes) -> pb.LearnerMessage | SplitChunk:
    """The Sync stream's request deserializer; raises ``MalformedMessage`` like protobuf does."""
    return _split_message(raw, pb.LearnerMessage) or pb.LearnerMessage.FromString(raw)


def parse_synchronizer_message(raw: bytes) -> pb.SynchronizerMessage | SplitChunk:
    return _split_message(raw, pb.SynchronizerMessage) or pb.SynchronizerMessage.FromString(raw)


def parse_fragment_chunk(raw: bytes) -> pb.FragmentChunk | SplitChunk:
    return _split_chunk(raw, 0, None) or pb.FragmentChunk.FromString(raw)


# ---------------------------------------------------------------------------------------------
# The stub and the servicer's registration
# ---------------------------------------------------------------------------------------------

_SYNC = f"/{SERVICE_NAME}/Sync"
_FETCH_STATE = f"/{SERVICE_NAME}/FetchState"
_GET_STATUS = f"/{SERVICE_NAME}/GetStatus"


class SynchronizerStub:
    """The client side of the service, with chunks written and read by this module."""

    def __init__(self, channel: Any) -> None:
        self.Sync = channel.stream_stream(_SYNC, request_serializer=serialize_learner_message,
                                          response_deserializer=parse_synchronizer_message,
                                          _registered_method=True)
        self.FetchState = channel.unary_stream(_FETCH_STATE, request_serializer=pb.FetchStateRequest.SerializeToString,
                                               response_deserializer=parse_fragment_chunk, _registered_method=True)
        self.GetStatus = channel.unary_unary(_GET_STATUS, request_serializer=pb.GetStatusRequest.SerializeToString,
                                             response_deserializer=pb.StatusReply.FromString, _registered_method=True)


def add_synchronizer_servicer(servicer: Any, server: Any) -> None:
    """Register ``servicer``'s Sync, FetchState and GetStatus on ``server``, chunks by this module."""
    handlers = {
        "Sync": grpc.stream_stream_rpc_method_handler(
            servicer.Sync, request_deserializer=parse_learner_message,
            response_serializer=serialize_synchronizer_message),
        "FetchState": grpc.unary_stream_rpc_method_handler(
            servicer.FetchState, request_deserializer=pb.FetchStateRequest.FromString,
            response_serializer=serialize_fragment_chunk),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus, request_deserializer=pb.GetStatusRequest.FromString,
            response_serializer=pb.StatusReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
