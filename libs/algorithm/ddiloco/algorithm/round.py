"""One fragment's merge round as a pure state machine, driven by an injected clock.

The synchronizer service (one asyncio task per fragment) and the fleet simulator (one event loop
for millions of chips) both run their rounds through ``RoundState``, so what the simulator
measures is what the service does. Nothing here reads a clock, touches tensors or does I/O: the
caller passes ``now``, what waits in the inbox, the fragment's version and who is live.

Decisions, and why:

- **A round opens when the fragment falls due** on the fleet's clock (``fleet_clock``) and the
  synchronizer asks every live learner for it (``open``); the quorum time of the grace window is
  measured from that request. Contributions that arrive between rounds (a late answer, a
  learner's last progress as it finishes) wait for the next request, where stale ones are
  re-anchored. With nobody live left to ask, waiting contributions open a round at once (the end
  of a finite run).
- **Where learners wait for merges** (streaming, diloco) they send at their own due steps, and a
  round opens with its first fresh contribution (``RoundRules.learner_clocked``; see
  ``ddiloco.core.modes`` for why).
- **The quorum counts answers to the open round.** Each contribution carries the round of the
  request it answers (0: unsolicited, such as a learner's last progress as it finishes). Where
  the synchronizer clocks rounds, K counts the contributions that answer the open round or an
  earlier request of it that went unmerged (and unsolicited progress on the current version, such
  as a finishing learner's, and whatever waits from a learner the request did not reach); a
  leftover (a late answer to a round that already merged, from a learner that was asked again)
  still merges in this round, re-anchored where its base is older,
  but never makes the quorum: with K = 1 a leftover would otherwise meet the quorum
  the moment the request goes out, the round's quorum time would read 0, and only the grace
  window would keep the fresh answers in. Where learners clock rounds, the answers are the
  contributions against the current version.
- **Every request re-opens the round** (unless its quorum has latched and its grace is running),
  so its quorum time counts from the request that is being answered, as the grace window's
  formula means it. A merge timeout counts from the first request that found the inbox empty, so
  contributions that wait for a quorum that cannot come are merged when it runs out.
- **"Every live learner has contributed" counts answers only**: a leftover says nothing about
  whether the learner's answer to this round is near.
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
    round: int = 0
    """The round of the request it answers (0: unsolicited)."""


@dataclass(frozen=True, kw_only=True)
class RoundRules:
    """The constants a round is decided by."""

    policy: QuorumPolicy
    """Quorum K, grace gamma and clamp, merge timeout."""
    overlap: int
    """tau: the overlap whose slack the grace window spends."""
    learner_clocked: bool = False
    """Learners send at their own due steps (the modes where they wait for merges): a round opens
    with its first fresh contribution instead of a request."""


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
class StartHold:
    """A new fleet's first merges wait until ``learners`` learners are live at once, at most
    ``window_s`` from the first merge the hold stopped (0 learners: no hold).

    The synchronous modes need it: every merge waits for every live learner, so a learner that
    starts alone merges its first rounds alone and runs ahead; a learner joining then is out of
    phase, each waits for a round the other cannot reach until it is unblocked, and both stand
    still until the round timeout. Held from the start, the first learner is stopped by its first
    round (at most ``overlap`` steps ahead) until the others' first contributions arrive."""

    learners: int = 0
    window_s: float = 60.0
    until: float | None = None
    """Set when the hold first stops a merge."""
    released: bool = False

    def hold(self, now: float, live: frozenset[str]) -> float | None:
        """Until when a merge waits (None: it may go on). Released for good once enough learners
        were live at once or the window has passed."""
        if self.released or self.learners <= 0 or len(live) >= self.learners:
            self.released = True
            return None
        if self.until is None:
            self.until = now + self.window_s
        if now >= self.until:
            self.released = True
            return None
        return self.until


