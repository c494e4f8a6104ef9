"""The fleet's clock: which fragment falls due when, counted by the synchronizer.

Rounds are clocked by the synchronizer, not by each learner. Fragment p falls due at fleet steps
t >= 1 with ``t mod H == floor(p*H/P)`` (``FragmentSchedule``), and the fleet's step count advances
at the pace of the K-th fastest live learner (K the quorum; every live learner when K is 0). When
p falls due the synchronizer asks every live learner for it, and each answers at its next
inner-step boundary with however many steps it made since its last contribution of p. Learners at
different speeds thus contribute to the *same* round with different amounts of work, which the
token weights account for.

Why the synchronizer: when each learner sent p at its own step offset, learners at different
speeds sent the same fragment many steps apart, so with quorum 1 a round merged the first fresh
contribution and the others arrived for the next round, a version stale (measured: 56% of all
merged contributions stale, eval loss +22% against data-parallel in a default 3-learner run).

Why the K-th fastest pace: a round needs K answers; at that pace the K-th learner answers each
request within one of its own steps, so the quorum is met without waiting for slower learners and
without asking faster than the quorum can answer. The pace comes from the learners' reported wall
time per step (heartbeats), so in modes where learners wait for merges the waiting counts too and
every learner makes about H steps per period.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ddiloco.fragments.schedule import FragmentSchedule


def fleet_progress(fleet_step: int, versions: dict[int, int], sync_every: int, steps: int) -> int:
    """The step a learner joining a fleet that is already training starts after: the further of
    the synchronizer's fleet step (its clock; it starts again from 0 when the synchronizer
    restarts) and the durable progress in the fragments' versions (each version is one round of
    ``sync_every`` steps; the least advanced fragment counts), at most ``steps``."""
    durable = min(versions.values(), default=0) * sync_every
    return max(0, min(steps, max(int(fleet_step), durable)))


def last_merged_step(versions: dict[int, int], schedule: FragmentSchedule) -> int:
    """The step of the fleet's last merged round, from the fragments' versions: version v of
    fragment p is the merge of its v-th due step. Where learners wait for merges (streaming,
    diloco), each sends a fragment at its own due steps, so a learner that joins a fleet already
    training must count its steps from here: in phase with the fleet, it answers the rounds the
    others are waiting on. Behind it (say, from the least advanced fragment), it would answer
    rounds that already merged and then wait for their next merge, which the others reach only
    after rounds that wait for its answers: a deadlock broken only by the merge timeout."""
    return max((schedule.next_due_step(p, 0) + (v - 1) * schedule.sync_every for p, v in versions.items() if v > 0),
               default=0)


def fleet_pace(step_times_s: Iterable[float], quorum: int) -> float | None:
    """Seconds per fleet step: the K-th smallest positive step time (K = quorum; 0: the largest),
    None when nobody has reported one."""
    times = sorted(t for t in step_times_s if t > 0 and math.isfinite(t))
    if not times:
        return None
    k = len(times) if quorum <= 0 else min(quorum, len(times))
    return times[k - 1]


class FleetClock:
    """The fleet's step count F, advanced with an injected clock, and the rounds that fall due."""

    def __init__(self, schedule: FragmentSchedule, *, now: float) -> None:
        self.schedule = schedule
        self.steps = 0.0
        """F: fleet steps counted so far."""
        self.at = now
        """When ``steps`` was last brought up to date."""
        self.pace_s: float | None = None
        """Seconds per fleet step (None: stopped, nobody to pace it)."""
        self.rounds = [0] * schedule.num_fragments
        """Rounds that fell due per fragment."""
        self._next = [schedule.next_due_step(p, 0) for p in range(schedule.num_fragments)]

    def set_pace(self, now: float, pace_s: float | None) -> None:
        """Count up to ``now`` at the old pace, then go on at ``pace_s``."""
        self._advance(now)
        self.pace_s = pace_s

    def _advance(self, now: float) -> None:
        if now > self.at and self.pace_s:
            self.steps += (now - self.at) / self.pace_s
        self.at = max(self.at, now)

    def due(self, now: float) -> list[tuple[int, int]]:
        """(fragment, round) of every fragment that fell due up to ``now``, in order of the step
        it fell due at. A fragment that fell due several times since the last call (the clock
        jumped: a stalled loop, a pace reported far too fast) appears once, with its newest
        round: the older ones would be superseded at once. So one call costs O(fragments)
        however far the clock moved."""
        self._advance(now)
        h = self.schedule.sync_every
        out: list[tuple[float, int, int]] = []
        for p, next_step in enumerate(self._next):
            if next_step > self.steps + 1e-9:
                continue
            k = int((self.steps + 1e-9 - next_step) // h) + 1
            self.rounds[p] += k
            self._next[p] = next_step + k * h
            out.append((next_step + (k - 1) * h, p, self.rounds[p]))
        return [(p, r) for _, p, r in sorted(out)]

    def next_due_at(self, now: float) -> float | None:
        """When the next fragment falls due at the current pace (None while stopped)."""
        if not self.pace_s:
            return None
        self._advance(now)
        return self.at + max(0.0, min(self._next) - self.steps) * self.pace_s
