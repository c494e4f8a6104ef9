"""Fragment schedule: fragment p falls due at steps t >= 1 with t mod H == floor(p*H/P).

Checked against the definition itself (docs/algorithm.md, "Fragments"; Streaming DiLoCo's staggered offsets) by
brute force over every step of several periods.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.fragments.schedule import FragmentSchedule

SETTINGS = settings(max_examples=80, deadline=None)


@st.composite
def schedules(draw):  # type: ignore[no-untyped-def]
    h = draw(st.integers(1, 48))
    return FragmentSchedule(num_fragments=draw(st.integers(1, 60)), sync_every=h, overlap=draw(st.integers(0, h - 1)))


@SETTINGS
@given(schedule=schedules(), start=st.integers(1, 500))
def test_every_fragment_falls_due_exactly_once_per_period(schedule: FragmentSchedule, start: int) -> None:
    h, p = schedule.sync_every, schedule.num_fragments
    counts = [0] * p
    for step in range(start, start + h):  # any window of H consecutive steps
        for frag in schedule.due(step):
            counts[frag] += 1
    assert counts == [1] * p


@SETTINGS
@given(schedule=schedules())
def test_due_matches_the_definition(schedule: FragmentSchedule) -> None:
    h, p = schedule.sync_every, schedule.num_fragments
    for frag in range(p):
        assert schedule.offset(frag) == frag * h // p
    for step in range(1, 3 * h + 2):
        assert schedule.due(step) == [f for f in range(p) if step % h == (f * h) // p]


@pytest.mark.parametrize("h", [1, 2, 5, 24])
def test_p_equals_h_gives_one_fragment_per_step(h: int) -> None:
    schedule = FragmentSchedule(num_fragments=h, sync_every=h, overlap=min(2, h - 1))
    seen = []
    for step in range(1, 4 * h + 1):
        due = schedule.due(step)
        assert len(due) == 1
        seen.append(due[0])
    assert seen[:h] == [*range(1, h), 0]  # step t carries fragment t mod H


def test_diloco_preset_syncs_the_whole_model_every_h_steps() -> None:
    schedule = FragmentSchedule(num_fragments=1, sync_every=10, overlap=0)
    assert [t for t in range(1, 41) if schedule.due(t)] == [10, 20, 30, 40]
    assert schedule.apply_step(10) == 10


def test_no_fragment_due_before_the_first_step() -> None:
    schedule = FragmentSchedule(num_fragments=4, sync_every=4)
    assert schedule.due(0) == [] and schedule.due(-3) == []


@SETTINGS
@given(schedule=schedules(), after=st.integers(0, 300))
def test_next_due_step_is_the_first_due_step_after(schedule: FragmentSchedule, after: int) -> None:
    for frag in range(schedule.num_fragments):
        nxt = schedule.next_due_step(frag, after)
        assert nxt > after and frag in schedule.due(nxt)
        assert all(frag not in schedule.due(t) for t in range(after + 1, nxt))
        assert nxt - after <= schedule.sync_every


def test_next_due_step_before_the_start() -> None:
    schedule = FragmentSchedule(num_fragments=4, sync_every=4)
    for after in range(-12, 0):
        for frag in range(4):
            nxt = schedule.next_due_step(frag, after)
            assert nxt >= 1 and frag in schedule.due(nxt)
            assert all(frag not in schedule.due(t) for t in range(1, nxt))


@SETTINGS
@given(schedule=schedules(), sent=st.integers(1, 1000))
def test_apply_step_is_tau_after_sending(schedule: FragmentSchedule, sent: int) -> None:
    assert schedule.apply_step(sent) == sent + schedule.overlap


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_fragments": 0, "sync_every": 4}, "num_fragments"),
    ({"num_fragments": -1, "sync_every": 4}, "num_fragments"),
    ({"num_fragments": 2, "sync_every": 0}, "sync_every"),
    ({"num_fragments": 2, "sync_every": 4, "overlap": -1}, "overlap"),
    ({"num_fragments": 2, "sync_every": 4, "overlap": 4}, "overlap"),
])
def test_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FragmentSchedule(**kwargs)


def test_offset_out_of_range_raises() -> None:
    schedule = FragmentSchedule(num_fragments=3, sync_every=6)
    for bad in (-1, 3):
        with pytest.raises(ValueError):
            schedule.offset(bad)
    with pytest.raises(ValueError):
        schedule.next_due_step(3, 0)


def test_schedule_is_frozen_and_keyword_only() -> None:
    schedule = FragmentSchedule(num_fragments=2, sync_every=4)
    with pytest.raises(AttributeError):
        schedule.sync_every = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        FragmentSchedule(2, 4)  # type: ignore[misc]
