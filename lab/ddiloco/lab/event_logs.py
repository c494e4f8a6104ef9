"""Reading a run's JSON Lines event logs: whole files after the fact, or a live file as it grows.

Killed processes leave ragged logs: ``load_jsonl`` drops a truncated last line and recovers a
record that a restarted process appended onto a half-written line. ``load_run_dir`` sorts a run
folder's logs into the learners' logs and the synchronizer's merge log.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MERGE_LOG_EVENTS = frozenset({"merge", "sync_start", "sync_stop"})
"""The synchronizer's events that goodput accounting reads."""

_RECORD_START = '{"event"'


def load_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Parse a JSON Lines event log, tolerating the damage a killed writer leaves.

    Blank lines are skipped. A malformed *last* line (the process died mid-write) is dropped. A
    malformed line elsewhere is usually a half-written record onto which a restarted process
    appended its own; the last complete ``{"event"...}`` record on that line is recovered and
    the fragment before it is dropped. Anything else malformed raises ``ValueError`` naming the
    file and line, because silently skipping the middle of a log would corrupt the accounting.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    events: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        line = line.strip()
        if not line:
            continue
        record = _parse_record(line)
        if record is None:
            record = _recover_spliced(line)
        if record is None:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: malformed JSON Lines record: {line[:80]!r}")
        events.append(record)
    return events


class Tail:
    """Incrementally reads the complete lines of a growing JSON Lines file (a live run's logs)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out


def _parse_record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _recover_spliced(line: str) -> dict[str, Any] | None:
    pos = line.rfind(_RECORD_START)
    while pos > 0:
        record = _parse_record(line[pos:])
        if record is not None:
            return record
        pos = line.rfind(_RECORD_START, 0, pos)
    return None


@dataclass(frozen=True)
class RunLogs:
    """The parsed event logs of one run."""

    learners: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Learner id -> that learner's events (all incarnations, file order)."""
    merges: list[dict[str, Any]] = field(default_factory=list)
    """The synchronizer's merge log (``merge``, ``sync_start``, ``sync_stop``), sorted by time."""


def _parents_below(path: Path, root: Path) -> list[Path]:
    """The folders between ``root`` (excluded) and ``path``, relative to ``root``."""
    rel = path.parent.relative_to(root)
    return [Path(*rel.parts[: i + 1]) for i in range(len(rel.parts))]


def load_run_dir(run_dir: str | os.PathLike[str]) -> RunLogs:
    """Load every ``*.jsonl`` under ``run_dir`` (recursively, but not into another run's folder
    nested in it, such as ``baseline/``: a folder with its own ``config.yaml``) and sort the logs
    by content.

    A file holding any ``merge``/``sync_start``/``sync_stop`` event is (part of) the merge log;
    several such files (a sharded synchronizer) are concatenated. A file holding ``start`` or
    ``step`` events is a learner log, keyed by the ``learner_id`` of its first ``start`` event
    (else the file name without extension). Other files are ignored.
    """
    learners: dict[str, list[dict[str, Any]]] = {}
    merges: list[dict[str, Any]] = []
    root = Path(run_dir)
    for path in sorted(root.rglob("*.jsonl")):
        if any((root / sub / "config.yaml").exists() for sub in _parents_below(path, root)):
            continue
        events = load_jsonl(path)
        kinds = {e.get("event") for e in events}
        if kinds & MERGE_LOG_EVENTS:
            merges.extend(e for e in events if e.get("event") in MERGE_LOG_EVENTS)
        elif kinds & {"start", "step"}:
            lid = next((e.get("learner_id") for e in events if e.get("event") == "start"), None)
            learners.setdefault(str(lid if lid is not None else path.stem), []).extend(events)
    merges.sort(key=lambda e: float(e.get("t", 0.0)))
    return RunLogs(learners=learners, merges=merges)
