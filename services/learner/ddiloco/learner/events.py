"""The learner's event log: JSON Lines, appended and flushed per event, safe across threads.

Every line carries ``event``, ``t`` (Unix seconds), ``learner_id`` and ``incarnation``; the events
and their fields are defined in ``ddiloco.core.events`` (the learner log), which checks each one
before it is written (docs/events.md). The run orchestrator and the goodput accounting read these
files (see docs/goodput.md); a killed process leaves at most one truncated last line, which
readers drop.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from ddiloco.core import events as schema


class EventLog:
    def __init__(self, path: str | None, *, log: str = schema.LEARNER_LOG, **bound: Any) -> None:
        """``bound``: the fields every line carries (the learner log's ``learner_id`` and
        ``incarnation``); ``log``: the log of ``ddiloco.core.events`` the events belong to."""
        self.path, self.log = path, log
        self.bound = bound
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - closed in close()
        self.counts: dict[str, int] = {}
        self.observers: list[Callable[[str, dict[str, Any]], None]] = []

    def emit(self, event: str, **fields: Any) -> None:
        self.emit_at(time.time(), event, **fields)

    def emit_at(self, t: float, event: str, **fields: Any) -> None:
        """``emit`` of an event that happened at Unix time ``t`` (in the communication process)."""
        schema.validate(self.log, event, self.bound.keys() | fields.keys())
        for observer in self.observers:
            observer(event, fields)
        with self._lock:
            self.counts[event] = self.counts.get(event, 0) + 1
            if self._file is None:
                return
            record = {"event": event, "t": t, **self.bound, **fields}
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
