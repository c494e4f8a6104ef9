"""The messages' dataclasses (``messages``) <-> the generated protobuf messages of ``ddiloco.v1``.

Enum values travel as their short lower-case names in Python ("bf16_zstd", "stale", "merged").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ddiloco.fragments.chunking import Chunk, Frame, TransferHeader
from ddiloco.fragments.errors import CodecError, HeaderError
from ddiloco.fragments.partition import TensorSpec
from ddiloco.protocol.wire.messages import (
    ContributionResult,
    Drain,
    FetchStateRequest,
    FragmentRequest,
    FragmentStatus,
    Goodbye,
    Heartbeat,
    Hello,
    LearnerMessage,
    LearnerStatus,
    ProtocolParams,
    Resync,
    StatusReply,
    SynchronizerMessage,
    Welcome,
)
from ddiloco.v1 import synchronizer_pb2 as pb

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
           "genesis_pending": pb.STATE_STATUS_GENESIS_PENDING, "reseed_wait": pb.STATE_STATUS_RESEED_WAIT}
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


def _tensor_to_pb(t: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=t.name, shape=list(t.shape), dtype=_DTYPES[t.dtype])


def _tensor_from_pb(t: pb.TensorSpec) -> TensorSpec:
    if t.dtype not in _DTYPES_BY_VALUE:
        raise HeaderError(f"tensor {t.name!r} has unknown dtype enum {t.dtype}")
    if any(s < 0 for s in t.shape):
        raise HeaderError(f"tensor {t.name!r} has a negative dimension")
    return TensorSpec(t.name, tuple(t.shape), _DTYPES_BY_VALUE[t.dtype])


def _layout_to_pb(layout: tuple[tuple[TensorSpec, ...], ...]) -> list[pb.FragmentTensors]:
    return [pb.FragmentTensors(tensors=[_tensor_to_pb(t) for t in frag]) for frag in layout]


def _layout_from_pb(items: Iterable[pb.FragmentTensors]) -> tuple[tuple[TensorSpec, ...], ...]:
    return tuple(tuple(_tensor_from_pb(t) for t in frag.tensors) for frag in items)


def header_to_pb(h: TransferHeader) -> pb.FragmentHeader:
    return pb.FragmentHeader(
        kind=_KINDS[h.kind], fragment_id=h.fragment_id, version=h.version, sequence=h.sequence,
        tokens=h.tokens, steps=h.steps, codec=codec_to_pb(h.codec), block_size=h.block_size,
        tensors=[_tensor_to_pb(t) for t in h.tensors],
        num_values=h.num_values, encoded_bytes=h.encoded_bytes, chunk_count=h.chunk_count, digest=h.digest,
        layout_hash=h.layout_hash, learner_step=h.learner_step, sent_at_unix=h.sent_at_unix, round=h.round,
        hand_over=h.hand_over,
    )


def header_from_pb(m: pb.FragmentHeader) -> TransferHeader:
    if m.kind not in _KINDS_BY_VALUE:
        raise HeaderError(f"unknown payload kind {m.kind}")
    tensors = [_tensor_from_pb(t) for t in m.tensors]
    return TransferHeader(
        kind=_KINDS_BY_VALUE[m.kind], fragment_id=m.fragment_id, version=m.version, sequence=m.sequence,
        tokens=m.tokens, steps=m.steps, codec=codec_from_pb(m.codec), block_size=m.block_size,
        tensors=tuple(tensors), num_values=m.num_values, encoded_bytes=m.encoded_bytes,
        chunk_count=m.chunk_count, digest=m.digest, layout_hash=m.layout_hash,
        learner_step=m.learner_step, sent_at_unix=m.sent_at_unix, round=m.round,
        hand_over=m.hand_over,
    )


@dataclass(frozen=True, slots=True)
class SplitChunk:
    """A FragmentChunk read off the wire with its data left where it arrived: ``rest`` holds every
    other field, ``data`` is a view of the received message (see ``stubs``)."""

    rest: pb.FragmentChunk
    data: memoryview
    frame: bytes | None = None
    """The received Sync-stream message, when it holds this chunk and nothing else."""


def chunk_to_pb(c: Chunk) -> pb.FragmentChunk:
    return _fill_chunk(pb.FragmentChunk(), c)


def _fill_chunk(msg: pb.FragmentChunk, c: Chunk) -> pb.FragmentChunk:
    """Write ``c`` into ``msg`` in place. Chunk messages are always built in place: passing a
    filled FragmentChunk to its parent's constructor copies it, and for a 4 MiB chunk that copy
    took 9 ms, about 60 times the cost of filling the field (see ``ddiloco bench wire``)."""
    msg.transfer_id, msg.index, msg.crc32c, msg.digest = c.transfer_id, c.index, c.crc32c, c.digest
    msg.data = c.data if isinstance(c.data, bytes) else bytes(c.data)
    if c.header is not None:
        msg.header.CopyFrom(header_to_pb(c.header))
    return msg


def chunk_from_pb(m: pb.FragmentChunk | SplitChunk) -> Chunk:
    frame = None
    if isinstance(m, SplitChunk):
        data: bytes | memoryview = m.data
        frame, m = m.frame, m.rest
    else:
        data = m.data
    header = header_from_pb(m.header) if m.HasField("header") else None
    if frame is None:
        return Chunk(m.transfer_id, m.index, data, m.crc32c, header, digest=m.digest)
    return Chunk(m.transfer_id, m.index, data, m.crc32c, header,
                 Frame(frame, (m.transfer_id, m.index, m.crc32c, header, data, m.digest)), m.digest)


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
            incarnation=msg.incarnation, labels=msg.labels, digest_only=msg.digest_only, fleet_id=msg.fleet_id,
            fleet_versions=_versions_to_pb(msg.fleet_versions), layout=_layout_to_pb(msg.layout)))
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
                     software_version=h.software_version, incarnation=h.incarnation, labels=dict(h.labels),
                     digest_only=h.digest_only, fleet_id=h.fleet_id,
                     fleet_versions=_versions_from_pb(h.fleet_versions), layout=_layout_from_pb(h.layout))
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
            shard_count=msg.shard_count, fleet_step=msg.fleet_step, digest_only=msg.digest_only,
            trailing_digest=msg.trailing_digest, fleet_id=msg.fleet_id, detail=msg.detail))
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
                       shard_index=w.shard_index, shard_count=w.shard_count or 1, fleet_step=w.fleet_step,
                       digest_only=w.digest_only, trailing_digest=w.trailing_digest, fleet_id=w.fleet_id,
                       detail=w.detail)
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
                                codec=codec_to_pb(r.codec) if r.codec else 0, digest_only=r.digest_only)


def fetch_request_from_pb(m: pb.FetchStateRequest) -> FetchStateRequest:
    return FetchStateRequest(learner_id=m.learner_id, fragment_ids=tuple(m.fragment_ids),
                             codec=_CODECS_BY_VALUE.get(m.codec, ""), digest_only=m.digest_only)


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
