"""Reading a run's JSON Lines event logs: whole files after the fact, or a live file as it grows.

Killed processes leave ragged logs: ``read_jsonl`` / ``load_jsonl`` (and ``Tail`` for a live
file) drop a torn last line and recover a record that a restarted process appended onto a
half-written line, and raise on any other damage (docs/events.md). ``load_run_dir`` sorts a run
folder's logs into the learners' logs and the synchronizer's merge log. The events and their
fields are those of ``ddiloco.core.events``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.core import events

MERGE_LOG_EVENTS = frozenset({events.MERGE, events.SYNC_START, events.SYNC_STOP})
"""The synchronizer's events that goodput accounting reads."""

LEARNER_LOG_EVENTS = frozenset({events.START, events.STEP})
"""Events that mark a file as a learner's log."""

_RECORD_START = '{"event"'


@dataclass
class JsonlFile:
    """A JSON Lines file as read: its records and the damage dropped on the way."""

    records: list[dict[str, Any]] = field(default_factory=list)
    torn_last: int = 0
    """1 when a torn last line (a writer killed mid-write, or still writing) was dropped."""
    spliced: int = 0
    """Lines where a torn record was followed by a complete one: the complete one was kept."""


def read_jsonl(path: str | os.PathLike[str], *, missing_ok: bool = False) -> JsonlFile:
    """Read a JSON Lines event log under the one rule for damage (docs/events.md):

    - a missing file raises ``FileNotFoundError``, or reads as empty with ``missing_ok`` (a file a
      process has not created yet); blank lines are skipped;
    - a malformed *last* line (its writer died mid-write, or is writing it) is dropped and counted;
    - a malformed line elsewhere that ends in a complete ``{"event"...}`` record (a restarted
      writer, or ``ddiloco run`` writing ``sync_stop``, appended to a killed one's half-written
      line) gives that record; the fragment before it is dropped and counted;
    - any other malformed line raises ``ValueError`` naming the file and line: silently skipping
      the middle of a log would corrupt the accounting.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        if missing_ok:
            return JsonlFile()
        raise
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    out = JsonlFile()
    for i, line in enumerate(lines):
        line = line.strip()
        if not line:
            continue
        record = _parse_line(line, out)
        if record is None:
            if i == len(lines) - 1:
                out.torn_last = 1
                break
            raise ValueError(f"{path}:{i + 1}: malformed JSON Lines record: {line[:80]!r}")
        out.records.append(record)
    return out


def load_jsonl(path: str | os.PathLike[str], *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The records of a JSON Lines event log (``read_jsonl``'s rule for damage)."""
    return read_jsonl(path, missing_ok=missing_ok).records


def synchronizer_logs(run_dir: str | os.PathLike[str]) -> list[tuple[int | None, Path]]:
    """A ``ddiloco run`` folder's synchronizer logs as ``(shard, path)`` in shard order:
    ``[(None, synchronizer.jsonl)]`` for one synchronizer, ``synchronizer-<s>.jsonl`` for each
    shard s of a sharded one (ordered by s as a number: shard 10 comes after shard 9)."""
    folder = Path(run_dir)
    one = folder / "synchronizer.jsonl"
    if one.exists():
        return [(None, one)]
    shards = []
    for path in folder.glob("synchronizer-*.jsonl"):
        suffix = path.stem.rpartition("-")[2]
        if suffix.isdigit():
            shards.append((int(suffix), path))
    return sorted(shards)


class Tail:
    """Incrementally reads the complete lines of a growing JSON Lines file (a live run's logs),
    under ``read_jsonl``'s rule: a last line is held back until its newline arrives; a complete
    line that is malformed gives the record spliced onto it, or raises ``ValueError``."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""
        self.lines = 0
        self.damage = JsonlFile()
        """The damage counted so far (its ``records`` stay empty)."""

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
        for raw in lines:
            self.lines += 1
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            record = _parse_line(line, self.damage)
            if record is None:
                raise ValueError(f"{self.path}:{self.lines}: malformed JSON Lines record: {line[:80]!r}")
            out.append(record)
        return out


def _parse_line(line: str, damage: JsonlFile) -> dict[str, Any] | None:
    """The record on a (stripped, non-blank) line, or the complete record spliced onto a torn one
    (counted in ``damage``); None when there is neither."""
    record = _parse_record(line)
    if record is None:
        record = _recover_spliced(line)
        if record is not None:
            damage.spliced += 1
    return record


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
        records = load_jsonl(path)
        kinds = {e.get("event") for e in records}
        if kinds & MERGE_LOG_EVENTS:
            merges.extend(e for e in records if e.get("event") in MERGE_LOG_EVENTS)
        elif kinds & LEARNER_LOG_EVENTS:
            lid = next((e.get("learner_id") for e in records if e.get("event") == events.START), None)
            learners.setdefault(str(lid if lid is not None else path.stem), []).extend(records)
    merges.sort(key=lambda e: float(e.get("t", 0.0)))
    return RunLogs(learners=learners, merges=merges)
