"""The synchronizer's configuration: one strict config dataclass, validated on construction.

Loaded from the ``synchronizer`` and ``protocol`` sections of a config document after the mode
preset is applied (``ddiloco.core.modes``); a config that contradicts its mode (a streaming
synchronizer with quorum 1) is refused. Measurements behind the defaults are in
docs/design-notes.md.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, Literal

from pydantic.dataclasses import dataclass

from ddiloco.algorithm.claim_guard import ClaimGuardPolicy
from ddiloco.algorithm.norm_guard import NormGuardPolicy
from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.algorithm.weight_guard import WeightGuardPolicy
from ddiloco.core.config import STRICT, ConfigError, build, check_sections
from ddiloco.core.modes import apply_mode, preset
from ddiloco.protocol.client import message_limit
from ddiloco.protocol.config import ProtocolConfig
from ddiloco.protocol.shards import owner


@dataclass(frozen=True, kw_only=True, config=STRICT)
class Limits:
    """Bounds on what connections and learners may cost the synchronizer. Each refusal is counted
    in ``ddiloco_sync_limit_refusals_total{limit=...}`` and answered with a gRPC status."""

    max_streams: int = 1024
    """Sync streams open at once; beyond it a new stream is refused (RESOURCE_EXHAUSTED)."""
    max_streams_per_connection: int = 16
    """Concurrent HTTP/2 streams per connection (further calls queue on the client)."""
    max_transfer_bytes: int = 4 * 1024 * 1024 * 1024
    """Largest transfer (one fragment) a stream may send before the global layout is known (the
    genesis upload is fp32: 4 GiB fits a fragment of 1G parameters); once it is known, the bound is
    the largest fragment in fp32 plus 1 MiB, if that is smaller (RESOURCE_EXHAUSTED)."""
    hello_rate_per_s: float = 2.0
    """Sync streams a single peer address may open per second, sustained (RESOURCE_EXHAUSTED)."""
    hello_burst: int = 64
    """... and in a burst (a node of learners reconnecting at once after a synchronizer restart)."""
    hello_timeout_s: float = 30.0
    """A Sync stream must send its Hello within this long."""
    idle_stream_timeout_s: float = 120.0
    """A Sync stream that sends nothing (not even a heartbeat) for this long is closed."""
    transfer_timeout_s: float = 600.0
    """A transfer must be complete this long after its first chunk (a deliberately slow stream
    cannot hold a reassembly buffer forever)."""
    handshake_timeout_s: float = 10.0
    """A connection must finish its TLS and HTTP/2 handshake within this long."""

    def __post_init__(self) -> None:
        for name in ("max_streams", "max_streams_per_connection", "max_transfer_bytes", "hello_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"limits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("hello_rate_per_s", "hello_timeout_s", "idle_stream_timeout_s", "transfer_timeout_s",
                     "handshake_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"limits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True, config=STRICT)
class SynchronizerConfig:
    """Everything the synchronizer service needs."""

    listen: str = "127.0.0.1:7000"
    """HOST:PORT to serve gRPC on (port 0 picks a free port)."""
    state_dir: str = "./synchronizer-state"
    """Folder for durable state: meta.json and every fragment's committed versions."""
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    """Constants shared with the learners (mode, P, H, tau, chunk size, global codec)."""
    policy: QuorumPolicy = field(default_factory=QuorumPolicy)
    """Quorum K, grace gamma and max grace, streaming timeout."""
    merge_method: Literal["rda", "mean"] = "rda"
    """Per-tensor merge: "rda" (radial-directional averaging) or "mean" (weighted mean)."""
    embedding_patterns: tuple[str, ...] = ("*embed*", "*wte*", "*wpe*", "*tok_emb*", "*pos_emb*")
    """fnmatch patterns of tensors always merged with the weighted mean (embeddings)."""
    outer_lr: float = 0.7
    """Outer Nesterov SGD learning rate."""
    outer_momentum: float = 0.5
    """Outer Nesterov momentum (0 gives plain SGD). DiLoCo's 0.9 assumes thousands of outer steps;
    with a few dozen per fragment (the default run's budget) high momentum overshoots. Long runs
    may want more: ``ddiloco study quality`` sweeps it for a budget (docs/quality.md)."""
    outer_momentum_warmup: int = 8
    """Outer steps of each fragment over which the outer momentum ramps linearly up to
    ``outer_momentum`` (0: none). The first outer gradients are the largest and least aligned
    with the later ones; a momentum that carries them at full strength overshoots. With the
    longer inner warm-up it gains 1.7-2.0% at the default budget (docs/quality.md)."""
    hand_over_momentum: bool = False
    """Whether a round made only of hand-overs (each learner's last progress on a fragment, sent
    as it finishes or drains) takes the outer momentum. A hand-over carries less than a sync
    period of progress, usually a fraction of one, while the momentum carries whole periods: at
    the end of a run it moves the final model past where the learners went. Off (the default),
    such a round's outer step is plain SGD at the outer learning rate and the momentum is left
    as it was (docs/quality.md, "The last step")."""
    staleness_window: int = 4
    """Versions behind the current one a contribution may be and still be re-anchored."""
    stale_anchor: Literal["point", "delta"] = "point"
    """How a contribution computed against an older version joins a merge. "point": re-anchored to
    the learner's model, Delta + Theta_now - Theta_base (needs the base version retained), so it
    pulls the global toward where that learner actually is. "delta": its Delta is applied at the
    current version as is (a delayed outer gradient, as in asynchronous Local-SGD)."""
    scale_by_participation: bool = False
    """Scale a merge's outer gradient by min(1, contributing learners / live learners): a merge
    that only some learners made is that share of an outer step."""
    rejoin_window_s: float = 8.0
    """After a restart on existing state, merges wait up to this long for the learners of the last
    committed merges to reconnect and contribute (each fragment merges as soon as all of them
    have), so the first learner back is not merged alone as a whole outer step. It bounds
    restart-to-first-merge; 0 disables it."""
    start_learners: int = 0
    """A new fleet's merges wait until this many learners are live at once (0: no wait), at most
    ``start_window_s`` from the first merge held. The synchronous modes need the fleet assembled
    before their first round: ``ddiloco run`` sets it to its learner count for them. Not applied
    after a restart on existing state (``rejoin_window_s`` does that)."""
    start_window_s: float = 60.0
    """Longest wait of the start hold, seconds."""
    reseed: bool = False
    """An operator's explicit re-seed of a synchronizer (shard) that lost its state. Without state,
    once the learners' Hellos show that the fleet has merged versions, only a learner holding this
    synchronizer's fragments of that fleet may seed it (``genesis``), and any other is told to wait.
    True: the next learner to say Hello seeds it whatever it holds (logged as the operator's
    re-seed): for a fleet whose learners that held those fragments are all gone. Its fragments
    then start over at version 0 from that learner's values (unless it holds them: then they go
    on from its versions). No effect on a state dir that holds state. Flag ``--reseed``."""
    heartbeat_interval_s: float = 1.0
    """How often learners are asked to heartbeat."""
    heartbeat_timeout_s: float = 10.0
    """A connected learner silent for this long stops counting for quorums."""
    send_queue_messages: int = 4096
    """Bound of each learner's queue of control messages (results, resync); the oldest results
    are dropped beyond it. Global fragments are never queued twice: a slow learner only gets the
    newest version of each fragment."""
    merge_threads: int = 2
    """Threads for merge math, codec and commits (torch and zstd release the GIL)."""
    codec_threads: int = 2
    """Threads inside the bf16/zstd codec."""
    max_learners: int = 4096
    """Learner ids tracked at most; beyond it new ids are refused."""
    shard_index: int = 0
    """This shard's index s (it owns fragments p with p mod shard_count == s: ``ddiloco.protocol.shards``)."""
    shard_count: int = 1
    """Number of synchronizer shards."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (None: off; 0: a free port)."""
    metrics_host: str | None = None
    """Address the metrics endpoint binds (None: the host of ``listen``, so a synchronizer serving
    on loopback does not publish its metrics to the network)."""
    event_log: str | None = None
    """Append one JSON line per event to this file: each start, merge and rejected contribution."""
    keepalive_time_s: float = 20.0
    """gRPC keepalive ping interval."""
    keepalive_timeout_s: float = 10.0
    """gRPC keepalive ping timeout."""
    shutdown_grace_s: float = 5.0
    """Seconds in-flight RPCs get on SIGTERM after the commit in progress finishes."""
    auth_tokens: dict[str, str] = field(default_factory=dict)
    """identity -> bearer token, written inline (tests and local runs; deployments use
    auth_tokens_file, so no token sits in a config map). Empty, with no auth_tokens_file:
    no token authentication."""
    auth_tokens_file: str | None = None
    """YAML/JSON file mapping identity -> bearer token (a mounted Secret). Read at start and again
    whenever it changes, so tokens rotate without a restart."""
    identity_binding: Literal["exact", "prefix"] = "exact"
    """How a credential's identity (the id its token is listed under, or its client certificate's
    common name) binds the learner id of a Sync stream: exact, equal; prefix, equal or
    ``<identity>-...`` (one credential per Deployment whose pods are named after it)."""
    operators: tuple[str, ...] = ()
    """Identities that may call GetStatus (and may not Sync). Empty: any authenticated caller may."""
    limits: Limits = field(default_factory=Limits)
    """Connection, stream and transfer bounds."""
    norm_guard: NormGuardPolicy = field(default_factory=NormGuardPolicy)
    """Refuse or clip a contribution whose norm is an outlier against the fragment's recent ones."""
    weight_guard: WeightGuardPolicy = field(default_factory=WeightGuardPolicy)
    """Refuse an answer that claims more tokens per step than the fleet's recent answers allow."""
    claim_guard: ClaimGuardPolicy = field(default_factory=ClaimGuardPolicy)
    """Bound the inner steps an answer claims by the learner's pace and the time its counters cover,
    from its previous answer of the fragment (merged as the bound, or refused)."""
    tls_cert: str | None = None
    """PEM server certificate (with tls_key): serve TLS."""
    tls_key: str | None = None
    """PEM server private key."""
    tls_client_ca: str | None = None
    """PEM CA bundle: require and verify client certificates (mutual TLS)."""

    def __post_init__(self) -> None:
        if self.start_learners < 0:
            raise ValueError(f"start_learners must be >= 0, got {self.start_learners}")
        if not self.start_window_s > 0:
            raise ValueError(f"start_window_s must be > 0, got {self.start_window_s}")
        if self.rejoin_window_s < 0:
            raise ValueError(f"rejoin_window_s must be >= 0, got {self.rejoin_window_s}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError("outer_lr must be > 0 and outer_momentum in [0, 1)")
        if self.staleness_window < 0:
            raise ValueError("staleness_window must be >= 0")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(f"shard_index must be in 0..shard_count-1, got {self.shard_index}/{self.shard_count}")
        if self.shard_count > self.protocol.num_fragments:
            raise ValueError(f"{self.shard_count} shards for {self.protocol.num_fragments} fragments: a shard would "
                             "own none (use at most protocol.num_fragments shards)")
        if self.send_queue_messages < 16 or self.merge_threads < 1 or self.codec_threads < 1:
            raise ValueError("send_queue_messages >= 16, merge_threads >= 1 and codec_threads >= 1 required")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if ":" not in self.listen:
            raise ValueError(f"listen must be HOST:PORT, got {self.listen!r}")
        if self.auth_tokens:
            check_tokens(self.auth_tokens, "auth_tokens")
        if self.operators and not (self.auth_tokens or self.auth_tokens_file or self.tls_client_ca):
            raise ValueError("operators need credentials to tell them apart: auth_tokens, auth_tokens_file "
                             "or tls_client_ca")
        if self.max_learners < 1:
            raise ValueError(f"max_learners must be >= 1, got {self.max_learners}")
        p = preset(self.protocol.mode)
        if p.quorum is not None and self.policy.quorum != p.quorum:
            raise ValueError(f"{self.protocol.mode} mode merges with quorum {p.quorum} (every live learner), "
                             f"got policy.quorum {self.policy.quorum}")
        if p.timeout_s is not None and self.policy.timeout_s is None:
            raise ValueError(f"{self.protocol.mode} mode needs policy.timeout_s, so one dead learner cannot "
                             "stall a round that waits for every live learner")

    def owns(self, fragment: int) -> bool:
        return owner(fragment, self.shard_count) == self.shard_index

    @property
    def max_message_bytes(self) -> int:
        """gRPC message limit: one chunk plus generous room for its header."""
        return message_limit(self.protocol.max_chunk_bytes)


def check_tokens(tokens: dict[str, str], source: str) -> None:
    """Refuse token tables that cannot authenticate anyone unambiguously."""
    seen: dict[str, str] = {}
    for identity, token in tokens.items():
        if not identity or not token:
            raise ValueError(f"{source}: identities and tokens must be non-empty")
        if len(token) < 16:
            raise ValueError(f"{source}: the token of {identity!r} has {len(token)} characters; "
                             "use at least 16 (e.g. `openssl rand -hex 24`)")
        if token in seen:
            raise ValueError(f"{source}: {seen[token]!r} and {identity!r} share a token, so it cannot tell "
                             "them apart")
        seen[token] = identity


def synchronizer_config(document: dict[str, Any], mode: str | None = None, **overrides: Any) -> SynchronizerConfig:
    """The synchronizer's config from a config document (its ``synchronizer`` and ``protocol``
    sections, with the mode preset applied; ``mode`` overrides the document's), plus non-None
    ``overrides`` of top-level fields (command-line flags)."""
    check_sections(document)
    doc = apply_mode(document, mode)
    section = doc.get("synchronizer")
    if not isinstance(section, dict):
        raise ConfigError(f"config section synchronizer must be a mapping, got {type(section).__name__}")
    section = {**section, "protocol": doc["protocol"]}
    section.update({k: v for k, v in overrides.items() if v is not None})
    return build(SynchronizerConfig, section, "synchronizer")
