"""One case of the quality study: every setting a reference run depends on, and its stable name.

Decisions:

- **A case is its settings, nothing else.** Its id is the settings that differ from the defaults,
  in field order (``decoupled-h12-p12-codec_int4_block``), so a result file names what it
  measured, two sweeps that ask for the same case share one result, and changing a default
  never silently reuses a result computed under the old one (the file holds every setting, and
  ``matches`` compares them all).
- **The defaults are the system's defaults of the study's stages** (learner, protocol,
  synchronizer and the local run's data settings), so ``decoupled`` with no settings is what
  ``ddiloco run`` trained when they ran. The system has since taken inner lr 4.5e-3 and applies
  merges on arrival (``learner.apply_at``, which the reference does not model) and steps the
  last merges of hand-overs without momentum: today's default is the case
  ``decoupled:inner_lr=4.5e-3:overlap=1:hand_over_momentum=off``. The case defaults stay, so
  every result keeps its name.
- **Data sharding is a setting.** ``shards: 0`` gives each learner 1/M of the training data (as
  the data-parallel reference, which samples all of it, and as ``ddiloco run``, which starts its
  learners with ``--num-shards M``); a deployment keeps the learner's ``num_shards`` (8 by
  default) whatever the fleet's size, so 3 learners see 3/8 of it: ``shards: 8``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

MODES = ("dp", "decoupled", "diloco")
MODELS = ("default", "m5", "moe")
APPLY = ("overwrite", "mix", "replay")
MERGES = ("rda", "mean")
SCHEDULES = ("constant", "cosine", "linear")
ANCHORS = ("point", "delta")
CODECS = ("fp32", "bf16_zstd", "int8_block", "int4_block", "int2_block")


@dataclass(frozen=True, kw_only=True)
class Case:
    """Settings of one reference run (see ``ddiloco.lab.study.reference``)."""

    mode: str = "decoupled"
    """dp (one model, the combined batch), decoupled (P fragments on staggered offsets, applied
    tau steps after sending), diloco (one fragment, no overlap: synchronous DiLoCo)."""
    learners: int = 3
    """M: learners (dp: whose combined batch it trains on)."""
    steps: int = 600
    """Inner steps per learner (dp: optimizer steps)."""
    seed: int = 0
    """Model initialisation and data order."""
    model: str = "default"
    """default (~0.88M parameters, d_model 128, 4 layers), m5 (~4.9M, d_model 256, 6 layers), moe
    (the default's shape, 4 experts, top 2)."""
    batch_size: int = 16
    """Sequences per learner step (dp: times M)."""
    shards: int = 0
    """Data shards the training tokens are split into; learner i samples shard i. 0: M (each
    learner 1/M of the data, as ``ddiloco run``); 8: the learners' default num_shards, as a
    deployment that leaves it alone."""
    inner_lr: float = 3e-3
    """Peak AdamW learning rate (warm-up, then cosine to ``min_lr_ratio`` of it)."""
    warmup_steps: int = 60
    """Linear warm-up steps of the inner schedule."""
    min_lr_ratio: float = 0.1
    """Floor of the inner cosine as a share of the peak."""
    fragments: int = 24
    """P: fragments (diloco: 1)."""
    sync_every: int = 24
    """H: steps between two syncs of one fragment."""
    overlap: int = 2
    """tau: steps between sending a fragment and applying its merge (diloco: 0)."""
    codec: str = "bf16_zstd"
    """Codec of the learners' outer gradients (with error feedback when lossy)."""
    error_feedback: bool = True
    """Carry each codec's rounding error into the next contribution of the fragment."""
    global_codec: str = "bf16_zstd"
    """Codec of the merged global fragments sent back to the learners."""
    outer_lr: float = 0.7
    """Outer Nesterov learning rate."""
    outer_momentum: float = 0.5
    """Outer Nesterov momentum."""
    outer_schedule: str = "constant"
    """Outer learning rate over the run: constant, cosine or linear decay to ``outer_lr_min``."""
    outer_lr_min: float = 0.1
    """End of the outer decay as a share of ``outer_lr``."""
    momentum_warmup: int = 8
    """Outer steps (per fragment) over which the momentum ramps linearly from 0."""
    hand_over_momentum: bool = True
    """Whether the last merge of each fragment, made of the learners' hand-overs at the end of
    training, takes the outer momentum (the synchronizer's ``hand_over_momentum``; off is its
    default today, on what every stage before it ran)."""
    merge: str = "rda"
    """Per-tensor merge: rda or mean."""
    token_weights: bool = True
    """Weight each contribution by tokens x tokens/steps (off: uniform)."""
    apply: str = "replay"
    """How a learner applies a merged fragment: overwrite, mix or replay."""
    mix_alpha: float = 0.5
    """alpha of mix."""
    late: int = 0
    """The first N learners' contributions reach their merge one round of the fragment late: a
    straggler pattern."""
    anchor: str = "point"
    """How a late contribution joins: point (re-anchored to the current version, the
    synchronizer's default) or delta (applied as is)."""
    eval_batches: int = 32
    """Held-out batches of the final evaluation (as ``ddiloco run``)."""
    curve_points: int = 6
    """Evaluations of the global model during the run (8 batches each), for the loss curves."""

    def __post_init__(self) -> None:
        _one_of("mode", self.mode, MODES)
        _one_of("model", self.model, MODELS)
        _one_of("apply", self.apply, APPLY)
        _one_of("merge", self.merge, MERGES)
        _one_of("outer_schedule", self.outer_schedule, SCHEDULES)
        _one_of("anchor", self.anchor, ANCHORS)
        _one_of("codec", self.codec, CODECS)
        _one_of("global_codec", self.global_codec, CODECS)
        for name in ("learners", "steps", "batch_size", "fragments", "sync_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shards < 0 or (self.shards and self.shards < self.learners):
            raise ValueError(f"shards must be 0 (one per learner) or >= learners ({self.learners}), got {self.shards}")
        if not 0 <= self.overlap < self.sync_every:
            raise ValueError(f"overlap must satisfy 0 <= tau < H, got tau={self.overlap}, H={self.sync_every}")
        if self.mode == "diloco" and (self.fragments != 1 or self.overlap != 0):
            raise ValueError("diloco mode has one fragment and no overlap (fragments=1, overlap=0)")
        for name in ("inner_lr", "outer_lr"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("min_lr_ratio", "outer_lr_min", "mix_alpha"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.warmup_steps < 0 or self.momentum_warmup < 0 or self.curve_points < 0:
            raise ValueError("warmup_steps, momentum_warmup and curve_points must be >= 0")
        if not 0 <= self.late < self.learners:
            raise ValueError(f"late must be in [0, learners), got {self.late}")

    @property
    def id(self) -> str:
        """The mode and the settings that differ from the defaults, in field order."""
        parts = [self.mode]
        defaults = DEFAULTS[self.mode]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "mode" and value != getattr(defaults, f.name):
                parts.append(f"{f.name}_{_short(value)}")
        return "-".join(parts)

    @property
    def tokens(self) -> int:
        """Tokens the whole fleet trains on (dp: the same)."""
        return self.learners * self.steps * self.batch_size * CONTEXT

    @property
    def data_shards(self) -> int:
        return self.shards or self.learners

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def matches(self, saved: dict[str, Any]) -> bool:
        """Whether a saved result was computed with exactly these settings (a setting added after
        it ran had, then, the value its default keeps: ``ADDED``)."""
        try:
            return saved_settings(saved) == self.settings()
        except KeyError:
            return False


CONTEXT = 128
"""Tokens per sequence (the model's context), as the local run's default."""


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


ADDED: dict[str, Any] = {"hand_over_momentum": True}
"""Settings added after results were saved, with the value every earlier result ran with."""



def saved_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """Every setting of a saved result, a setting added after it ran with the value it ran with
    (``ADDED``); ``KeyError`` for any other that is missing."""
    return {f.name: saved.get(f.name, ADDED[f.name]) if f.name in ADDED else saved[f.name] for f in fields(Case)}


DEFAULTS = {"dp": Case(mode="dp", momentum_warmup=0), "decoupled": Case(),
            "diloco": Case(mode="diloco", fragments=1, overlap=0)}


def parse_case(spec: str, **base: Any) -> Case:
    """A case from ``MODE[:key=value...]`` (e.g. ``decoupled:sync_every=12:fragments=12``), over
    ``base`` settings (e.g. ``steps``), over the mode's defaults. Unknown keys and bad values are
    refused with the known keys named."""
    mode, *opts = spec.strip().split(":")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} in case {spec!r}; known: {', '.join(MODES)}")
    kinds = {f.name: type(getattr(DEFAULTS[mode], f.name)) for f in fields(Case)}
    settings: dict[str, Any] = {**DEFAULTS[mode].settings(), **base, "mode": mode}
    for opt in opts:
        key, sep, raw = opt.partition("=")
        if not sep or key not in kinds or key == "mode":
            raise ValueError(f"unknown case setting {key!r} in {spec!r}; known: "
                             f"{', '.join(sorted(k for k in kinds if k != 'mode'))}")
        settings[key] = _convert(key, raw, kinds[key])
    return Case(**settings)


def _convert(key: str, raw: str, kind: type) -> Any:
    if kind is bool:
        if raw.lower() in ("1", "true", "on", "yes"):
            return True
        if raw.lower() in ("0", "false", "off", "no"):
            return False
        raise ValueError(f"{key} takes on/off, got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{key} takes a {kind.__name__}, got {raw!r}") from None
