"""What ``ddiloco run`` runs: the ``run`` section, the defaults of a local run, one checked document.

A local run resolves one config document (defaults, then the ``--config`` file, then flags),
checks it by building every component's config from it before any process starts, and writes it
to the run folder, where the synchronizer and the learners read it as a deployment reads its
ConfigMap. The services ignore the ``run`` section; it is this module's.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import field
from typing import Any, Literal

from pydantic.dataclasses import dataclass

from ddiloco.core.config import STRICT, build, check_sections, read_document, to_dict

RunMode = Literal["decoupled", "streaming", "diloco", "dp"]
RUN_MODES: tuple[str, ...] = ("decoupled", "streaming", "diloco", "dp")


@dataclass(frozen=True, kw_only=True, config=STRICT)
class RunConfig:
    """The ``run`` section: what the local run starts and measures."""

    learners: int = 3
    """Learner processes (dp: the number of learners whose combined batch the reference trains on)."""
    steps: int = 600
    """Inner steps per learner."""
    mode: RunMode = "decoupled"
    """decoupled, streaming, diloco, or dp (the data-parallel reference: one process)."""
    seed: int = 0
    """Seeds the model's initialisation and the data order (every learner's shard stream)."""
    final_eval_batches: int = 0
    """Held-out batches of the final evaluation of the global model (dp: of its model). 0 (the
    default): the whole held-out split, every window of ``context`` tokens once
    (``global_eval.HeldOut``), so every mode's final loss is measured on the same tokens; N: N
    batches of evenly spaced windows, as the learners' periodic evaluations (a quick look, or an
    eval split too large to score whole). The periodic evaluations stay ``train.eval_batches``."""
    global_eval_every_s: float = 20.0
    """Evaluate the global model this often while the run trains (0: only at genesis and the end)."""
    chaos_horizon_s: float = 300.0
    """Over how many seconds a ``random:`` fault plan spreads its faults (unless it says)."""
    shards: int = 1
    """Synchronizer shards (processes): shard s owns the fragments p with p mod shards == s, each
    with its own state dir (``state-s``) and merge log (``synchronizer-s.jsonl``)."""
    learner_speed: dict[str, float] = field(default_factory=dict)
    """For experiments with unequal hardware: learner id -> fraction of full speed (0.5: every
    inner step takes twice as long). Learners not named run at full speed."""

    def __post_init__(self) -> None:
        if self.learners < 1 or self.steps < 1:
            raise ValueError("learners and steps must be >= 1")
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.final_eval_batches < 0:
            raise ValueError(f"final_eval_batches must be >= 0 (0: the whole held-out split), got "
                             f"{self.final_eval_batches}")
        if self.global_eval_every_s < 0:
            raise ValueError(f"global_eval_every_s must be >= 0 (0: off), got {self.global_eval_every_s}")
        if self.chaos_horizon_s <= 0:
            raise ValueError(f"chaos_horizon_s must be > 0, got {self.chaos_horizon_s}")
        ids = {f"learner-{i}" for i in range(self.learners)}
        for lid, speed in self.learner_speed.items():
            if lid not in ids:
                raise ValueError(f"learner_speed names {lid!r}, but the run's learners are learner-0..learner-"
                                 f"{self.learners - 1}")
            if not 0 < speed <= 1:
                raise ValueError(f"learner_speed of {lid} must be in (0, 1], got {speed}")


DEFAULTS: dict[str, Any] = {
    "protocol": {"num_fragments": 24, "sync_every": 24, "overlap": 2},
    "data": {"batch_size": 16, "context": 128},
    "train": {"eval_every": 0, "eval_batches": 8},
    # The synchronizer's own defaults: quorum 1 plus the adaptive grace window, as deployed.
}


@dataclass(frozen=True, kw_only=True)
class DpTuned:
    """The data-parallel reference's own inner optimizer settings, what ``ddiloco run --mode dp``
    trains with unless the config file sets ``train.lr`` / ``train.warmup_steps`` itself.

    ``dp`` trains on the combined batch of every learner (3 x 16 sequences by default), and the
    learners' inner learning rate (``TrainConfig.lr``, 4.5e-3, tuned for a learner's batch of 16
    between outer steps) is not its optimum. From docs/quality.md (the quality study, 3 x 600
    steps of the default model and corpus):

    - section 1: dp's inner lr swept over 1.5e-3 .. 1.2e-2 at warm-up 30, seed 0: best at 6e-3
      (1.6282; 4.5e-3: 1.6377, 9e-3: 1.9125);
    - section 6: at 6e-3 the 60-step warm-up gains dp 2.8% (1.6282 -> 1.5823, a real ``ddiloco run
      --mode dp``, seed 0; seed 1: 1.5911); at warm-up 60 its optimum is flat from 6e-3 to 9e-3
      (1.5830 / 1.5820), and warm-up 120 gains nothing (1.5831).

    So "tuned dp" of every gap the study quotes is inner lr 6e-3 with warm-up 60 (the same as the
    learners' warm-up today, kept here so that a change of theirs does not move dp's)."""

    lr: float = 6e-3
    """Peak inner learning rate (AdamW, then the learners' cosine to ``min_lr_ratio``)."""
    warmup_steps: int = 60
    """Linear warm-up steps."""


DP_TUNED = DpTuned()
"""The settings ``--mode dp`` ships with (see ``DpTuned``)."""

TUNED, FROM_CONFIG, DEFAULT = "dp tuned default", "config", "default"
"""Where a run's inner learning rate (or warm-up) came from (``train_sources``)."""


def train_sources(file_doc: dict[str, Any], mode: str) -> dict[str, str]:
    """For ``train.lr`` and ``train.warmup_steps``: whether the config file set it (``config``,
    it wins), or, unset, dp's tuned default (``--mode dp``) or the learners' default."""
    train = file_doc.get("train") if isinstance(file_doc, dict) else None
    given = train if isinstance(train, dict) else {}
    return {key: FROM_CONFIG if key in given else TUNED if mode == "dp" else DEFAULT
            for key in ("lr", "warmup_steps")}


def merge_documents(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it, section by section and key by key."""
    out = copy.deepcopy(base)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_documents(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve(args: argparse.Namespace, file_doc: dict[str, Any] | None = None) -> tuple[RunConfig, dict[str, Any]]:
    """Defaults, then the config file (or ``file_doc``, a document already read), then flags: the
    run's settings and its whole document."""
    file_doc = read_document(args.config) if file_doc is None else file_doc
    check_sections(file_doc, args.config or "config")
    section = dict(file_doc.get("run") or {})
    section.update({k: getattr(args, k) for k in ("learners", "steps", "mode", "seed", "shards")
                    if getattr(args, k, None) is not None})
    for item in getattr(args, "learner_speed", None) or ():
        lid, sep, value = item.partition("=")
        try:
            speed = float(value)
        except ValueError:
            speed = None
        if not sep or speed is None:
            raise ValueError(f"--learner-speed takes ID=FRACTION (e.g. learner-2=0.5), got {item!r}")
        section["learner_speed"] = {**(section.get("learner_speed") or {}), lid: speed}
    run = build(RunConfig, section, "run")
    doc = merge_documents(DEFAULTS, file_doc)
    doc["run"] = to_dict(run)
    for name in ("train", "data", "protocol", "synchronizer"):
        doc.setdefault(name, {})
    doc["train"]["steps"] = run.steps
    doc["train"]["seed"] = run.seed
    doc["data"]["seed"] = run.seed
    doc["protocol"]["mode"] = "decoupled" if run.mode == "dp" else run.mode
    if run.mode == "dp":  # dp's own tuned settings, unless the file sets them (flags set neither)
        for key, source in train_sources(file_doc, run.mode).items():
            if source == TUNED:
                doc["train"][key] = getattr(DP_TUNED, key)
    if run.mode in ("streaming", "diloco") and isinstance(doc["synchronizer"], dict):
        # every merge waits for every live learner: the run's learners start their rounds together
        doc["synchronizer"].setdefault("start_learners", run.learners)
    return run, doc


def validate(doc: dict[str, Any]) -> None:
    """Build every component's config once, so a bad document fails before any process starts."""
    from ddiloco.learner.config import learner_config
    from ddiloco.synchronizer.config import synchronizer_config

    learner_config(doc, synchronizer="127.0.0.1:1", learner_id="learner-0")
    shards = int((doc.get("run") or {}).get("shards", 1))
    synchronizer_config(doc, shard_index=shards - 1, shard_count=shards)  # more shards than fragments fail here
