"""One fragment's merge round as a pure state machine, driven by an injected clock.

The synchronizer service (one asyncio task per fragment) and the fleet simulator (one event loop
for millions of chips) both run their rounds through ``RoundState``, so what the simulator
measures is what the service does. Nothing here reads a clock, touches tensors or does I/O: the
caller passes ``now``, what waits in the inbox, the fragment's version and who is live.

Decisions, and why:

- **A round opens with the first fresh contribution** (computed against the current version).
  Stale ones (an older base, within the staleness window) wait and join the next round rather
  than opening one: letting each late arrival open a round of its own made a default run diverge.
- **Stale contributions alone open a round after ``stale_round_s``**, or after one period (H steps
  at the fleet's step time) once every live learner has one waiting: by then each learner would
  have sent its next contribution for this fragment, so nothing fresher is coming. That is the
  end of every finite run, whose last contributions are often a version behind.
- **The quorum latches.** The moment a round first reaches its quorum starts the grace window
  and is not moved by later arrivals or departures.
- **The rejoin hold.** After a restart on existing state, a merge waits (until ``until``) for the
  learners of the last committed merges to contribute fresh; without it the first learner back is
  merged alone, as a whole outer step, and the others arrive stale.
- **One staleness rule** (``staleness_verdict``) for arrival and for merge time: a future base is
  refused, a base beyond the window is refused, a base whose parameters are no longer retained
  cannot be re-anchored and is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from ddiloco.algorithm.policies import Decision, QuorumPolicy, RoundView, Timings, decide, quorum_reached


@dataclass(frozen=True)
class Waiting:
    """What the round needs to know about one contribution in the inbox."""

    learner_id: str
    base_version: int
    arrived_at: float


@dataclass(frozen=True, kw_only=True)
class RoundRules:
    """The constants a round is decided by."""

    policy: QuorumPolicy
    """Quorum K, grace gamma and clamp, merge timeout."""
    overlap: int
    """tau: the overlap whose slack the grace window spends."""
    sync_every: int
    """H: inner steps between two syncs of one fragment (one period)."""
    stale_round_s: float
    """The longest stale contributions wait before they open a round of their own."""


@dataclass(frozen=True)
class Verdict:
    """Why a contribution cannot join a merge: a reject reason and a human-readable detail."""

    reason: str
    detail: str


def staleness_verdict(base: int, version: int, window: int, *, retained: bool = True) -> Verdict | None:
    """None when a contribution computed against ``base`` may join a merge of ``version``.

    ``retained``: whether the base version's parameters are still held (needed to re-anchor it)."""
    behind = version - base
    if behind < 0:
        return Verdict("future_version", f"base {base} is newer than version {version}")
    if behind > window or not retained:
        return Verdict("stale", f"base {base} is {behind} versions behind {version} (window {window})")
    return None


def participation_scale(contributors: int, live: int) -> float:
    """The share of an outer step a merge of ``contributors`` out of ``live`` learners makes."""
    return min(1.0, contributors / max(1, live))


@dataclass
class RejoinHold:
    """After a restart: merges wait for the learners of the last committed merges to come back."""

    expected: frozenset[str] = frozenset()
    """Learners in the last committed merges when the state was loaded."""
    until: float | None = None
    """Merges wait for them until then (None: no hold)."""

    def hold(self, now: float, fresh: frozenset[str]) -> float | None:
        """Until when a merge waits (None: it may go on). A fragment stops waiting once every
        expected learner has contributed fresh to it; every fragment once the window has passed."""
        if self.until is None:
            return None
        if now >= self.until:
            self.until = None
            return None
        return None if self.expected <= fresh else self.until


@dataclass
class RoundState:
    """The open round of one fragment: when it opened and when it reached its quorum."""

    opened_at: float | None = None
    quorum_at: float | None = None

    def _stale_wait(self, waiting: list[Waiting], live: frozenset[str], step_time_s: float,
                    rules: RoundRules) -> float:
        wait = rules.stale_round_s
        if live and live <= {w.learner_id for w in waiting} and step_time_s > 0:
            wait = min(wait, rules.sync_every * step_time_s)
        return wait

    def observe(self, now: float, waiting: Iterable[Waiting], version: int, live: frozenset[str],
                step_time_s: float, rules: RoundRules) -> RoundView:
        """Bring the round up to ``now`` (it may open, its quorum may latch) and describe it."""
        waiting = list(waiting)
        if self.opened_at is None and waiting:
            fresh_arrivals = [w.arrived_at for w in waiting if w.base_version == version]
            if fresh_arrivals:
                self.opened_at = min(fresh_arrivals)
            elif now - min(w.arrived_at for w in waiting) >= self._stale_wait(waiting, live, step_time_s, rules):
                self.opened_at = now
        contributors = frozenset(w.learner_id for w in waiting)
        fresh = frozenset(w.learner_id for w in waiting if w.base_version == version)
        view = RoundView(self.opened_at, self.quorum_at, contributors, live, fresh)
        if self.opened_at is not None and self.quorum_at is None and quorum_reached(view, rules.policy)[0]:
            self.quorum_at = now
            view = dataclasses.replace(view, quorum_at=now)
        return view

    def decide(self, now: float, waiting: Iterable[Waiting], version: int, live: frozenset[str],
               timings: Timings, rules: RoundRules, rejoin: RejoinHold | None = None) -> Decision:
        """Merge now, or wait and until when (``Decision.wake_at``)."""
        view = self.observe(now, waiting, version, live, timings.step_time_s, rules)
        decision = decide(now, view, timings, rules.overlap, rules.policy)
        if decision.merge and rejoin is not None:
            hold = rejoin.hold(now, view.fresh or frozenset())
            if hold is not None:
                return dataclasses.replace(decision, merge=False, wake_at=hold,
                                           reason=f"rejoin hold: waiting for {sorted(rejoin.expected)}")
        return decision

    def close(self) -> tuple[float | None, float | None]:
        """The round merges: (opened_at, quorum_at) for the record; the next round starts empty."""
        opened = (self.opened_at, self.quorum_at)
        self.opened_at = self.quorum_at = None
        return opened

    @property
    def quorum_time_s(self) -> float:
        """Time from the round's opening to its quorum (0 until both happened)."""
        if self.opened_at is None or self.quorum_at is None:
            return 0.0
        return self.quorum_at - self.opened_at
