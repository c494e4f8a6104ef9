"""The fleet's pace as the rounds see it: running averages of the inner step time (from
heartbeats), the time a round took to reach its quorum and the time a merge took (from committed
merges); the adaptive grace window is sized from them (``ddiloco.algorithm.policies.Timings``)."""

from __future__ import annotations

from ddiloco.algorithm.policies import Timings
from ddiloco.core.averages import RunningAverage


class Pace:
    def __init__(self, alpha: float = 0.2) -> None:
        self._step_time = RunningAverage(alpha)
        self._quorum_time = RunningAverage(alpha)
        self._sync_time = RunningAverage(alpha)

    def stepped(self, step_time_s: float) -> None:
        """A heartbeat's inner step time (a valid one, from a learner still training)."""
        self._step_time.update(step_time_s)

    def merged(self, quorum_time_s: float, sync_time_s: float) -> None:
        """A committed merge: how long its round took to reach a quorum, and the merge itself."""
        self._quorum_time.update(quorum_time_s)
        self._sync_time.update(sync_time_s)

    def timings(self) -> Timings:
        return Timings(self._step_time.get(), self._quorum_time.get(), self._sync_time.get())
