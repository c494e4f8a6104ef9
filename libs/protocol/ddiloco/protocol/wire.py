"""The one module that speaks protobuf: dataclasses <-> ``ddiloco.v1`` messages.

Everything else in ddiloco works with the dataclasses defined here and in ``chunking``; only this
module imports the generated code (a test enforces it). Enum values travel as their short
lower-case names in Python ("bf16_zstd", "stale", "merged").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError, Message

from ddiloco.fragments.chunking import Chunk, TransferHeader
from ddiloco.fragments.errors import CodecError, HeaderError
from ddiloco.fragments.partition import TensorSpec
from ddiloco.v1 import synchronizer_pb2 as pb
from ddiloco.v1 import synchronizer_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ddiloco.protocol.config import ProtocolConfig

MalformedMessage = DecodeError
"""Raised while reading a stream whose bytes are not a protobuf message of the expected type."""

SynchronizerServicer = pb_grpc.SynchronizerServicer
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Synchronizer"].full_name

LearnerMessagePB = pb.LearnerMessage
SynchronizerMessagePB = pb.SynchronizerMessage

_CODECS = {"fp32": pb.CODEC_FP32, "bf16_zstd": pb.CODEC_BF16_ZSTD, "int8_block": pb.CODEC_INT8_BLOCK,
           "int4_block": pb.CODEC_INT4_BLOCK, "int2_block": pb.CODEC_INT2_BLOCK}
_CODECS_BY_VALUE = {v: k for k, v in _CODECS.items()}
_DTYPES = {"float32": pb.DTYPE_FLOAT32, "bfloat16": pb.DTYPE_BFLOAT16, "float16": pb.DTYPE_FLOAT16,
           "float64": pb.DTYPE_FLOAT64}
_DTYPES_BY_VALUE = {v: k for k, v in _DTYPES.items()}
_KINDS = {"contribution": pb.PAYLOAD_KIND_CONTRIBUTION, "genesis": pb.PAYLOAD_KIND_GENESIS,
          "global": pb.PAYLOAD_KIND_GLOBAL}
_KINDS_BY_VALUE = {v: k for k, v in _KINDS.items()}
_STATES = {"ready": pb.STATE_STATUS_READY, "genesis_requested": pb.STATE_STATUS_GENESIS_REQUESTED,
           "genesis_pending": pb.STATE_STATUS_GENESIS_PENDING}
_STATES_BY_VALUE = {v: k for k, v in _STATES.items()}
_OUTCOMES = {"merged": pb.CONTRIBUTION_OUTCOME_MERGED, "rejected": pb.CONTRIBUTION_OUTCOME_REJECTED,
             "superseded": pb.CONTRIBUTION_OUTCOME_SUPERSEDED}
_OUTCOMES_BY_VALUE = {v: k for k, v in _OUTCOMES.items()}
REJECT_REASONS = tuple(
    name.removeprefix("REJECT_REASON_").lower()
    for name in pb.RejectReason.keys()  # noqa: SIM118 - an enum wrapper, not a dict
    if not name.endswith("UNSPECIFIED")
)


def _reason_value(reason: str) -> int:
    try:
        return pb.RejectReason.Value("REJECT_REASON_" + reason.upper())
    except ValueError:
        raise ValueError(f"unknown reject reason {reason!r}; known: {', '.join(REJECT_REASONS)}") from None


def _reason_name(value: int) -> str:
    return pb.RejectReason.Name(value).removeprefix("REJECT_REASON_").lower()


def codec_to_pb(name: str) -> int:
    try:
        return _CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}") from None


def codec_from_pb(value: int) -> str:
    try:
        return _CODECS_BY_VALUE[value]
    except KeyError:
        raise CodecError(f"unknown codec enum value {value}") from None


# ---------------------------------------------------------------------------------------------
# Dataclasses of the control messages
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ProtocolParams:
    num_fragments: int
    sync_every: int
    overlap: int
    max_chunk_bytes: int
    mode: str
    global_codec: str = "bf16_zstd"

    @classmethod
    def from_config(cls, cfg: ProtocolConfig) -> ProtocolParams:
        """The protocol section of a config as sent in Hello and Welcome. Reads the fields by name
        (this module does not import the config at run time), so any object with them will do."""
        return cls(num_fragments=cfg.num_fragments, sync_every=cfg.sync_every, overlap=cfg.overlap,
                   max_chunk_bytes=cfg.max_chunk_bytes, mode=cfg.mode, global_codec=cfg.global_codec)


@dataclass(frozen=True, kw_only=True)
class Hello:
    learner_id: str
    model_fingerprint: str
    layout_hash: str
    protocol: ProtocolParams
    codecs: tuple[str, ...] = ("bf16_zstd", "fp32", "int8_block", "int4_block", "int2_block")
    held: dict[int, int] = field(default_factory=dict)
    software_version: str = ""
    incarnation: int = 0
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    step: int
    tokens_total: int
    tokens_per_s: float
    step_time_s: float
    sent_at_unix: float = 0.0
    training_done: bool = False


@dataclass(frozen=True, kw_only=True)
class Goodbye:
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Welcome:
    synchronizer_id: str
    protocol: ProtocolParams
    state: str
    versions: dict[int, int] = field(default_factory=dict)
    heartbeat_interval_s: float = 1.0
    shard_index: int = 0
    shard_count: int = 1
    fleet_step: int = 0


@dataclass(frozen=True, kw_only=True)
class ContributionResult:
    sequence: int
    fragment_id: int
    outcome: str
    version: int = 0
    reason: str = ""
    detail: str = ""
    weight: float = 0.0
    staleness: int = 0


@dataclass(frozen=True, kw_only=True)
class Resync:
    fragment_ids: tuple[int, ...] = ()
    reason: str = "stale"
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class FragmentRequest:
    fragment_id: int
    round: int
    version: int = 0


@dataclass(frozen=True, kw_only=True)
class Drain:
    reason: str = ""
    deadline_s: float = 30.0


@dataclass(frozen=True, kw_only=True)
class FetchStateRequest:
    learner_id: str
    fragment_ids: tuple[int, ...] = ()
    codec: str = ""


@dataclass(frozen=True, kw_only=True)
class LearnerStatus:
    learner_id: str
    connected: bool
    live: bool
    last_seen_s: float
    step: int = 0
    tokens_per_s: float = 0.0
    merged: int = 0
    rejected: int = 0
    superseded: int = 0
    tokens_merged: int = 0
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class FragmentStatus:
    fragment_id: int
    version: int
    last_quorum_size: int = 0
    last_merge_unix: float = 0.0
    pending: int = 0
    last_grace_s: float = 0.0
    num_values: int = 0
    round: int = 0


@dataclass(frozen=True, kw_only=True)
class StatusReply:
    synchronizer_id: str
    mode: str
    uptime_s: float
    state: str
    protocol: ProtocolParams | None = None
    quorum: int = 0
    learners: tuple[LearnerStatus, ...] = ()
    fragments: tuple[FragmentStatus, ...] = ()
    merges_total: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    token_goodput: float = 0.0
    fleet_step: float = 0.0


LearnerMessage = Hello | Chunk | Heartbeat | Goodbye
SynchronizerMessage = Welcome | Chunk | ContributionResult | Resync | Drain | FragmentRequest


# ---------------------------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------------------------


def protocol_to_pb(p: ProtocolParams) -> pb.ProtocolParams:
    return pb.ProtocolParams(num_fragments=p.num_fragments, sync_every=p.sync_every, overlap=p.overlap,
                             max_chunk_bytes=p.max_chunk_bytes, mode=p.mode,
                             global_codec=codec_to_pb(p.global_codec))


def protocol_from_pb(m: pb.ProtocolParams) -> ProtocolParams:
    return ProtocolParams(num_fragments=m.num_fragments, sync_every=m.sync_every, overlap=m.overlap,
                          max_chunk_bytes=m.max_chunk_bytes, mode=m.mode,
                          global_codec=_CODECS_BY_VALUE.get(m.global_codec, "bf16_zstd"))


def _versions_to_pb(versions: dict[int, int]) -> list[pb.FragmentVersion]:
    return [pb.FragmentVersion(fragment_id=p, version=v) for p, v in sorted(versions.items())]


def _versions_from_pb(items: Iterable[pb.FragmentVersion]) -> dict[int, int]:
    return {m.fragment_id: m.version for m in items}


def header_to_pb(h: TransferHeader) -> pb.FragmentHeader:
    return pb.FragmentHeader(
        kind=_KINDS[h.kind], fragment_id=h.fragment_id, version=h.version, sequence=h.sequence,
        tokens=h.tokens, steps=h.steps, codec=codec_to_pb(h.codec), block_size=h.block_size,
        tensors=[pb.TensorSpec(name=t.name, shape=list(t.shape), dtype=_DTYPES[t.dtype]) for t in h.tensors],
        num_values=h.num_values, encoded_bytes=h.encoded_bytes, chunk_count=h.chunk_count, digest=h.digest,
        layout_hash=h.layout_hash, learner_step=h.learner_step, sent_at_unix=h.sent_at_unix, round=h.round,
    )


def header_from_pb(m: pb.FragmentHeader) -> TransferHeader:
    if m.kind not in _KINDS_BY_VALUE:
        raise HeaderError(f"unknown payload kind {m.kind}")
    tensors = []
    for t in m.tensors:
        if t.dtype not in _DTYPES_BY_VALUE:
            raise HeaderError(f"tensor {t.name!r} has unknown dtype enum {t.dtype}")
        if any(s < 0 for s in t.shape):
            raise HeaderError(f"tensor {t.name!r} has a negative dimension")
        tensors.append(TensorSpec(t.name, tuple(t.shape), _DTYPES_BY_VALUE[t.dtype]))
    return TransferHeader(
        kind=_KINDS_BY_VALUE[m.kind], fragment_id=m.fragment_id, version=m.version, sequence=m.sequence,
        tokens=m.tokens, steps=m.steps, codec=codec_from_pb(m.codec), block_size=m.block_size,
        tensors=tuple(tensors), num_values=m.num_values, encoded_bytes=m.encoded_bytes,
        chunk_count=m.chunk_count, digest=m.digest, layout_hash=m.layout_hash,
        learner_step=m.learner_step, sent_at_unix=m.sent_at_unix, round=m.round,
    )


def chunk_to_pb(c: Chunk) -> pb.FragmentChunk:
    return _fill_chunk(pb.FragmentChunk(), c)


def _fill_chunk(msg: pb.FragmentChunk, c: Chunk) -> pb.FragmentChunk:
    """Write ``c`` into ``msg`` in place. Chunk messages are always built in place: passing a
    filled FragmentChunk to its parent's constructor copies it, and for a 4 MiB chunk that copy
    took 9 ms, about 60 times the cost of filling the field (see ``ddiloco bench wire``)."""
    msg.transfer_id, msg.index, msg.crc32c = c.transfer_id, c.index, c.crc32c
    msg.data = c.data if isinstance(c.data, bytes) else bytes(c.data)
    if c.header is not None:
        msg.header.CopyFrom(header_to_pb(c.header))
    return msg


def chunk_from_pb(m: pb.FragmentChunk | SplitChunk) -> Chunk:
    if isinstance(m, SplitChunk):
        data: bytes | memoryview = m.data
        m = m.rest
    else:
        data = m.data
    header = header_from_pb(m.header) if m.HasField("header") else None
    return Chunk(m.transfer_id, m.index, data, m.crc32c, header)


# ---------------------------------------------------------------------------------------------
# Chunk messages on the wire, without protobuf touching the data
# ---------------------------------------------------------------------------------------------
# A chunk's data is nearly all of every byte the service moves. Built as a protobuf message, a
# 4 MiB chunk is copied three times on its way out (into bytes, into the message, into the
# serialized string) and twice on its way in (parsing, reading the field back); for a 64 MiB
# fragment that is 90-120 ms of copying on the sending side and 55-85 ms on the receiving side
# (see docs/benchmarks.md). Chunk messages are therefore written and read here by hand. The
# bytes are exactly the ones protobuf writes (its encoder emits fields in field-number order;
# a test compares the two), so any protobuf implementation reads them. Reading takes the data
# out only where it is written as protobuf writes it (one data field, shortest varints for its
# key and length and the message's, at most 16 fields); the other fields are parsed by
# protobuf at the depth they have in the message, and anything else goes to protobuf's parser
# whole. So what is read, and every error, is protobuf's own (tests compare the two).

_LEN = 2  # protobuf wire type of length-delimited fields
_DATA_FIELD = pb.FragmentChunk.DESCRIPTOR.fields_by_name["data"].number
_LEARNER_CHUNK_FIELD = pb.LearnerMessage.DESCRIPTOR.fields_by_name["chunk"].number
_SYNCHRONIZER_CHUNK_FIELD = pb.SynchronizerMessage.DESCRIPTOR.fields_by_name["chunk"].number
_DATA_KEY = bytes([_DATA_FIELD << 3 | _LEN])
_MAX_VARINT_BYTES = 10
_MAX_CHUNK_FIELDS = 16
"""A chunk has 5 fields; a message with more is left to protobuf's parser rather than scanned in
Python (the scan runs on the event loop: millions of tiny fields would stall it for seconds)."""


@dataclass(frozen=True, slots=True)
class SplitChunk:
    """A FragmentChunk read off the wire with its data left where it arrived: ``rest`` holds every
    other field, ``data`` is a view of the received message."""

    rest: pb.FragmentChunk
    data: memoryview


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it); (-1, end + 1) for a varint that runs past ``end`` or is too long."""
    value = shift = 0
    for i in range(pos, min(end, pos + _MAX_VARINT_BYTES)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return -1, end + 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_CHUNK_KEYS: dict[type[Message], bytes] = {pb.LearnerMessage: _varint(_LEARNER_CHUNK_FIELD << 3 | _LEN),
                                           pb.SynchronizerMessage: _varint(_SYNCHRONIZER_CHUNK_FIELD << 3 | _LEN)}


def _chunk_parts(c: Chunk) -> tuple[list[bytes | memoryview], int]:
    """The serialized FragmentChunk of ``c`` as parts to join, and its length."""
    data = c.data
    if not isinstance(data, bytes):  # lengths count bytes, whatever the view's format
        view = memoryview(data)
        data = view.cast("B") if view.c_contiguous else view.tobytes()
    before = pb.FragmentChunk(transfer_id=c.transfer_id, index=c.index)
    if c.header is not None:
        before.header.CopyFrom(header_to_pb(c.header))
    parts: list[bytes | memoryview] = [before.SerializeToString()]
    if len(data):
        parts += [_DATA_KEY + _varint(len(data)), data]
    parts.append(pb.FragmentChunk(crc32c=c.crc32c).SerializeToString())
    return parts, sum(len(p) for p in parts)


def _serialize_chunk(c: Chunk, outer: type[Message] | None) -> bytes:
    """``c`` as a FragmentChunk, or as the chunk of an ``outer`` message."""
    parts, size = _chunk_parts(c)
    if outer is not None:
        parts.insert(0, _CHUNK_KEYS[outer] + _varint(size))
    return b"".join(parts)


def _length(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """A length written as protobuf writes it (the shortest varint): (length, where the bytes
    start); (-1, 0) for anything else, which the caller leaves to protobuf's parser."""
    size, body = _read_varint(raw, pos, end)
    if size < 0 or body - pos != len(_varint(size)) or body + size > end:
        return -1, 0
    return size, body


def _split_chunk(raw: bytes, start: int, outer: type[Message] | None) -> SplitChunk | None:
    """``raw[start:]`` as a FragmentChunk whose one data field is written as protobuf writes it,
    the data not copied; None for anything else (the caller hands that to protobuf's parser).
    The other fields are parsed by protobuf, inside ``outer``'s chunk field when given, so depth
    limits and errors are the ones the whole message would meet."""
    end, pos, data_at = len(raw), start, None
    for _ in range(_MAX_CHUNK_FIELDS):
        if pos == end:
            break
        key, after_key = _read_varint(raw, pos, end)
        wire_type, field = key & 7, key >> 3
        if key < 0:
            return None
        if wire_type == 0:
            _, after = _read_varint(raw, after_key, end)
        elif wire_type == 1:
            after = after_key + 8
        elif wire_type == 5:
            after = after_key + 4
        elif wire_type == _LEN:
            is_data = field == _DATA_FIELD
            size, body = (_length if is_data else _read_varint)(raw, after_key, end)
            if size < 0 or (is_data and (data_at is not None or raw[pos:after_key] != _DATA_KEY)):
                return None  # broken, repeated (the last one wins) or written unlike protobuf: its parser decides
            after = body + size
            if is_data:
                data_at = (pos, body, after)
        else:
            return None  # groups and invalid wire types
        if after > end:
            return None
        pos = after
    else:
        if pos != end:
            return None  # more fields than a chunk has: not worth scanning in Python
    if data_at is None:
        return None
    key_at, body, after = data_at
    rest = raw[start:key_at] + raw[after:]
    if outer is None:
        parsed = pb.FragmentChunk.FromString(rest)
    else:
        parsed = outer.FromString(_CHUNK_KEYS[outer] + _varint(len(rest)) + rest).chunk
    return SplitChunk(parsed, memoryview(raw)[body:after])


def _split_message(raw: bytes, outer: type[Message]) -> SplitChunk | None:
    """``raw`` as an ``outer`` message whose only field is its chunk (see ``_split_chunk``)."""
    key = _CHUNK_KEYS[outer]
    if raw[:len(key)] != key:
        return None
    size, body = _length(raw, len(key), len(raw))
    if size < 0 or body + size != len(raw):
        return None
    return _split_chunk(raw, body, outer)


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


def learner_message_to_pb(msg: LearnerMessage) -> pb.LearnerMessage:
    if isinstance(msg, Chunk):
        out = pb.LearnerMessage()
        _fill_chunk(out.chunk, msg)
        return out
    if isinstance(msg, Heartbeat):
        return pb.LearnerMessage(heartbeat=pb.Heartbeat(
            step=msg.step, tokens_total=msg.tokens_total, tokens_per_s=msg.tokens_per_s,
            step_time_s=msg.step_time_s, sent_at_unix=msg.sent_at_unix, training_done=msg.training_done))
    if isinstance(msg, Hello):
        return pb.LearnerMessage(hello=pb.Hello(
            learner_id=msg.learner_id, model_fingerprint=msg.model_fingerprint, layout_hash=msg.layout_hash,
            codecs=[codec_to_pb(c) for c in msg.codecs], protocol=protocol_to_pb(msg.protocol),
            held=_versions_to_pb(msg.held), software_version=msg.software_version,
            incarnation=msg.incarnation, labels=msg.labels))
    if isinstance(msg, Goodbye):
        return pb.LearnerMessage(goodbye=pb.Goodbye(reason=msg.reason))
    raise TypeError(f"not a learner message: {type(msg).__name__}")


def learner_message_from_pb(m: pb.LearnerMessage | SplitChunk) -> LearnerMessage:
    if isinstance(m, SplitChunk):
        return chunk_from_pb(m)
    body = m.WhichOneof("body")
    if body == "chunk":
        return chunk_from_pb(m.chunk)
    if body == "heartbeat":
        h = m.heartbeat
        return Heartbeat(step=h.step, tokens_total=h.tokens_total, tokens_per_s=h.tokens_per_s,
                         step_time_s=h.step_time_s, sent_at_unix=h.sent_at_unix, training_done=h.training_done)
    if body == "hello":
        h = m.hello
        return Hello(learner_id=h.learner_id, model_fingerprint=h.model_fingerprint, layout_hash=h.layout_hash,
                     codecs=tuple(_CODECS_BY_VALUE[c] for c in h.codecs if c in _CODECS_BY_VALUE),
                     protocol=protocol_from_pb(h.protocol), held=_versions_from_pb(h.held),
                     software_version=h.software_version, incarnation=h.incarnation, labels=dict(h.labels))
    if body == "goodbye":
        return Goodbye(reason=m.goodbye.reason)
    raise HeaderError("empty learner message")


def synchronizer_message_to_pb(msg: SynchronizerMessage) -> pb.SynchronizerMessage:
    if isinstance(msg, Chunk):
        out = pb.SynchronizerMessage()
        _fill_chunk(out.chunk, msg)
        return out
    if isinstance(msg, ContributionResult):
        return pb.SynchronizerMessage(result=pb.ContributionResult(
            sequence=msg.sequence, fragment_id=msg.fragment_id, outcome=_OUTCOMES[msg.outcome],
            version=msg.version, reason=_reason_value(msg.reason) if msg.reason else 0, detail=msg.detail,
            weight=msg.weight, staleness=msg.staleness))
    if isinstance(msg, Welcome):
        return pb.SynchronizerMessage(welcome=pb.Welcome(
            synchronizer_id=msg.synchronizer_id, protocol=protocol_to_pb(msg.protocol),
            versions=_versions_to_pb(msg.versions), state=_STATES[msg.state],
            heartbeat_interval_s=msg.heartbeat_interval_s, shard_index=msg.shard_index,
            shard_count=msg.shard_count, fleet_step=msg.fleet_step))
    if isinstance(msg, Resync):
        return pb.SynchronizerMessage(resync=pb.Resync(
            fragment_ids=list(msg.fragment_ids), reason=_reason_value(msg.reason) if msg.reason else 0,
            detail=msg.detail))
    if isinstance(msg, Drain):
        return pb.SynchronizerMessage(drain=pb.Drain(reason=msg.reason, deadline_s=msg.deadline_s))
    if isinstance(msg, FragmentRequest):
        return pb.SynchronizerMessage(request=pb.FragmentRequest(fragment_id=msg.fragment_id, round=msg.round,
                                                                 version=msg.version))
    raise TypeError(f"not a synchronizer message: {type(msg).__name__}")


def synchronizer_message_from_pb(m: pb.SynchronizerMessage | SplitChunk) -> SynchronizerMessage:
    if isinstance(m, SplitChunk):
        return chunk_from_pb(m)
    body = m.WhichOneof("body")
    if body == "chunk":
        return chunk_from_pb(m.chunk)
    if body == "result":
        r = m.result
        return ContributionResult(sequence=r.sequence, fragment_id=r.fragment_id,
                                  outcome=_OUTCOMES_BY_VALUE.get(r.outcome, "rejected"), version=r.version,
                                  reason=_reason_name(r.reason) if r.reason else "", detail=r.detail,
                                  weight=r.weight, staleness=r.staleness)
    if body == "welcome":
        w = m.welcome
        return Welcome(synchronizer_id=w.synchronizer_id, protocol=protocol_from_pb(w.protocol),
                       state=_STATES_BY_VALUE.get(w.state, "genesis_pending"),
                       versions=_versions_from_pb(w.versions), heartbeat_interval_s=w.heartbeat_interval_s,
                       shard_index=w.shard_index, shard_count=w.shard_count or 1, fleet_step=w.fleet_step)
    if body == "resync":
        r = m.resync
        return Resync(fragment_ids=tuple(r.fragment_ids), reason=_reason_name(r.reason) if r.reason else "",
                      detail=r.detail)
    if body == "drain":
        return Drain(reason=m.drain.reason, deadline_s=m.drain.deadline_s)
    if body == "request":
        r = m.request
        return FragmentRequest(fragment_id=r.fragment_id, round=r.round, version=r.version)
    raise HeaderError("empty synchronizer message")


def fetch_request_to_pb(r: FetchStateRequest) -> pb.FetchStateRequest:
    return pb.FetchStateRequest(learner_id=r.learner_id, fragment_ids=list(r.fragment_ids),
                                codec=codec_to_pb(r.codec) if r.codec else 0)


def fetch_request_from_pb(m: pb.FetchStateRequest) -> FetchStateRequest:
    return FetchStateRequest(learner_id=m.learner_id, fragment_ids=tuple(m.fragment_ids),
                             codec=_CODECS_BY_VALUE.get(m.codec, ""))


def status_request_pb() -> pb.GetStatusRequest:
    return pb.GetStatusRequest()


def status_to_pb(s: StatusReply) -> pb.StatusReply:
    msg = pb.StatusReply(
        synchronizer_id=s.synchronizer_id, mode=s.mode, uptime_s=s.uptime_s, state=_STATES[s.state],
        learners=[pb.LearnerStatus(
            learner_id=ls.learner_id, connected=ls.connected, live=ls.live, last_seen_s=ls.last_seen_s,
            step=ls.step, tokens_per_s=ls.tokens_per_s, merged=ls.merged, rejected=ls.rejected,
            superseded=ls.superseded, tokens_merged=ls.tokens_merged, labels=ls.labels) for ls in s.learners],
        fragments=[pb.FragmentStatus(
            fragment_id=f.fragment_id, version=f.version, last_quorum_size=f.last_quorum_size,
            last_merge_unix=f.last_merge_unix, pending=f.pending, last_grace_s=f.last_grace_s,
            num_values=f.num_values, round=f.round) for f in s.fragments],
        merges_total=s.merges_total, rejected_by_reason=s.rejected_by_reason, token_goodput=s.token_goodput,
        quorum=s.quorum, fleet_step=s.fleet_step,
    )
    if s.protocol is not None:
        msg.protocol.CopyFrom(protocol_to_pb(s.protocol))
    return msg


def status_from_pb(m: pb.StatusReply) -> StatusReply:
    return StatusReply(
        synchronizer_id=m.synchronizer_id, mode=m.mode, uptime_s=m.uptime_s,
        state=_STATES_BY_VALUE.get(m.state, "genesis_pending"),
        protocol=protocol_from_pb(m.protocol) if m.HasField("protocol") else None, quorum=m.quorum,
        learners=tuple(LearnerStatus(
            learner_id=ls.learner_id, connected=ls.connected, live=ls.live, last_seen_s=ls.last_seen_s,
            step=ls.step, tokens_per_s=ls.tokens_per_s, merged=ls.merged, rejected=ls.rejected,
            superseded=ls.superseded, tokens_merged=ls.tokens_merged, labels=dict(ls.labels))
            for ls in m.learners),
        fragments=tuple(FragmentStatus(
            fragment_id=f.fragment_id, version=f.version, last_quorum_size=f.last_quorum_size,
            last_merge_unix=f.last_merge_unix, pending=f.pending, last_grace_s=f.last_grace_s,
            num_values=f.num_values, round=f.round) for f in m.fragments),
        merges_total=m.merges_total, rejected_by_reason=dict(m.rejected_by_reason),
        token_goodput=m.token_goodput, fleet_step=m.fleet_step,
    )
