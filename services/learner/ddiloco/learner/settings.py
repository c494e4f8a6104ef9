"""The sync client's settings and its error: ``sync_config`` and ``SyncError``, and ``StepPace``."""

from __future__ import annotations

from typing import Any

from ddiloco.core.config import to_dict
from ddiloco.learner.config import LearnerConfig, learner_config

_PROTOCOL_SHORTHANDS = {"fragments": "num_fragments", "sync_every": "sync_every", "overlap": "overlap",
                        "mode": "mode"}


class SyncError(RuntimeError):
    """Decoupled training cannot go on: refused by the synchronizer, could not join, bad settings."""


class StepPace:
    """Recent wall time per inner step (an EMA), what the learner reports to pace the fleet's
    clock. One long step (a stop, a pause) counts at most ``clip`` times the average, so a
    learner's pace recovers within a few steps of resuming."""

    def __init__(self, alpha: float = 0.1, clip: float = 4.0) -> None:
        self.alpha, self.clip, self.value = alpha, clip, 0.0

    def update(self, sample: float) -> float:
        if self.value == 0.0:
            self.value = sample
        else:
            self.value += self.alpha * (min(sample, self.clip * self.value) - self.value)
        return self.value


def sync_config(config: LearnerConfig | dict[str, Any] | None = None, **settings: Any) -> LearnerConfig:
    """A ``LearnerConfig`` from a config object or document plus keyword settings: any learner
    field (``synchronizer``, ``learner_id``, ``codec``, ``token``, ``event_log``...), or a
    protocol field by its short name (``fragments``, ``sync_every``, ``overlap``, ``mode``)."""
    shared = ("protocol", "model", "data", "train")
    if isinstance(config, LearnerConfig):
        if all(v is None for v in settings.values()):
            return config  # validated already: nothing to apply
        full = to_dict(config)
        document: dict[str, Any] = {"learner": {k: v for k, v in full.items() if k not in shared},
                                    **{k: full[k] for k in shared}}
    else:
        document = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (config or {}).items()}
    protocol = dict(document.get("protocol") or {})
    learner = dict(document.get("learner") or {})
    for key, value in settings.items():
        if value is None:
            continue
        if key in _PROTOCOL_SHORTHANDS:
            protocol[_PROTOCOL_SHORTHANDS[key]] = value
        else:
            learner[key] = value
    document["protocol"], document["learner"] = protocol, learner
    try:
        return learner_config(document)
    except ValueError as exc:
        raise SyncError(str(exc)) from exc


__all__ = ["StepPace", "SyncError", "sync_config"]
