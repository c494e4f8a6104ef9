"""The sync client's settings and its error: ``sync_config`` and ``SyncError``."""

from __future__ import annotations

from typing import Any

from ddiloco.core.config import to_dict
from ddiloco.learner.config import LearnerConfig, learner_config

_PROTOCOL_SHORTHANDS = {"fragments": "num_fragments", "sync_every": "sync_every", "overlap": "overlap",
                        "mode": "mode"}


class SyncError(RuntimeError):
    """Decoupled training cannot go on: refused by the synchronizer, could not join, bad settings."""


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


__all__ = ["SyncError", "sync_config"]
