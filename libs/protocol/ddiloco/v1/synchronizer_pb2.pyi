from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_BF16_ZSTD: _ClassVar[Codec]
    CODEC_INT8_BLOCK: _ClassVar[Codec]
    CODEC_INT4_BLOCK: _ClassVar[Codec]
    CODEC_INT2_BLOCK: _ClassVar[Codec]

class PayloadKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_KIND_UNSPECIFIED: _ClassVar[PayloadKind]
    PAYLOAD_KIND_CONTRIBUTION: _ClassVar[PayloadKind]
    PAYLOAD_KIND_GENESIS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_GLOBAL: _ClassVar[PayloadKind]

class StateStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_STATUS_UNSPECIFIED: _ClassVar[StateStatus]
    STATE_STATUS_READY: _ClassVar[StateStatus]
    STATE_STATUS_GENESIS_REQUESTED: _ClassVar[StateStatus]
    STATE_STATUS_GENESIS_PENDING: _ClassVar[StateStatus]
    STATE_STATUS_RESEED_WAIT: _ClassVar[StateStatus]

class RejectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_REASON_UNSPECIFIED: _ClassVar[RejectReason]
    REJECT_REASON_STALE: _ClassVar[RejectReason]
    REJECT_REASON_BAD_SHAPE: _ClassVar[RejectReason]
    REJECT_REASON_BAD_DTYPE: _ClassVar[RejectReason]
    REJECT_REASON_UNKNOWN_FRAGMENT: _ClassVar[RejectReason]
    REJECT_REASON_NON_FINITE: _ClassVar[RejectReason]
    REJECT_REASON_CHECKSUM: _ClassVar[RejectReason]
    REJECT_REASON_OVERSIZED: _ClassVar[RejectReason]
    REJECT_REASON_PROTOCOL: _ClassVar[RejectReason]
    REJECT_REASON_LAYOUT_MISMATCH: _ClassVar[RejectReason]
    REJECT_REASON_MODEL_MISMATCH: _ClassVar[RejectReason]
    REJECT_REASON_UNAUTHENTICATED: _ClassVar[RejectReason]
    REJECT_REASON_NOT_READY: _ClassVar[RejectReason]
    REJECT_REASON_UNSUPPORTED_CODEC: _ClassVar[RejectReason]
    REJECT_REASON_FUTURE_VERSION: _ClassVar[RejectReason]
    REJECT_REASON_TIMEOUT: _ClassVar[RejectReason]
    REJECT_REASON_NORM_OUTLIER: _ClassVar[RejectReason]
    REJECT_REASON_WEIGHT_OUTLIER: _ClassVar[RejectReason]
    REJECT_REASON_CLAIM_OUTLIER: _ClassVar[RejectReason]
    REJECT_REASON_FLEET_MISMATCH: _ClassVar[RejectReason]

class ContributionOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTRIBUTION_OUTCOME_UNSPECIFIED: _ClassVar[ContributionOutcome]
    CONTRIBUTION_OUTCOME_MERGED: _ClassVar[ContributionOutcome]
    CONTRIBUTION_OUTCOME_REJECTED: _ClassVar[ContributionOutcome]
    CONTRIBUTION_OUTCOME_SUPERSEDED: _ClassVar[ContributionOutcome]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT64: DType
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_BF16_ZSTD: Codec
CODEC_INT8_BLOCK: Codec
CODEC_INT4_BLOCK: Codec
CODEC_INT2_BLOCK: Codec
PAYLOAD_KIND_UNSPECIFIED: PayloadKind
PAYLOAD_KIND_CONTRIBUTION: PayloadKind
PAYLOAD_KIND_GENESIS: PayloadKind
PAYLOAD_KIND_GLOBAL: PayloadKind
STATE_STATUS_UNSPECIFIED: StateStatus
STATE_STATUS_READY: StateStatus
STATE_STATUS_GENESIS_REQUESTED: StateStatus
STATE_STATUS_GENESIS_PENDING: StateStatus
STATE_STATUS_RESEED_WAIT: StateStatus
REJECT_REASON_UNSPECIFIED: RejectReason
REJECT_REASON_STALE: RejectReason
REJECT_REASON_BAD_SHAPE: RejectReason
REJECT_REASON_BAD_DTYPE: RejectReason
REJECT_REASON_UNKNOWN_FRAGMENT: RejectReason
REJECT_REASON_NON_FINITE: RejectReason
REJECT_REASON_CHECKSUM: RejectReason
REJECT_REASON_OVERSIZED: RejectReason
REJECT_REASON_PROTOCOL: RejectReason
REJECT_REASON_LAYOUT_MISMATCH: RejectReason
REJECT_REASON_MODEL_MISMATCH: RejectReason
REJECT_REASON_UNAUTHENTICATED: RejectReason
REJECT_REASON_NOT_READY: RejectReason
REJECT_REASON_UNSUPPORTED_CODEC: RejectReason
REJECT_REASON_FUTURE_VERSION: RejectReason
REJECT_REASON_TIMEOUT: RejectReason
REJECT_REASON_NORM_OUTLIER: RejectReason
REJECT_REASON_WEIGHT_OUTLIER: RejectReason
REJECT_REASON_CLAIM_OUTLIER: RejectReason
REJECT_REASON_FLEET_MISMATCH: RejectReason
CONTRIBUTION_OUTCOME_UNSPECIFIED: ContributionOutcome
CONTRIBUTION_OUTCOME_MERGED: ContributionOutcome
CONTRIBUTION_OUTCOME_REJECTED: ContributionOutcome
CONTRIBUTION_OUTCOME_SUPERSEDED: ContributionOutcome

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class FragmentHeader(_message.Message):
    __slots__ = ("kind", "fragment_id", "version", "sequence", "tokens", "steps", "codec", "block_size", "tensors", "num_values", "encoded_bytes", "chunk_count", "digest", "layout_hash", "learner_step", "sent_at_unix", "round", "hand_over")
    KIND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_VALUES_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    LEARNER_STEP_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HAND_OVER_FIELD_NUMBER: _ClassVar[int]
    kind: PayloadKind
    fragment_id: int
    version: int
    sequence: int
    tokens: int
    steps: int
    codec: Codec
    block_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    num_values: int
    encoded_bytes: int
    chunk_count: int
    digest: bytes
    layout_hash: str
    learner_step: int
    sent_at_unix: float
    round: int
    hand_over: bool
    def __init__(self, kind: _Optional[_Union[PayloadKind, str]] = ..., fragment_id: _Optional[int] = ..., version: _Optional[int] = ..., sequence: _Optional[int] = ..., tokens: _Optional[int] = ..., steps: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., block_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., num_values: _Optional[int] = ..., encoded_bytes: _Optional[int] = ..., chunk_count: _Optional[int] = ..., digest: _Optional[bytes] = ..., layout_hash: _Optional[str] = ..., learner_step: _Optional[int] = ..., sent_at_unix: _Optional[float] = ..., round: _Optional[int] = ..., hand_over: _Optional[bool] = ...) -> None: ...

