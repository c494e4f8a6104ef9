"""The learner's event log: JSON Lines, appended and flushed per event, safe across threads.

Every line carries ``event``, ``t`` (Unix seconds), ``learner_id`` and ``incarnation``. The run
orchestrator and the goodput accounting read these files (see docs/goodput.md); a killed process
leaves at most one truncated last line, which readers skip.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any


class EventLog:
    def __init__(self, path: str | None, **bound: Any) -> None:
        self.path = path
        self.bound = bound
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - closed in close()
        self.counts: dict[str, int] = {}
        self.observers: list[Callable[[str, dict[str, Any]], None]] = []

    def emit(self, event: str, **fields: Any) -> None:
        for observer in self.observers:
            observer(event, fields)
        with self._lock:
            self.counts[event] = self.counts.get(event, 0) + 1
            if self._file is None:
                return
            record = {"event": event, "t": time.time(), **self.bound, **fields}
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