@dataclass
class RoundState:
    """The open round of one fragment: which round, when it was requested, when it reached its quorum."""

    round: int = 0
    opened_at: float | None = None
    quorum_at: float | None = None
    since: float | None = None
    """When the contributions now waiting were first asked for (the merge timeout counts from it)."""
    asked: frozenset[str] | None = None
    """The learners the round's request reached (None: every one)."""
    first: int = 0
    """The first round requested since the last merge (0: none yet). An answer to it or to any
    later one is an answer to this merge: a request that re-opens a round that did not merge
    takes nothing from the answers to the one before, or a fleet whose answers take longer than
    a round would never merge."""

    def open(self, now: float, round_no: int, *, waiting: bool, asked: frozenset[str] | None = None) -> None:
        """The fragment fell due and every live learner was asked for it (``waiting``: the inbox
        already holds contributions; ``asked``: the learners the request reached). A round whose
        quorum has latched keeps its grace deadline; any other starts counting from this request."""
        self.round, self.asked = round_no, asked
        if not self.first or round_no < self.first:
            self.first = round_no
        if self.quorum_at is None:
            self.opened_at = now
        if self.since is None or not waiting:
            self.since = now

    def observe(self, now: float, waiting: Iterable[Waiting], version: int, live: frozenset[str],
                rules: RoundRules) -> RoundView:
        """Bring the round up to ``now`` (its quorum may latch) and describe it."""
        waiting = list(waiting)
        fresh_arrivals = [w.arrived_at for w in waiting if w.base_version == version]
        if self.opened_at is None and rules.learner_clocked and fresh_arrivals:
            self.opened_at = min(fresh_arrivals)
        if self.opened_at is None and waiting and not live:
            self.opened_at = now  # nobody left to ask: what waits is all there will be
        if self.since is None:
            self.since = self.opened_at
        contributors = frozenset(w.learner_id for w in waiting)
        fresh = frozenset(w.learner_id for w in waiting if w.base_version == version)
        if rules.learner_clocked:
            answered = fresh
        else:  # answers to this request, unsolicited progress on the current version, and the last
            # word of a learner this request did not reach (it was down when it went out)
            answered = frozenset(w.learner_id for w in waiting
                                 if (self.round and self.first <= w.round <= self.round)
                                 or (w.round == 0 and w.base_version == version)
                                 or (self.asked is not None and w.learner_id not in self.asked))
        view = RoundView(self.opened_at, self.quorum_at, contributors, live, fresh, answered, self.since)
        if self.opened_at is not None and self.quorum_at is None and quorum_reached(view, rules.policy)[0]:
            self.quorum_at = now
            view = dataclasses.replace(view, quorum_at=now)
        return view

    def decide(self, now: float, waiting: Iterable[Waiting], version: int, live: frozenset[str],
               timings: Timings, rules: RoundRules, rejoin: RejoinHold | None = None,
               start: StartHold | None = None) -> Decision:
        """Merge now, or wait and until when (``Decision.wake_at``)."""
        view = self.observe(now, waiting, version, live, rules)
        decision = decide(now, view, timings, rules.overlap, rules.policy)
        if decision.merge and start is not None:
            until = start.hold(now, live)
            if until is not None:
                return dataclasses.replace(decision, merge=False, wake_at=until,
                                           reason=f"start hold: waiting for {start.learners} learners "
                                                  f"({len(live)} live)")
        if decision.merge and rejoin is not None:
            hold = rejoin.hold(now, view.fresh or frozenset())
            if hold is not None:
                return dataclasses.replace(decision, merge=False, wake_at=hold,
                                           reason=f"rejoin hold: waiting for {sorted(rejoin.expected)}")
        return decision

    def close(self) -> tuple[float | None, float | None]:
        """The round merges: (opened_at, quorum_at) for the record; the next round starts empty."""
        opened = (self.opened_at, self.quorum_at)
        self.opened_at = self.quorum_at = self.since = None
        self.first = 0
        return opened

    @property
    def quorum_time_s(self) -> float:
        """Time from the round's opening to its quorum (0 until both happened)."""
        if self.opened_at is None or self.quorum_at is None:
            return 0.0
        return self.quorum_at - self.opened_at
