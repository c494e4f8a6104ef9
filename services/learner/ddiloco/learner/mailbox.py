"""The hand-off between the training thread and the communication thread, under one lock.

Training puts contributions in (``submit``: non-blocking; at most the newest contribution per
fragment and base is held while the synchronizer is unreachable) and takes out what the
communication thread left for it: the synchronizer's requests (``take_requests``: which fragments
to send now), merged fragments (``take_arrivals``, or ``wait_arrival`` with a timeout in the modes
that wait by design), and fragments to heal (``take_heals``). The communication thread takes
contributions to send (``next_outgoing``), settles them when answered (``settle``), sends the
unanswered ones again after a reconnect (``requeue_unacked``) and delivers what arrives
(``deliver``, ``add_request``). Nothing here touches the network or asyncio.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from ddiloco.core import events as schema
from ddiloco.learner.events import EventLog
from ddiloco.protocol import wire


@dataclass
class Outgoing:
    """A contribution handed over by the training loop. ``delta`` is the contribution's own:
    nothing changes it until the contribution is answered or dropped (an fp32 payload is a view of
    it, read again by a resend)."""

    fragment: int
    sequence: int
    base_version: int
    tokens: int
    steps: int
    learner_step: int
    delta: torch.Tensor
    round: int = 0
    """The request it answers (0: unsolicited)."""
    payload: bytes | memoryview | None = None
    """Its encoded values, once encoded (``codec.lend_or_encode``: fp32 lends ``delta``'s memory)."""
    hand_over: bool = False
    """The learner's last progress on this fragment, handed over as it finishes or drains."""


@dataclass
class Arrival:
    fragment: int
    version: int
    values: torch.Tensor
    resync: bool = False
    """Fetched because the synchronizer said our state is unusable: apply as overwrite."""


def carry(newer: Outgoing, older: Outgoing) -> None:
    """``newer`` (the same fragment's, from the same base) takes the place of ``older``, which is
    dropped unsent: measured from the same base, it holds ``older``'s progress too. It is a
    hand-over only when both are: a hand-over holds the fraction of a period since the last send
    and is merged without momentum, and one that carries a whole period's progress is not that
    fraction. The one rule for every place a queued contribution replaces another (``submit``, and
    ``requeue_unacked`` after a reconnect), as the synchronizer applies it when one replaces
    another there."""
    newer.hand_over = newer.hand_over and older.hand_over


def supersedes(held: Arrival, arrival: Arrival) -> bool:
    """Whether ``arrival`` takes the place of ``held``, a merged fragment of the same fragment not
    taken by training yet: a newer version, or a resync (applied as an overwrite, whatever its
    version). The one rule for what waits for training, in this mailbox and in the communication
    process (``comm_child.py``), where only the newest of each fragment waits either."""
    return arrival.version > held.version or arrival.resync


HEAL_AFTER = 3
"""Contributions of one fragment refused for their content in a row before training heals it."""
RECOVERABLE = frozenset({"stale", "future_version", "not_ready", "protocol"})
"""Refusals that say nothing about the learner's state (the synchronizer resyncs stale ones)."""


class Mailbox:
    def __init__(self, events: EventLog) -> None:
        self.events = events
        self._lock = threading.Condition()
        self._outbound: dict[int, list[Outgoing]] = {}
        """fragment -> contributions waiting to be sent, oldest first, one per base version."""
        self._unacked: dict[int, Outgoing] = {}
        self._arrivals: dict[int, Arrival] = {}
        self._requests: dict[int, int] = {}
        """fragment -> the newest round the synchronizer asked for and training has not answered."""
        self._refused: dict[int, int] = {}
        """fragment -> contributions refused for their content in a row."""
        self._heals: set[int] = set()
        """Fragments refused ``HEAL_AFTER`` times in a row: training resynchronises them."""
        self._resync_wanted: set[int] = set()
        """Fragments training wants fetched again (it healed them)."""

    # -- the training thread's side -------------------------------------------------------

    def submit(self, out: Outgoing) -> None:
        """Queue a contribution. An unsent older one of the same fragment *from the same base* is
        dropped (logged): the newer one carries its progress. One from an older base stays queued
        (a merge without it was applied since, so the newer one does not hold its progress); the
        synchronizer sums the two."""
        with self._lock:
            queue = self._outbound.setdefault(out.fragment, [])
            old = queue.pop() if queue and queue[-1].base_version == out.base_version else None
            if old is not None:
                carry(out, old)
            queue.append(out)
        if old is not None:
            self.events.emit(schema.DROPPED, sequence=old.sequence, fragment=old.fragment,
                             reason="replaced by a newer contribution before it could be sent")

    def take_requests(self) -> dict[int, int]:
        """Fragments the synchronizer asked for since the last call: fragment -> round."""
        with self._lock:
            out, self._requests = self._requests, {}
        return out

    def take_heals(self) -> set[int]:
        """Fragments whose contributions were refused for their content too often in a row."""
        with self._lock:
            out, self._heals = self._heals, set()
        return out

    def add_heals(self, fragments: list[int]) -> None:
        """Fragments to heal, decided elsewhere (by the communication process's mailbox)."""
        with self._lock:
            self._heals.update(fragments)

    def want_resync(self, fragments: tuple[int, ...]) -> None:
        """Have the communication thread fetch ``fragments`` again (``take_resync_wanted``)."""
        with self._lock:
            self._resync_wanted.update(fragments)

    def take_arrivals(self) -> dict[int, Arrival]:
        with self._lock:
            out, self._arrivals = self._arrivals, {}
        return out

    def peek_version(self, fragment: int) -> int | None:
        with self._lock:
            a = self._arrivals.get(fragment)
            return a.version if a else None

    def wait_arrival(self, fragment: int, newer_than: int, timeout_s: float, stop: threading.Event) -> bool:
        """Block until a global of ``fragment`` newer than ``newer_than`` has arrived (or timeout,
        or ``stop``)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                a = self._arrivals.get(fragment)
                if a is not None and a.version > newer_than:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or stop.is_set():
                    return False
                self._lock.wait(min(left, 0.5))

    def pending(self) -> int:
        """Contributions not answered yet: queued or sent."""
        with self._lock:
            return sum(len(q) for q in self._outbound.values()) + len(self._unacked)

    def drop_pending(self) -> None:
        """Forget every contribution not answered yet (the learner stopped), each one logged."""
        with self._lock:
            leftovers = [o for q in self._outbound.values() for o in q] + list(self._unacked.values())
            self._outbound.clear()
            self._unacked.clear()
        for out in leftovers:
            self.events.emit(schema.DROPPED, sequence=out.sequence, fragment=out.fragment,
                             reason="learner stopped before the contribution was answered")

    # -- the communication thread's side --------------------------------------------------

    def take_resync_wanted(self) -> set[int]:
        with self._lock:
            wanted, self._resync_wanted = self._resync_wanted, set()
        return wanted

    def next_outgoing(self) -> Outgoing | None:
        """The next contribution to send, counted as sent and unanswered; None when none waits."""
        with self._lock:
            if not self._outbound:
                return None
            p = next(iter(self._outbound))
            queue = self._outbound[p]
            out = queue.pop(0)
            if not queue:
                del self._outbound[p]
            self._unacked[out.sequence] = out
            return out

    def replaces(self, out: Outgoing) -> bool:
        """Whether an earlier answer for the same fragment and base, encoded and still unanswered,
        is superseded by ``out`` at the synchronizer (``out`` holds that one's progress)."""
        with self._lock:
            return any(o.fragment == out.fragment and o.sequence < out.sequence and
                       o.base_version == out.base_version and o.payload is not None
                       for o in self._unacked.values())

    def settle(self, msg: wire.ContributionResult) -> None:
        """Settle an answered contribution; ``HEAL_AFTER`` refusals of one fragment's contributions
        for their content in a row (a merge in between starts the count over) ask training to heal it."""
        with self._lock:
            self._unacked.pop(msg.sequence, None)
            if msg.outcome == "rejected" and msg.reason not in RECOVERABLE:
                self._refused[msg.fragment_id] = self._refused.get(msg.fragment_id, 0) + 1
                if self._refused[msg.fragment_id] >= HEAL_AFTER:
                    self._heals.add(msg.fragment_id)
                    self._refused[msg.fragment_id] = 0
            elif msg.outcome == "merged":
                self._refused[msg.fragment_id] = 0

    def add_request(self, fragment: int, round_no: int) -> None:
        """The synchronizer asked for ``fragment`` in round ``round_no`` (a ``FragmentRequest``'s fields:
        plain numbers, so the communication process's messages build no message object)."""
        with self._lock:
            self._requests[fragment] = max(round_no, self._requests.get(fragment, 0))

    def deliver(self, arrival: Arrival) -> None:
        with self._lock:
            cur = self._arrivals.get(arrival.fragment)
            if cur is None or supersedes(cur, arrival):
                self._arrivals[arrival.fragment] = arrival
            self._lock.notify_all()

    def requeue_unacked(self) -> None:
        """After a reconnect: contributions sent but not answered go back into the queue, but for
        one that a newer contribution from its base, queued, carries (``carry``: that one is a
        hand-over no more unless both were)."""
        with self._lock:
            # newest first, so an older one finds the newer one from its base that carries it
            for seq, out in sorted(self._unacked.items(), reverse=True):
                queue = self._outbound.get(out.fragment, [])
                newer = next((o for o in queue if o.sequence > seq and o.base_version == out.base_version), None)
                if newer is not None:
                    carry(newer, out)
                    self.events.emit(schema.DROPPED, sequence=seq, fragment=out.fragment,
                                     reason="unanswered at a reconnect; a newer contribution from the same "
                                            "base carries its progress")
                    continue
                # Nothing queued holds its progress: send it again, in sequence order (the synchronizer
                # answers a duplicate of a merged contribution without merging it twice).
                queue.append(out)
                queue.sort(key=lambda o: o.sequence)
                self._outbound[out.fragment] = queue
            self._unacked.clear()
