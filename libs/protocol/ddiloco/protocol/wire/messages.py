"""The messages of the Synchronizer service as plain dataclasses.

Everything in ddiloco that sends or reads a message works with these (and with ``Chunk`` and
``TransferHeader`` from ``ddiloco.fragments.chunking``); ``convert`` turns them into the generated
protobuf messages and back. Enum values are their short lower-case names ("bf16_zstd", "stale",
"merged"). Nothing here imports protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ddiloco.fragments.chunking import Chunk
from ddiloco.fragments.partition import TensorSpec

if TYPE_CHECKING:
    from ddiloco.protocol.config import ProtocolConfig


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
    digest_only: bool = True
    """The learner checks received transfers by their payload digest alone (chunks to it need no
    CRC-32C); False is what an older learner's Hello reads as."""
    fleet_id: str = ""
    """The fleet the learner's model belongs to (the fleet id of the shards it joined, or the one
    the lowest shard proposed before any holds state); "" when it knows none (an older learner's
    Hello reads so)."""
    fleet_versions: dict[int, int] = field(default_factory=dict)
    """The newest version of every fragment of the fleet (every shard's) the learner holds or was
    told of by a shard's Welcome: how a synchronizer without state learns that the fleet merged."""
    layout: tuple[tuple[TensorSpec, ...], ...] = ()
    """The whole fragment layout (each fragment's tensors), sent to a sharded synchronizer so a
    shard can check a genesis against ``layout_hash``; () when not sent."""


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
    digest_only: bool = True
    """The synchronizer checks received transfers by their payload digest alone (see Hello)."""
    trailing_digest: bool = True
    """The synchronizer reads a transfer's digest from its last chunk when the header leaves it
    empty, so a learner may hash each chunk of a contribution as it writes it; False is what an
    older synchronizer's Welcome reads as (every header carries the digest)."""
    fleet_id: str = ""
    """The fleet of the synchronizer's state (without state: the id its genesis will be recorded
    under); "" from an older synchronizer."""
    detail: str = ""
    """Why ``state`` is what it is, for humans (``reseed_wait``: what it waits for)."""


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
    digest_only: bool = True
    """The requester checks the transfers by their payload digest alone (see Hello)."""


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
