"""The learner's configuration: one strict config dataclass per concern, validated on construction.

Loaded from a config document's ``learner`` section plus the shared ``protocol``, ``model``,
``data`` and ``train`` sections, after the mode preset is applied (``ddiloco.core.modes``).
Measurements behind the defaults are in docs/design-notes.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import field
from typing import Any, Literal

from pydantic.dataclasses import dataclass

from ddiloco.core.config import STRICT, ConfigError, build, check_sections
from ddiloco.core.modes import apply_mode, preset
from ddiloco.fragments.codec_names import CodecName
from ddiloco.protocol.config import ProtocolConfig
from ddiloco.protocol.credentials import Credentials, read_token
from ddiloco.protocol.shards import synchronizer_targets
from ddiloco.training.config import TrainConfig
from ddiloco.training.data import DataConfig
from ddiloco.training.model import ModelConfig, model_section

ApplyPolicy = Literal["overwrite", "mix", "replay"]


@dataclass(frozen=True, kw_only=True, config=STRICT)
class LearnerConfig:
    """Everything one learner process needs."""

    synchronizer: str = "127.0.0.1:7000"
    """HOST:PORT of the synchronizer; a sharded synchronizer: one address per shard, comma-separated
    in shard order, or a pattern holding ``{shard}`` (with ``synchronizer_shards``), such as a
    headless Service's ``ddiloco-synchronizer-{shard}.ddiloco-synchronizer-shards:7000``."""
    synchronizer_shards: int | None = None
    """Number of synchronizer shards (None: one per address listed). Shard s owns the fragments p
    with p mod S == s; the learner holds one stream per shard."""
    learner_id: str = ""
    """Stable identity; defaults to $HOSTNAME (the pod name on Kubernetes)."""
    shard_index: int = -1
    """Data shard; -1 derives it from the learner id: an ordinal suffix ``-N`` (learner-3, a
    StatefulSet pod ddiloco-learner-3) gives N mod num_shards, any other id (a Deployment pod
    such as ddiloco-learner-7d9f8c6b5-x2k94) a stable hash mod num_shards. Every learner of a
    fleet must agree on num_shards; only ordinals below it guarantee disjoint shards."""
    num_shards: int = 8
    """Number of data shards the training data is split into (the same on every learner)."""
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    """Mode, P, H, tau, chunk size and global codec (must match the synchronizer)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture (must match every other learner's)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, batch size and context."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Inner optimizer and schedule."""
    apply_policy: ApplyPolicy = "replay"
    """How a merged global fragment is applied: replay (global plus the local progress made since
    sending; nothing local is discarded), overwrite (the paper's default: the global as is) or mix
    (Streaming DiLoCo's alpha*local + (1-alpha)*global). Replay keeps the tau steps of every period
    that overwrite throws away."""
    mix_alpha: float = 0.5
    """alpha of the mix policy."""
    apply_at: Literal["tau", "arrival"] | None = None
    """When a merge of this learner's contribution is applied: ``tau`` steps after the send (the
    protocol's overlap, which also sizes the synchronizer's grace window), or at the first step
    boundary after it arrived, one step after the send at the earliest (``arrival``: merges that
    come back early land less stale; the grace window keeps its budget). None (the default): the
    mode's, ``arrival`` in decoupled mode, ``tau`` where learners wait for merges (streaming,
    diloco), which refuse ``arrival``. In decoupled mode, applying on arrival with inner lr 4.5e-3
    ends 1.7% lower in eval loss than at tau with 3e-3 over three seeds of the default run
    (docs/quality.md, section 6b)."""
    speed: float = 1.0
    """For experiments with unequal hardware: run at this fraction of full speed (0.5: every inner
    step takes twice as long), by waiting after each step. 1: no waiting."""
    min_step_s: float = 0.0
    """For tests and experiments that need a known pace: every inner step takes at least this
    long (the learner waits out the rest after the step), so a fleet property that depends on
    how long a step is against a round trip holds on a machine of any speed. ``speed`` slows
    the floored step further. 0: no floor."""
    comm: Literal["thread", "process"] = "thread"
    """Where the communication runs: a thread of the training process (it shares the interpreter
    lock with the training loop), or a process of its own, handed fragments and handing merged
    ones back through shared memory, run under ``SCHED_BATCH`` on Linux (it never preempts
    training), and started again if it dies (needs ``P + 2`` fragment-sized slots of shared memory
    out and 4 back; see docs/design-notes.md, "Communication in a process of its own")."""
    codec: CodecName = "bf16_zstd"
    """Codec of contributions."""
    error_feedback: bool = True
    """Carry the codec's rounding error into the next contribution of the same fragment."""
    zstd_level: int = 1
    """zstd level of the bf16_zstd codec."""
    codec_threads: int = 1
    """Threads inside the codec (the training loop keeps the rest of the cores); with ``comm:
    process``, also the communication process's torch threads (its error feedback, finiteness
    checks and copies)."""
    heartbeat_s: float = 1.0
    """Heartbeat interval (the Welcome may ask for another)."""
    wait_timeout_s: float = 120.0
    """streaming/diloco: the longest a learner blocks for a merged fragment before it carries on."""
    join_timeout_s: float = 600.0
    """Longest a learner tries to join (reach the synchronizer, then upload or fetch the model)
    before it gives up with an error; SIGTERM ends the attempt at once."""
    reconnect_max_s: float = 2.0
    """Longest backoff between reconnection attempts (plus up to 0.5 s jitter). The wait doubles
    from 0.1 s and starts over after every session that stayed connected this long, so a learner
    rejoins a restarted synchronizer within about this long of it serving again."""
    corrupt_factor: float = 100.0
    """Fault injection (SIGUSR2, chaos kind corrupt): the factor every outer gradient sent is
    scaled by from then on, to test the synchronizer's norm guard."""
    inflate_factor: float = 100.0
    """Fault injection (SIGRTMIN, chaos kind inflate): the factor every answer's token count is
    multiplied by from then on (its outer gradients stay sound), to test the weight guard."""
    overclaim_factor: float = 1000.0
    """Fault injection (SIGRTMIN+1, chaos kind overclaim): the factor every answer's steps, tokens
    and outer gradient are multiplied by from then on (a learner that claims far more work than it
    did, to carry a far larger update past the norm guard), to test the claim guard."""
    token: str | None = None
    """Bearer token for the synchronizer, inline (local runs; deployments use token_file or
    $DDILOCO_TOKEN, so the token sits in neither a config map nor a command line)."""
    token_file: str | None = None
    """File holding the bearer token (a mounted Secret); read at start, and again at every
    reconnection, so a rotated token is picked up without a restart."""
    tls_ca: str | None = None
    """PEM CA to verify the synchronizer (enables TLS)."""
    tls_cert: str | None = None
    """PEM client certificate (mutual TLS)."""
    tls_key: str | None = None
    """PEM client key (mutual TLS)."""
    event_log: str | None = None
    """Append one JSON line per event (steps, sends, results, applies, evals) to this file."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds ("0.0.0.0" to let a scraper on the network reach it)."""

    def __post_init__(self) -> None:
        if not 0 < self.speed <= 1:
            raise ValueError(f"speed must be in (0, 1], got {self.speed}")
        if not (math.isfinite(self.min_step_s) and 0 <= self.min_step_s <= 60):
            raise ValueError(f"min_step_s must be in [0, 60] seconds, got {self.min_step_s}")
        if self.codec_threads < 1:
            raise ValueError(f"codec_threads must be >= 1, got {self.codec_threads}")
        if not 0 <= self.mix_alpha <= 1:
            raise ValueError(f"mix_alpha must be in [0, 1], got {self.mix_alpha}")
        if self.apply_at == "arrival" and preset(self.protocol.mode).learners_wait:
            raise ValueError(f"apply_at: arrival is for the decoupled mode; in {self.protocol.mode} mode "
                             f"learners wait for each merge tau steps after the send (apply_at: tau)")
        if (self.heartbeat_s <= 0 or self.wait_timeout_s <= 0 or self.join_timeout_s <= 0
                or self.reconnect_max_s < 0.1):
            raise ValueError("heartbeat_s, wait_timeout_s and join_timeout_s must be > 0 and reconnect_max_s >= 0.1")
        self.data.check_model(self.model)
        synchronizer_targets(self.synchronizer, self.synchronizer_shards)
        if self.num_shards < 1 or self.shard_index >= self.num_shards:
            raise ValueError(f"need num_shards >= 1 and shard_index < num_shards, got shard_index "
                             f"{self.shard_index}, num_shards {self.num_shards}")
        if self.token and self.token_file:
            raise ValueError("give the token inline or as token_file, not both")
        if self.token_file:
            read_token(self.token_file, {})  # refused now, not at the first connection

    @property
    def credentials(self) -> Credentials:
        """TLS files and the token; the token file is read again at each call (each connection)."""
        token = read_token(self.token_file, {}) if self.token_file else self.token
        return Credentials(tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key, token=token)

    @property
    def resolved_id(self) -> str:
        return self.learner_id or os.environ.get("HOSTNAME") or f"learner-{os.getpid()}"

    @property
    def applies_on_arrival(self) -> bool:
        """Whether merges of this learner's contributions are applied on arrival (``apply_at``,
        the mode's default resolved)."""
        if self.apply_at is None:
            return not preset(self.protocol.mode).learners_wait
        return self.apply_at == "arrival"

    @property
    def targets(self) -> list[str]:
        """The address of every synchronizer shard, shard 0 first (one, unsharded)."""
        return synchronizer_targets(self.synchronizer, self.synchronizer_shards)

    def resolved_shard(self) -> tuple[int, int]:
        """(shard index, number of shards) of this learner (see ``shard_index``)."""
        import hashlib
        import re

        if self.shard_index >= 0:
            return self.shard_index, self.num_shards
        lid = self.resolved_id
        m = re.search(r"-(\d+)$", lid)
        if m:
            return int(m.group(1)) % self.num_shards, self.num_shards
        digest = hashlib.sha256(lid.encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.num_shards, self.num_shards

    def batch_stream(self) -> int | str:
        """What keys this learner's batch-sampling stream beside the seeds: its shard index where
        the shard was given (``--shard``: reproducible, as ``ddiloco run`` and the quality study's
        reference fleet start their learners), else the shard and the learner id, so two learners
        whose ids land in one shard (pods hashed into it, ordinals beyond ``num_shards``) draw
        different windows of it instead of the same batches."""
        shard, _ = self.resolved_shard()
        return shard if self.shard_index >= 0 else f"{shard}:{self.resolved_id}"


def learner_config(document: dict[str, Any], **overrides: Any) -> LearnerConfig:
    """The learner's config from a config document (its ``learner`` section and the shared
    ``protocol``, ``model``, ``data``, ``train`` sections, mode preset applied), plus non-None
    ``overrides`` of ``learner`` fields (command-line flags)."""
    check_sections(document)
    doc = apply_mode(document)
    section = doc.get("learner") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"config section learner must be a mapping, got {type(section).__name__}")
    section = dict(section)
    for shared in ("protocol", "model", "data", "train"):
        if shared in section:
            raise ConfigError(f"learner.{shared}: set it in the top-level {shared} section (shared with the "
                              "synchronizer and every learner)")
        if shared in doc:
            section[shared] = model_section(doc[shared]) if shared == "model" else doc[shared]
    section.update({k: v for k, v in overrides.items() if v is not None})
    return build(LearnerConfig, section, "learner")


def load_learner_config(path: str | None, **overrides: Any) -> LearnerConfig:
    """``learner_config`` of a config file (or of the defaults, for None)."""
    from ddiloco.core.config import read_document

    return learner_config(read_document(path), **overrides)
