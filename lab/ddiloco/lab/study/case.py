"""One case of the quality study: every setting a reference run depends on, and its stable name.

Decisions:

- **A case is its settings, nothing else.** Its id is the settings that differ from the defaults,
  in field order (``decoupled-h12-p12-codec_int4_block``), so a result file names what it
  measured, two sweeps that ask for the same case share one result, and changing a default
  never silently reuses a result computed under the old one (the file holds every setting, and
  ``matches`` compares them all). Settings a mode does not use (dp's fragments, codecs, outer
  optimizer...) are no part of its id nor of what ``matches`` compares.
- **What is measured, and on what, is part of the case.** The data order (``data_order``,
  ``DataConfig.order``), the final evaluation's set (``eval_batches``: 0, the whole held-out
  split) and the Python version (``python``: the ``stdlib`` corpus is the interpreter's own
  library) are settings like the others, recorded in every result. A result saved before one of
  them existed is read with the value it ran with (``ADDED``); its Python version is not known
  (``"unknown"``), so it is never taken for a result of today's cases.
- **The defaults are what ``ddiloco run`` ships** (``product_settings``: the learner, protocol,
  synchronizer, training and run defaults; for ``dp`` its tuned settings, ``run_config.DP_TUNED``),
  so ``decoupled`` with no settings is what ``ddiloco run`` trains; a test fails when they drift
  apart. The reference has no clock, so ``apply_at: arrival`` (the learners' default in decoupled
  mode) applies each merge one step after its send, the earliest a learner does. The sweeps of
  earlier stages name the defaults they ran around (``sweeps``), so they stay the cases that ran.
- **Data sharding is a setting.** ``shards: 0`` gives each learner 1/M of the training data (as
  the data-parallel reference, which samples all of it, and as ``ddiloco run``, which starts its
  learners with ``--num-shards M``); a deployment keeps the learner's ``num_shards`` (8 by
  default) whatever the fleet's size, so 3 learners see 3/8 of it: ``shards: 8``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, fields
from typing import Any

from ddiloco.lab.run_config import DP_TUNED
from ddiloco.training.data import DataConfig

MODES = ("dp", "decoupled", "diloco")
MODELS = ("default", "m5", "moe")
APPLY = ("overwrite", "mix", "replay")
MERGES = ("rda", "mean")
SCHEDULES = ("constant", "cosine", "linear")
ANCHORS = ("point", "delta")
CODECS = ("fp32", "bf16_zstd", "int8_block", "int4_block", "int2_block")
APPLY_AT = ("tau", "arrival")
DATA_ORDERS = ("shuffled", "contiguous")

PYTHON = "3.11"
"""The interpreter the study's results are computed with (the project's: the Dockerfile's base
image, mypy's ``python_version``). A case asked for under another one names it (``parse_case``)."""
UNKNOWN_PYTHON = "unknown"
"""The Python version of a result saved before results recorded it."""