class FragmentChunk(_message.Message):
    __slots__ = ("transfer_id", "index", "header", "data", "crc32c", "digest")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    index: int
    header: FragmentHeader
    data: bytes
    crc32c: int
    digest: bytes
    def __init__(self, transfer_id: _Optional[int] = ..., index: _Optional[int] = ..., header: _Optional[_Union[FragmentHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class ProtocolParams(_message.Message):
    __slots__ = ("num_fragments", "sync_every", "overlap", "max_chunk_bytes", "mode", "global_codec")
    NUM_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_CODEC_FIELD_NUMBER: _ClassVar[int]
    num_fragments: int
    sync_every: int
    overlap: int
    max_chunk_bytes: int
    mode: str
    global_codec: Codec
    def __init__(self, num_fragments: _Optional[int] = ..., sync_every: _Optional[int] = ..., overlap: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., mode: _Optional[str] = ..., global_codec: _Optional[_Union[Codec, str]] = ...) -> None: ...

class FragmentVersion(_message.Message):
    __slots__ = ("fragment_id", "version")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    version: int
    def __init__(self, fragment_id: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class FragmentTensors(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("learner_id", "model_fingerprint", "layout_hash", "codecs", "protocol", "held", "software_version", "incarnation", "labels", "digest_only", "fleet_id", "fleet_versions", "layout")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ONLY_FIELD_NUMBER: _ClassVar[int]
    FLEET_ID_FIELD_NUMBER: _ClassVar[int]
    FLEET_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    model_fingerprint: str
    layout_hash: str
    codecs: _containers.RepeatedScalarFieldContainer[Codec]
    protocol: ProtocolParams
    held: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    software_version: str
    incarnation: int
    labels: _containers.ScalarMap[str, str]
    digest_only: bool
    fleet_id: str
    fleet_versions: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    layout: _containers.RepeatedCompositeFieldContainer[FragmentTensors]
    def __init__(self, learner_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., layout_hash: _Optional[str] = ..., codecs: _Optional[_Iterable[_Union[Codec, str]]] = ..., protocol: _Optional[_Union[ProtocolParams, _Mapping]] = ..., held: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ..., software_version: _Optional[str] = ..., incarnation: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., digest_only: _Optional[bool] = ..., fleet_id: _Optional[str] = ..., fleet_versions: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ..., layout: _Optional[_Iterable[_Union[FragmentTensors, _Mapping]]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("step", "tokens_total", "tokens_per_s", "step_time_s", "sent_at_unix", "training_done")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    TRAINING_DONE_FIELD_NUMBER: _ClassVar[int]
    step: int
    tokens_total: int
    tokens_per_s: float
    step_time_s: float
    sent_at_unix: float
    training_done: bool
    def __init__(self, step: _Optional[int] = ..., tokens_total: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., sent_at_unix: _Optional[float] = ..., training_done: _Optional[bool] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class LearnerMessage(_message.Message):
    __slots__ = ("hello", "chunk", "heartbeat", "goodbye")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    chunk: FragmentChunk
    heartbeat: Heartbeat
    goodbye: Goodbye
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., chunk: _Optional[_Union[FragmentChunk, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("synchronizer_id", "protocol", "versions", "state", "heartbeat_interval_s", "shard_index", "shard_count", "fleet_step", "digest_only", "trailing_digest", "fleet_id", "detail")
    SYNCHRONIZER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    FLEET_STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ONLY_FIELD_NUMBER: _ClassVar[int]
    TRAILING_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FLEET_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    synchronizer_id: str
    protocol: ProtocolParams
    versions: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    state: StateStatus
    heartbeat_interval_s: float
    shard_index: int
    shard_count: int
    fleet_step: int
    digest_only: bool
    trailing_digest: bool
    fleet_id: str
    detail: str
    def __init__(self, synchronizer_id: _Optional[str] = ..., protocol: _Optional[_Union[ProtocolParams, _Mapping]] = ..., versions: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ..., state: _Optional[_Union[StateStatus, str]] = ..., heartbeat_interval_s: _Optional[float] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., fleet_step: _Optional[int] = ..., digest_only: _Optional[bool] = ..., trailing_digest: _Optional[bool] = ..., fleet_id: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ContributionResult(_message.Message):
    __slots__ = ("sequence", "fragment_id", "outcome", "version", "reason", "detail", "weight", "staleness")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    fragment_id: int
    outcome: ContributionOutcome
    version: int
    reason: RejectReason
    detail: str
    weight: float
    staleness: int
    def __init__(self, sequence: _Optional[int] = ..., fragment_id: _Optional[int] = ..., outcome: _Optional[_Union[ContributionOutcome, str]] = ..., version: _Optional[int] = ..., reason: _Optional[_Union[RejectReason, str]] = ..., detail: _Optional[str] = ..., weight: _Optional[float] = ..., staleness: _Optional[int] = ...) -> None: ...

class Resync(_message.Message):
    __slots__ = ("fragment_ids", "reason", "detail")
    FRAGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    fragment_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: RejectReason
    detail: str
    def __init__(self, fragment_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[_Union[RejectReason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class FragmentRequest(_message.Message):
    __slots__ = ("fragment_id", "round", "version")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    round: int
    version: int
    def __init__(self, fragment_id: _Optional[int] = ..., round: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("reason", "deadline_s")
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    reason: str
    deadline_s: float
    def __init__(self, reason: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class SynchronizerMessage(_message.Message):
    __slots__ = ("welcome", "chunk", "result", "resync", "drain", "request")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    chunk: FragmentChunk
    result: ContributionResult
    resync: Resync
    drain: Drain
    request: FragmentRequest
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., chunk: _Optional[_Union[FragmentChunk, _Mapping]] = ..., result: _Optional[_Union[ContributionResult, _Mapping]] = ..., resync: _Optional[_Union[Resync, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., request: _Optional[_Union[FragmentRequest, _Mapping]] = ...) -> None: ...

class FetchStateRequest(_message.Message):
    __slots__ = ("learner_id", "fragment_ids", "codec", "digest_only")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ONLY_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragment_ids: _containers.RepeatedScalarFieldContainer[int]
    codec: Codec
    digest_only: bool
    def __init__(self, learner_id: _Optional[str] = ..., fragment_ids: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[Codec, str]] = ..., digest_only: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("learner_id", "connected", "live", "last_seen_s", "step", "tokens_per_s", "merged", "rejected", "superseded", "tokens_merged", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MERGED_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    connected: bool
    live: bool
    last_seen_s: float
    step: int
    tokens_per_s: float
    merged: int
    rejected: int
    superseded: int
    tokens_merged: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, learner_id: _Optional[str] = ..., connected: _Optional[bool] = ..., live: _Optional[bool] = ..., last_seen_s: _Optional[float] = ..., step: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., merged: _Optional[int] = ..., rejected: _Optional[int] = ..., superseded: _Optional[int] = ..., tokens_merged: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class FragmentStatus(_message.Message):
    __slots__ = ("fragment_id", "version", "last_quorum_size", "last_merge_unix", "pending", "last_grace_s", "num_values", "round")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_QUORUM_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_MERGE_UNIX_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    LAST_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_VALUES_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    version: int
    last_quorum_size: int
    last_merge_unix: float
    pending: int
    last_grace_s: float
    num_values: int
    round: int
    def __init__(self, fragment_id: _Optional[int] = ..., version: _Optional[int] = ..., last_quorum_size: _Optional[int] = ..., last_merge_unix: _Optional[float] = ..., pending: _Optional[int] = ..., last_grace_s: _Optional[float] = ..., num_values: _Optional[int] = ..., round: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("synchronizer_id", "mode", "uptime_s", "state", "learners", "fragments", "merges_total", "rejected_by_reason", "token_goodput", "protocol", "quorum", "fleet_step")
    class RejectedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SYNCHRONIZER_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    MERGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_GOODPUT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    FLEET_STEP_FIELD_NUMBER: _ClassVar[int]
    synchronizer_id: str
    mode: str
    uptime_s: float
    state: StateStatus
    learners: _containers.RepeatedCompositeFieldContainer[LearnerStatus]
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    merges_total: int
    rejected_by_reason: _containers.ScalarMap[str, int]
    token_goodput: float
    protocol: ProtocolParams
    quorum: int
    fleet_step: float
    def __init__(self, synchronizer_id: _Optional[str] = ..., mode: _Optional[str] = ..., uptime_s: _Optional[float] = ..., state: _Optional[_Union[StateStatus, str]] = ..., learners: _Optional[_Iterable[_Union[LearnerStatus, _Mapping]]] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ..., merges_total: _Optional[int] = ..., rejected_by_reason: _Optional[_Mapping[str, int]] = ..., token_goodput: _Optional[float] = ..., protocol: _Optional[_Union[ProtocolParams, _Mapping]] = ..., quorum: _Optional[int] = ..., fleet_step: _Optional[float] = ...) -> None: ...
