"""The fleet's clock (``ddiloco.algorithm.fleet_clock``): who paces it, and which round falls due when.

Checked against the definition (docs/algorithm.md, "Fragments" and "Who clocks a round"): fragment
p falls due at fleet steps t >= 1 with t mod H == floor(p*H/P), the fleet's steps counted at the
pace of the K-th fastest live learner, with the time injected.
"""

from __future__ import annotations

import pytest

from ddiloco.algorithm.fleet_clock import FleetClock, fleet_pace, last_merged_step
from ddiloco.fragments.schedule import FragmentSchedule

SCHEDULE = FragmentSchedule(num_fragments=4, sync_every=4, overlap=1)  # offsets 0, 1, 2, 3


def test_the_pace_is_the_kth_fastest_learner() -> None:
    times = [0.5, 0.2, 1.0, 0.3]
    assert fleet_pace(times, 1) == 0.2
    assert fleet_pace(times, 2) == 0.3
    assert fleet_pace(times, 0) == 1.0, "quorum 0 waits for every live learner: the slowest paces"
    assert fleet_pace(times, 9) == 1.0, "a quorum above the fleet is every learner"
    assert fleet_pace([0.0, float("nan")], 1) is None, "no learner has reported a step yet"


def test_each_fragment_falls_due_once_per_period_at_its_offset() -> None:
    clock = FleetClock(SCHEDULE, now=0.0)
    assert clock.due(100.0) == [] and clock.next_due_at(100.0) is None, "no pace: stopped"
    clock.set_pace(100.0, 0.5)
    assert clock.next_due_at(100.0) == pytest.approx(100.5)  # fleet step 1: fragment 1
    assert clock.due(100.49) == []
    assert clock.due(100.5) == [(1, 1)]
    assert clock.due(102.0) == [(2, 1), (3, 1), (0, 1)]  # fleet steps 2, 3, 4
    assert clock.due(104.0) == [(1, 2), (2, 2), (3, 2), (0, 2)]
    assert clock.steps == pytest.approx(8.0)


def test_a_new_pace_applies_from_when_it_is_set() -> None:
    clock = FleetClock(SCHEDULE, now=0.0)
    clock.set_pace(0.0, 1.0)
    clock.set_pace(2.0, 0.25)  # two steps at the old pace, then four per second
    assert clock.steps == pytest.approx(2.0)
    assert clock.due(2.5) == [(1, 1), (2, 1), (3, 1), (0, 1)]
    clock.set_pace(2.5, None)  # everybody left: the clock stops
    assert clock.due(1000.0) == [] and clock.steps == pytest.approx(4.0)


def test_many_fragments_per_step_and_one_fragment() -> None:
    many = FleetClock(FragmentSchedule(num_fragments=8, sync_every=4, overlap=1), now=0.0)
    many.set_pace(0.0, 1.0)
    assert [p for p, _ in many.due(1.0)] == [2, 3], "two fragments share each offset"
    diloco = FleetClock(FragmentSchedule(num_fragments=1, sync_every=24, overlap=0), now=0.0)
    diloco.set_pace(0.0, 0.1)
    assert diloco.due(2.39) == [] and diloco.due(2.4) == [(0, 1)] and diloco.due(4.8) == [(0, 2)]


def test_a_jump_opens_each_fragment_once_with_its_newest_round() -> None:
    clock = FleetClock(SCHEDULE, now=0.0)
    clock.set_pace(0.0, 0.5)
    # 201 fleet steps at once (H=4): fragment 1 fell due at steps 1, 5, ..., 201 (51 rounds), the
    # others 50 times; each opens once, in the order of its last due step (198, 199, 200, 201)
    assert clock.due(100.5) == [(2, 50), (3, 50), (0, 50), (1, 51)]
    assert clock.due(101.0) == [(2, 51)]  # and on from there as before
    fast = FleetClock(SCHEDULE, now=0.0)
    fast.set_pace(0.0, 1e-300)  # a pace nobody can have: still one request per fragment per call
    assert len(fast.due(1.0)) == 4


def test_last_merged_step_is_the_due_step_of_the_newest_round():
    schedule = FragmentSchedule(num_fragments=24, sync_every=24, overlap=2)
    assert last_merged_step({}, schedule) == 0
    assert last_merged_step({p: 0 for p in range(24)}, schedule) == 0
    # fragment p (p >= 1) first falls due at step p, fragment 0 at step 24; version v is the v-th
    versions = {0: 8, 1: 9, 2: 9, 3: 9, 4: 9, **{p: 8 for p in range(5, 24)}}
    assert last_merged_step(versions, schedule) == 4 + 8 * 24  # fragment 4's 9th round: the fleet is past 196
    assert last_merged_step({0: 1}, schedule) == 24
    # a learner that starts here answers fragment 5 next, the round the fleet waits on
    assert schedule.due(last_merged_step(versions, schedule) + 1) == [5]
