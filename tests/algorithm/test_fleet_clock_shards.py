"""Two shards count the fleet's steps each on its own clock, from the same learners' heartbeats
arriving at different moments (each shard's stream beats on its own interval). Their counts differ
by at most the steps the fleet makes in the time between the two shards' heartbeats (the
differences of every pace change telescope: they never accumulate), and every fragment, asked only
by the shard that owns it, is asked once per period of that shard's clock."""

from __future__ import annotations

import random

from ddiloco.algorithm.fleet_clock import FleetClock
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.protocol.shards import owner

P, H, SHARDS = 8, 8, 2
BEAT_S = 1.0
LAG_S = 0.37
"""Shard 1's stream beats this long after shard 0's."""


def _steps_at(clock: FleetClock, now: float) -> float:
    """The clock's count at ``now``, without advancing it."""
    return clock.steps + ((now - clock.at) / clock.pace_s if clock.pace_s else 0.0)


def test_two_shard_clocks_differ_by_one_heartbeat_lag_of_steps_and_ask_each_fragment_once_per_period():
    rng = random.Random(3)
    schedule = FragmentSchedule(num_fragments=P, sync_every=H, overlap=2)
    clocks = [FleetClock(schedule, now=0.0) for _ in range(SHARDS)]
    lags = [0.0, LAG_S]
    pace = 0.1
    worst = 0.0
    for beat in range(1, 600):  # ten minutes of a learner whose step time wanders by up to 20% a beat
        pace = min(0.3, max(0.05, pace * rng.uniform(0.8, 1.2)))
        for s, clock in enumerate(clocks):
            at = beat * BEAT_S + lags[s]
            clock.due(at)
            clock.set_pace(at, pace)
        now = beat * BEAT_S + LAG_S + 0.5  # both clocks at the same pace again
        gap = abs(_steps_at(clocks[0], now) - _steps_at(clocks[1], now))
        assert gap <= LAG_S / pace + 1e-6, (beat, gap, LAG_S / pace)
        worst = max(worst, gap)
    assert worst > 0, "the clocks never differed: the test does not exercise the lag"
    for s, clock in enumerate(clocks):
        total = clock.steps
        for p in range(P):
            if owner(p, SHARDS) != s:
                continue
            # once per period: its rounds are exactly the periods its shard's clock went through
            first = schedule.next_due_step(p, 0)
            expected = int((total - first) // H) + 1 if total >= first else 0
            assert clock.rounds[p] == expected, (s, p, clock.rounds[p], expected)
