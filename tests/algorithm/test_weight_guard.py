"""The weight guard (``ddiloco.algorithm.weight_guard``): bounds on the tokens an answer may claim."""

from __future__ import annotations

import pytest

from ddiloco.algorithm.weight_guard import WeightGuard, WeightGuardPolicy


def test_it_records_until_it_knows_the_fleet_then_refuses_outliers_only() -> None:
    guard = WeightGuard(WeightGuardPolicy(factor=4.0, min_history=3))
    assert guard.judge(100_000, 1).accept, "no history yet: everything passes and is recorded"
    for _ in range(2):
        assert guard.judge(2048, 1).accept
    assert guard.bound() == 4.0 * 2048  # median of (100000, 2048, 2048)
    verdict = guard.judge(8 * 2048 * 4, 4)
    assert not verdict.accept and "16384 per step" in verdict.detail and "median 2048" in verdict.detail
    assert guard.bound() == 4.0 * 2048, "refused answers never enter the history"
    assert guard.judge(3 * 2048 * 24, 24).accept, "a learner with a 3x larger batch passes"
    assert guard.bound() == 4.0 * (2048 + 3 * 2048) / 2  # median of (100000, 2048, 2048, 6144)


def test_a_hostile_learner_among_honest_ones_cannot_move_the_median() -> None:
    guard = WeightGuard(WeightGuardPolicy(factor=4.0, min_history=8, window=16))
    refused = 0
    for _ in range(60):
        honest = guard.judge(2048 * 24, 24)
        assert honest.accept
        if not guard.judge(100 * 2048 * 24, 24).accept:
            refused += 1
    assert refused >= 55 and guard.bound() == 4.0 * 2048


def test_off_weighs_every_answer_as_claimed_and_bad_settings_are_refused() -> None:
    guard = WeightGuard(WeightGuardPolicy(action="off", min_history=1))
    for _ in range(5):
        assert guard.judge(10, 1).accept
    assert guard.judge(10**9, 1).accept
    for bad in ({"factor": 1.0}, {"factor": float("inf")}, {"window": 0}, {"min_history": 0},
                {"window": 4, "min_history": 5}):
        with pytest.raises(ValueError, match="weight guard"):
            WeightGuardPolicy(**bad)
