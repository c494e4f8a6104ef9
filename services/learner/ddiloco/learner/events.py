"""The learner's event log: JSON Lines, appended and flushed per event, safe across threads.

Every line carries ``event``, ``t`` (Unix seconds), ``learner_id`` and ``incarnation``; the events
and their fields are defined in ``ddiloco.core.events`` (the learner log), which checks each one
before it is written (docs/events.md). The run orchestrator and the goodput accounting read these
files (see docs/goodput.md); a killed process leaves at most one truncated last line, which
readers drop.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ddiloco.core import events as schema

_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
"""One encoder for every line (``json.dumps`` with options builds one per call)."""


class EventLog:
    def __init__(self, path: str | None, *, log: str = schema.LEARNER_LOG, **bound: Any) -> None:
        """``bound``: the fields every line carries (the learner log's ``learner_id`` and
        ``incarnation``); ``log``: the log of ``ddiloco.core.events`` the events belong to."""
        self.path = os.path.abspath(path) if path else None
        """Absolute: the communication process appends to the same file whatever its directory."""
        self.log = log
        self.bound = bound
        self._lock = threading.Lock()
        self._file = open(self.path, "a", buffering=1) if self.path else None  # noqa: SIM115 - closed in close()
        self.counts: dict[str, int] = {}
        self.observers: list[Callable[[str, dict[str, Any]], None]] = []
        self._checked: set[tuple[str, tuple[str, ...]]] = set()
        """(event, field names) already checked against the schema: an event emitted from one
        place carries the same names every time, and is checked the first time only."""

    def emit(self, event: str, **fields: Any) -> None:
        """Write the event, then tell the observers (one that tells another process finds the line
        in the file already)."""
        names = (event, tuple(fields))
        if names not in self._checked:
            schema.validate(self.log, event, self.bound.keys() | fields.keys())
            self._checked.add(names)
        with self._lock:
            if self._file is not None:
                record = {"event": event, "t": time.time(), **self.bound, **fields}
                self._file.write(_ENCODE(record) + "\n")
        self._observed(event, fields)

    def observe(self, event: str, fields: dict[str, Any]) -> None:
        """What ``emit`` does but the writing and the check: tell the observers, count it. For an
        event another process wrote to the same file (the communication process writes its own
        events, checked as it writes them; each line is one ``write`` to a file opened for
        appending, so lines of the two processes never interleave)."""
        self._observed(event, fields)

    def _observed(self, event: str, fields: dict[str, Any]) -> None:
        for observer in self.observers:
            observer(event, fields)
        with self._lock:
            self.counts[event] = self.counts.get(event, 0) + 1

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
