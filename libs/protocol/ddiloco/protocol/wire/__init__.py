"""The Synchronizer service's messages and how they travel.

- ``messages``: the messages as plain dataclasses, what the rest of ddiloco works with;
- ``convert``: dataclasses <-> the generated protobuf messages of ``ddiloco.v1``;
- ``framing``: protobuf's encoding of length-delimited fields by hand, for chunk messages (no
  protobuf import);
- ``stubs``: the RPCs' serializers and deserializers (chunks by hand, with their data never
  copied by protobuf), the client stub and the servicer's registration.

Only ``convert`` and ``stubs`` import the generated code or protobuf (``lint-imports`` and a test
check it); everything is imported from here: ``from ddiloco.protocol.wire import Hello``.
"""

from ddiloco.protocol.wire.convert import (
    REJECT_REASONS,
    LearnerMessagePB,
    SplitChunk,
    SynchronizerMessagePB,
    chunk_from_pb,
    chunk_to_pb,
    codec_from_pb,
    codec_to_pb,
    fetch_request_from_pb,
    fetch_request_to_pb,
    header_from_pb,
    header_to_pb,
    learner_message_from_pb,
    learner_message_to_pb,
    protocol_from_pb,
    protocol_to_pb,
    status_from_pb,
    status_request_pb,
    status_to_pb,
    synchronizer_message_from_pb,
    synchronizer_message_to_pb,
)
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
from ddiloco.protocol.wire.stubs import (
    SERVICE_NAME,
    MalformedMessage,
    SynchronizerServicer,
    SynchronizerStub,
    add_synchronizer_servicer,
    frame_chunks,
    parse_fragment_chunk,
    parse_learner_message,
    parse_synchronizer_message,
    serialize_fragment_chunk,
    serialize_learner_message,
    serialize_synchronizer_message,
)

__all__ = [
    "REJECT_REASONS", "SERVICE_NAME", "ContributionResult", "Drain", "FetchStateRequest", "FragmentRequest",
    "FragmentStatus", "Goodbye", "Heartbeat", "Hello", "LearnerMessage", "LearnerMessagePB", "LearnerStatus",
    "MalformedMessage", "ProtocolParams", "Resync", "SplitChunk", "StatusReply", "SynchronizerMessage",
    "SynchronizerMessagePB", "SynchronizerServicer", "SynchronizerStub", "Welcome", "add_synchronizer_servicer",
    "chunk_from_pb", "chunk_to_pb", "codec_from_pb", "codec_to_pb", "fetch_request_from_pb",
    "fetch_request_to_pb", "frame_chunks", "header_from_pb", "header_to_pb", "learner_message_from_pb",
    "learner_message_to_pb", "parse_fragment_chunk", "parse_learner_message", "parse_synchronizer_message",
    "protocol_from_pb", "protocol_to_pb", "serialize_fragment_chunk", "serialize_learner_message",
    "serialize_synchronizer_message", "status_from_pb", "status_request_pb", "status_to_pb",
    "synchronizer_message_from_pb", "synchronizer_message_to_pb",
]
