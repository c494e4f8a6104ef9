"""Who is there: learner records, their streams, and liveness.

A learner is *live* (is asked for fragments, counts for quorums and paces the fleet's clock) while
it has an open Sync stream, has been heard from within the heartbeat timeout, still trains (its
heartbeat does not say ``training_done``) and has something valid to give (its last contribution
was not refused for its content, say non-finite values, unless a good one followed). A dropped
stream removes it from quorums at once. A new
stream with the same learner id replaces the old one (the old stream is told to end), which is
how a restarted or reconnected learner takes over its identity.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ddiloco.protocol.wire import FragmentRequest
from ddiloco.synchronizer.broadcast import Outbox


@dataclass
class LearnerRecord:
    learner_id: str
    outbox: Outbox
    labels: dict[str, str] = field(default_factory=dict)
    incarnation: int = 0
    stream_id: int = 0
    connected: bool = False
    last_seen: float = 0.0
    step: int = 0
    tokens_total: int = 0
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    heartbeat_at: float = 0.0
    joined_at: float = 0.0
    """When its current process first attached (the claim guard times a newcomer's first answers
    from it)."""
    merged: int = 0
    rejected: int = 0
    superseded: int = 0
    tokens_merged: int = 0
    tokens_received: int = 0
    held: dict[int, int] = field(default_factory=dict)
    training_done: bool = False
    """Its heartbeat said it stopped training (it waits for results only)."""
    faulty: str = ""
    """Why its last contribution was refused for its content ("" once a good one arrived)."""
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    left: str = ""
    """Why its last stream ended ("" while connected): "said goodbye (REASON)", "learner closed the
    stream" (half-closed without a goodbye), "stream ended" (cancelled or cut), a protocol
    violation, "synchronizer shutting down". A stream replaced by a newer one records nothing: the
    learner is still connected."""


class Membership:
    def __init__(self, *, heartbeat_timeout_s: float, max_control: int, max_learners: int) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_control = max_control
        self.max_learners = max_learners
        self.learners: dict[str, LearnerRecord] = {}
        self._next_stream = 0

    def attach(self, learner_id: str, now: float, incarnation: int, labels: dict[str, str]) -> LearnerRecord:
        """A stream opened for ``learner_id``: (re)bind the record to it, ending any older stream."""
        record = self.learners.get(learner_id)
        if record is None:
            if len(self.learners) >= self.max_learners:
                self._forget_one_disconnected()
            if len(self.learners) >= self.max_learners:
                raise OverflowError(f"too many learners ({self.max_learners})")
            record = LearnerRecord(learner_id, Outbox(self.max_control), joined_at=now)
            self.learners[learner_id] = record
        else:
            record.closing.set()
            record.outbox.wake()
            record.closing = asyncio.Event()
        self._next_stream += 1
        record.stream_id = self._next_stream
        record.connected = True
        record.left = ""
        record.last_seen = now
        record.labels = dict(labels)
        if incarnation != record.incarnation:
            # A new process under this id: results queued for the old one would be matched to the
            # new process's own sequence numbers. The event log keeps the old process's outcomes.
            record.held = {}
            record.outbox.drop_results()
            record.training_done, record.faulty, record.step_time_s = False, "", 0.0
            record.joined_at = now
        record.incarnation = incarnation
        return record

    def detach(self, record: LearnerRecord, stream_id: int) -> bool:
        """The stream ``stream_id`` ended; True if it was the learner's current stream."""
        if record.stream_id != stream_id:
            return False
        record.connected = False
        return True

    def _forget_one_disconnected(self) -> None:
        gone = [r for r in self.learners.values() if not r.connected]
        if gone:
            oldest = min(gone, key=lambda r: r.last_seen)
            del self.learners[oldest.learner_id]

    def is_live(self, record: LearnerRecord, now: float) -> bool:
        return self.is_training(record, now) and not record.faulty

    def is_training(self, record: LearnerRecord, now: float) -> bool:
        """Connected, heard from within the heartbeat timeout, and not done training: live, or
        faulty (its last answer was refused for its content) and able to send a good one."""
        return (record.connected and now - record.last_seen <= self.heartbeat_timeout_s
                and not record.training_done)

    def live_records(self, now: float) -> list[LearnerRecord]:
        return [r for r in self.learners.values() if self.is_live(r, now)]

    def live(self, now: float) -> frozenset[str]:
        return frozenset(lid for lid, r in self.learners.items() if self.is_live(r, now))

    def ask(self, request: FragmentRequest, now: float) -> frozenset[str]:
        """Send ``request`` to every learner still training; the live ones among them (a faulty
        learner is asked as well, or it could never send the good answer that makes it live
        again, but no round waits for it)."""
        asked = []
        for rec in self.learners.values():
            if self.is_training(rec, now):
                rec.outbox.put_control(request)
                if not rec.faulty:
                    asked.append(rec.learner_id)
        return frozenset(asked)

    def connected(self) -> list[LearnerRecord]:
        return [r for r in self.learners.values() if r.connected]
