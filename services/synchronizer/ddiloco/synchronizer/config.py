"""The synchronizer's configuration: one frozen dataclass, validated on construction.

Mode presets (``decoupled``, ``streaming``, ``diloco``) set the quorum policy; explicit values in
the config file win over a preset's defaults only where the preset leaves them open (the quorum
of streaming and diloco is always "all live learners").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.core.config import ProtocolConfig
from ddiloco.protocol.client import message_limit


@dataclass(frozen=True, kw_only=True)
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
    merge_method: str = "rda"
    """Per-tensor merge: "rda" (radial-directional averaging) or "mean" (weighted mean)."""
    embedding_patterns: tuple[str, ...] = ("*embed*", "*wte*", "*wpe*", "*tok_emb*", "*pos_emb*")
    """fnmatch patterns of tensors always merged with the weighted mean (embeddings)."""
    outer_lr: float = 0.7
    """Outer Nesterov SGD learning rate."""
    outer_momentum: float = 0.5
    """Outer Nesterov momentum (0 gives plain SGD). DiLoCo uses 0.9 over thousands of outer steps;
    the default run takes 25 per fragment (600 steps, H = 24) and there high momentum overshoots.
    ``ddiloco bench quality`` (synchronous, 3 learners, 600 steps, outer lr 0.7; dp 1.655):
    momentum 0.9 1.910, 0.8 1.830, 0.7 1.794, 0.6 1.781, **0.5 1.776**, 0.4 1.785; outer lr 0.9 is
    worse at any momentum tried (0.7: 1.894, 0.5: 1.848), outer lr 0.5 with 0.7 gives 1.779. Long
    runs may want more (docs/results/quality.json has the sweep; rerun it for a new budget)."""
    staleness_window: int = 4
    """Versions behind the current one a contribution may be and still be re-anchored."""
    stale_anchor: str = "point"
    """How a contribution computed against an older version joins a merge. "point" (default): it
    is re-anchored to the learner's model, Delta + Theta_now - Theta_base (needs the base version
    retained), so it pulls the global toward where that learner actually is. "delta": its Delta is
    applied at the current version as is (a delayed outer gradient, as in asynchronous
    Local-SGD). Measured in the single-process reference (3 learners, one always a round late, momentum
    0.9, mean merge): point 1.901, delta 2.099, nobody late 1.949; delta with small merges and Nesterov momentum
    also diverged in the chaos tests. See docs/design-notes.md."""
    scale_by_participation: bool = False
    """Scale a merge's outer gradient by min(1, contributing learners / live learners): a merge that
    only some learners made is that share of an outer step, so a fleet whose contributions trickle
    in as many small merges takes about one full step per period instead of one per merge. Off by
    default: the 3-learner default run with it and delta anchoring ended at 2.19, with neither at
    2.04 (two changes at once, not separated). It is what keeps "delta" anchoring from diverging
    when quorum 1 merges learners one by one."""
    rejoin_window_s: float = 8.0
    """After a restart on existing state, merges wait up to this long for the learners of the last
    committed merges to reconnect and contribute (each fragment merges as soon as all of them
    have). Without it the first learner back was merged alone into every fragment, a whole outer
    step from one learner, and the rest arrived stale: eval loss +17% after two restarts in a
    default chaos run. It bounds restart-to-first-merge; 0 disables it."""
    stale_round_s: float = 30.0
    """Stale contributions alone open a round after waiting this long (normally they join the
    next round that a fresh contribution opens); once every live learner has one waiting, after
    one period (H steps at the fleet's step time) if that is shorter."""
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
    """This shard's index s (it owns fragments p with p mod shard_count == s)."""
    shard_count: int = 1
    """Number of synchronizer shards."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (None: off; 0: a free port)."""
    merge_log: str | None = None
    """Append one JSON line per merge (and one per start) to this file."""
    keepalive_time_s: float = 20.0
    """gRPC keepalive ping interval."""
    keepalive_timeout_s: float = 10.0
    """gRPC keepalive ping timeout."""
    shutdown_grace_s: float = 5.0
    """Seconds in-flight RPCs get on SIGTERM after the commit in progress finishes."""
    auth_tokens: dict[str, str] = field(default_factory=dict)
    """learner id -> bearer token. Empty: no authentication (local runs only)."""
    tls_cert: str | None = None
    """PEM server certificate (with tls_key): serve TLS."""
    tls_key: str | None = None
    """PEM server private key."""
    tls_client_ca: str | None = None
    """PEM CA bundle: require and verify client certificates (mutual TLS)."""

    def __post_init__(self) -> None:
        if self.rejoin_window_s < 0:
            raise ValueError(f"rejoin_window_s must be >= 0, got {self.rejoin_window_s}")
        if self.stale_anchor not in ("delta", "point"):
            raise ValueError(f"stale_anchor must be 'delta' or 'point', got {self.stale_anchor!r}")
        if self.merge_method not in ("rda", "mean"):
            raise ValueError(f"merge_method must be 'rda' or 'mean', got {self.merge_method!r}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError("outer_lr must be > 0 and outer_momentum in [0, 1)")
        if self.staleness_window < 0:
            raise ValueError("staleness_window must be >= 0")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(f"shard_index must be in 0..shard_count-1, got {self.shard_index}/{self.shard_count}")
        if self.send_queue_messages < 16 or self.merge_threads < 1 or self.codec_threads < 1:
            raise ValueError("send_queue_messages >= 16, merge_threads >= 1 and codec_threads >= 1 required")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if ":" not in self.listen:
            raise ValueError(f"listen must be HOST:PORT, got {self.listen!r}")

    def owns(self, fragment: int) -> bool:
        return fragment % self.shard_count == self.shard_index

    @property
    def max_message_bytes(self) -> int:
        """gRPC message limit: one chunk plus generous room for its header."""
        return message_limit(self.protocol.max_chunk_bytes)


def with_mode(cfg: SynchronizerConfig, mode: str) -> SynchronizerConfig:
    """Apply a mode preset: protocol constants and the quorum policy that goes with them."""
    from ddiloco.core.config import protocol_for_mode

    protocol = protocol_for_mode(mode, cfg.protocol)
    policy = cfg.policy
    if mode in ("streaming", "diloco"):
        policy = dataclasses.replace(policy, quorum=0, timeout_s=policy.timeout_s or 120.0)
    return dataclasses.replace(cfg, protocol=protocol, policy=policy)
