"""The protocol constants learners and the synchronizer must agree on (checked at Hello)."""

from __future__ import annotations

from pydantic.dataclasses import dataclass

from ddiloco.core.config import STRICT
from ddiloco.core.modes import Mode, preset
from ddiloco.fragments.codec_names import CodecName


@dataclass(frozen=True, kw_only=True, config=STRICT)
class ProtocolConfig:
    """Mode, fragments, schedule, chunking and the global codec: one value on every side."""

    mode: Mode = "decoupled"
    """decoupled (quorum K and grace; learners never wait), streaming (every live learner; learners
    wait for each merged fragment), diloco (one fragment, no overlap; learners block)."""
    num_fragments: int = 24
    """P: fragments the model is partitioned into (diloco: 1)."""
    sync_every: int = 24
    """H: inner steps between two syncs of the same fragment."""
    overlap: int = 2
    """tau: steps between sending a fragment and applying its merged version (diloco: 0)."""
    max_chunk_bytes: int = 4 * 1024 * 1024 - 64 * 1024
    """Largest chunk of a transfer; gRPC message limits are set from it."""
    global_codec: CodecName = "bf16_zstd"
    """Codec of merged global fragments sent to learners: bf16_zstd, fp32, int8_block, int4_block or
    int2_block (the last three are meant for outer gradients: parameters sent in them lose precision
    for good)."""

    def __post_init__(self) -> None:
        if self.num_fragments < 1 or self.sync_every < 1:
            raise ValueError("num_fragments and sync_every must be >= 1")
        if not 0 <= self.overlap < self.sync_every:
            raise ValueError(f"overlap must satisfy 0 <= tau < H, got tau={self.overlap}, H={self.sync_every}")
        if not 1024 <= self.max_chunk_bytes <= 64 * 1024 * 1024:
            raise ValueError(f"max_chunk_bytes must be in 1 KiB..64 MiB, got {self.max_chunk_bytes}")
        p = preset(self.mode)
        for name in ("num_fragments", "overlap"):
            fixed = getattr(p, name)
            if fixed is not None and getattr(self, name) != fixed:
                raise ValueError(f"{self.mode} mode has {name} {fixed}, got {getattr(self, name)} "
                                 "(a config loaded from a file gets the mode's preset applied)")