def running_python() -> str:
    """This interpreter's version as a case names it: major.minor."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


DATA_ORDER: str = getattr(DataConfig(), "order", "contiguous")
"""The product's data order (``DataConfig.order``'s default; contiguous before it existed)."""


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
    data_order: str = DATA_ORDER
    """How the train files are laid out before they are cut into shards (``DataConfig.order``):
    shuffled by the seed, or contiguous (sorted by path; every result before the setting)."""
    inner_lr: float = 4.5e-3
    """Peak AdamW learning rate (warm-up, then cosine to ``min_lr_ratio`` of it); the learners'
    ``train.lr`` (dp: ``DP_TUNED.lr``, its own)."""
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
    apply_at: str = "arrival"
    """When a learner applies the merge of its contribution (``learner.apply_at``): ``tau`` steps
    after the send, or on ``arrival`` (decoupled's default), which the reference, where every
    merge comes back at once, makes one step after the send (the earliest a learner applies it).
    diloco: tau."""
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
    hand_over_momentum: bool = False
    """Whether the last merge of each fragment, made of the learners' hand-overs at the end of
    training, takes the outer momentum (the synchronizer's ``hand_over_momentum``; on is what
    every stage before it ran)."""
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
    eval_batches: int = 0
    """The final evaluation's set, as ``ddiloco run``'s ``final_eval_batches``: 0, the whole
    held-out split (every window of 128 tokens once); N, N batches of evenly spaced windows (32:
    every result before the whole split was the default)."""
    curve_points: int = 6
    """Evaluations of the global model during the run (8 evenly spaced batches each, as the
    learners' periodic evaluations), for the loss curves."""
    python: str = PYTHON
    """Python major.minor the case runs under: the ``stdlib`` corpus is its library, so another
    version trains and evaluates on other tokens."""

    def __post_init__(self) -> None:
        _one_of("mode", self.mode, MODES)
        _one_of("model", self.model, MODELS)
        _one_of("apply", self.apply, APPLY)
        _one_of("merge", self.merge, MERGES)
        _one_of("outer_schedule", self.outer_schedule, SCHEDULES)
        _one_of("anchor", self.anchor, ANCHORS)
        _one_of("codec", self.codec, CODECS)
        _one_of("global_codec", self.global_codec, CODECS)
        _one_of("apply_at", self.apply_at, APPLY_AT)
        _one_of("data_order", self.data_order, DATA_ORDERS)
        for name in ("learners", "steps", "batch_size", "fragments", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_batches < 0:
            raise ValueError(f"eval_batches must be >= 0 (0: the whole held-out split), got {self.eval_batches}")
        if not self.python:
            raise ValueError("python must name a version (major.minor)")
        if self.shards < 0 or (self.shards and self.shards < self.learners):
            raise ValueError(f"shards must be 0 (one per learner) or >= learners ({self.learners}), got {self.shards}")
        if not 0 <= self.overlap < self.sync_every:
            raise ValueError(f"overlap must satisfy 0 <= tau < H, got tau={self.overlap}, H={self.sync_every}")
        if self.mode == "diloco" and (self.fragments != 1 or self.overlap != 0):
            raise ValueError("diloco mode has one fragment and no overlap (fragments=1, overlap=0)")
        if self.mode == "diloco" and self.apply_at != "tau":
            raise ValueError("diloco mode applies merges at tau: its learners wait for them (apply_at=tau)")
        if self.apply_at == "arrival" and self.sync_every < 2:
            raise ValueError("apply_at=arrival applies a merge one step after the send: it needs sync_every >= 2")
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
        """The mode and the settings that differ from the defaults, in field order (only those
        the mode uses)."""
        parts = [self.mode]
        defaults = DEFAULTS[self.mode]
        for name in self.used():
            value = getattr(self, name)
            if name != "mode" and value != getattr(defaults, name):
                parts.append(f"{name}_{_short(value)}")
        return "-".join(parts)

    def used(self) -> list[str]:
        """The settings this case's mode uses, in field order (dp: none of the fleet's)."""
        return [f.name for f in fields(self) if not (self.mode == "dp" and f.name in FLEET_ONLY)]

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
        it ran had, then, the value ``ADDED`` gives; its Python version is unknown, so a result
        saved before results recorded it matches no case)."""
        try:
            theirs, mine = saved_settings(saved), self.settings()
        except KeyError:
            return False
        return all(theirs[name] == mine[name] for name in self.used())


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


FLEET_ONLY = frozenset({"shards", "fragments", "sync_every", "overlap", "apply_at", "codec", "error_feedback",
                        "global_codec", "outer_lr", "outer_momentum", "outer_schedule", "outer_lr_min",
                        "momentum_warmup", "hand_over_momentum", "merge", "token_weights", "apply", "mix_alpha",
                        "late", "anchor"})
"""Settings of the fleet and its synchronizer: dp (one model, sampling all the data) uses none."""

ADDED: dict[str, Any] = {"hand_over_momentum": True, "apply_at": "tau", "data_order": "contiguous",
                         "python": UNKNOWN_PYTHON}
"""Settings added after results were saved, with the value every earlier result ran with (the
Python version they ran under was not recorded)."""


def saved_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """Every setting of a saved result, a setting added after it ran with the value it ran with
    (``ADDED``); ``KeyError`` for any other that is missing."""
    return {f.name: saved.get(f.name, ADDED[f.name]) if f.name in ADDED else saved[f.name] for f in fields(Case)}


DEFAULTS = {"dp": Case(mode="dp", inner_lr=DP_TUNED.lr, warmup_steps=DP_TUNED.warmup_steps), "decoupled": Case(),
            "diloco": Case(mode="diloco", fragments=1, overlap=0, apply_at="tau")}
"""Each mode's case of the product's defaults (``product_settings`` says where each comes from)."""


def product_settings(mode: str) -> dict[str, Any]:
    """The settings ``ddiloco run --mode MODE`` (no config file) trains with, as a case's: read from
    the run's resolved config document through the learner's and the synchronizer's own config
    classes, so a default changed anywhere shows here. The study's own settings (``curve_points``,
    ``late``, ``python``) are today's case defaults; ``outer_schedule`` and ``token_weights`` have
    no setting in the product (a constant outer lr, token weights always)."""
    import argparse

    from ddiloco.lab.run_config import resolve
    from ddiloco.learner.config import learner_config
    from ddiloco.synchronizer.config import synchronizer_config

    args = argparse.Namespace(config=None, learners=None, steps=None, mode=mode, seed=None, shards=None,
                              learner_speed=None)
    run, doc = resolve(args, {})
    learner = learner_config(doc, synchronizer="127.0.0.1:1", learner_id="learner-0")
    sync = synchronizer_config(doc, shard_index=0, shard_count=1)
    train, data = learner.train, learner.data
    base = Case()
    return {
        "mode": mode, "learners": run.learners, "steps": run.steps, "seed": run.seed,
        "model": next((name for name, extra in _models().items()
                       if _model_config(data.context, extra) == learner.model), "other"),
        "batch_size": data.batch_size,
        "shards": 0,  # ddiloco run starts its learners with --num-shards M: 1/M of the data each
        "data_order": getattr(data, "order", "contiguous"),
        "inner_lr": train.lr, "warmup_steps": train.warmup_steps, "min_lr_ratio": train.min_lr_ratio,
        "fragments": learner.protocol.num_fragments, "sync_every": learner.protocol.sync_every,
        "overlap": learner.protocol.overlap, "apply_at": "arrival" if learner.applies_on_arrival else "tau",
        "codec": learner.codec, "error_feedback": learner.error_feedback, "global_codec": learner.protocol.global_codec,
        "outer_lr": sync.outer_lr, "outer_momentum": sync.outer_momentum, "outer_schedule": "constant",
        "outer_lr_min": base.outer_lr_min, "momentum_warmup": sync.outer_momentum_warmup,
        "hand_over_momentum": sync.hand_over_momentum, "merge": sync.merge_method, "token_weights": True,
        "apply": learner.apply_policy, "mix_alpha": learner.mix_alpha, "late": base.late,
        "anchor": sync.stale_anchor, "eval_batches": run.final_eval_batches, "curve_points": base.curve_points,
        "python": base.python,
    }


def _models() -> dict[str, dict[str, Any]]:
    from ddiloco.lab.study.reference import MODELS

    return MODELS


def _model_config(context: int, extra: dict[str, Any]) -> Any:
    from ddiloco.training.model import ModelConfig

    return ModelConfig(context=context, **extra)


def parse_case(spec: str, **base: Any) -> Case:
    """A case from ``MODE[:key=value...]`` (e.g. ``decoupled:sync_every=12:fragments=12``), over
    ``base`` settings (e.g. ``steps``), over the mode's defaults and this interpreter's Python
    version. Unknown keys and bad values are refused with the known keys named."""
    mode, *opts = spec.strip().split(":")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} in case {spec!r}; known: {', '.join(MODES)}")
    kinds = {f.name: type(getattr(DEFAULTS[mode], f.name)) for f in fields(Case)}
    settings: dict[str, Any] = {**DEFAULTS[mode].settings(), "python": running_python(), **base, "mode": mode}
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
