"""The weight guard (``ddiloco.algorithm.weight_guard``): bounds on the tokens an answer may claim."""

from __future__ import annotations

import pytest

from ddiloco.algorithm.weight_guard import WeightGuard, WeightGuardPolicy


def _answer(guard: WeightGuard, identity: str, tokens: int, steps: int) -> bool:
    """Judge an answer and, as the admission does, record it only when it is admitted."""
    verdict = guard.judge(tokens, steps)
    if verdict.accept:
        guard.record(identity, tokens, steps)
    return verdict.accept


def test_it_acts_from_the_first_answer_and_refuses_outliers_only() -> None:
    guard = WeightGuard(WeightGuardPolicy(action="reject", factor=4.0))
    assert guard.bound() is None
    assert _answer(guard, "a", 2048, 1), "no history yet: the first answer passes and is recorded"
    assert guard.bound() == 4.0 * 2048
    verdict = guard.judge(8 * 2048 * 4, 4)
    assert not verdict.accept and "16384 per step" in verdict.detail and "median 2048" in verdict.detail
    assert guard.bound() == 4.0 * 2048
    assert _answer(guard, "b", 3 * 2048 * 24, 24), "a learner with a 3x larger batch passes"
    assert guard.bound() == 4.0 * 2048, "the lower median of the learners' medians (2048, 6144)"


def test_judging_records_nothing() -> None:
    """An answer judged admissible may still be refused later (its payload, its norm): only the
    admission's record puts it in the history."""
    guard = WeightGuard(WeightGuardPolicy(action="reject", factor=8.0))
    _answer(guard, "a", 2000, 1)
    for _ in range(80):
        assert guard.judge(15_000, 1).accept  # each under 8 x 2000, none recorded
    assert guard.bound() == 8.0 * 2000


def test_the_warm_up_admits_at_most_factor_times_the_first_answers() -> None:
    """Before, the first ``min_history`` answers set the median unchecked."""
    guard = WeightGuard(WeightGuardPolicy(action="reject", factor=8.0, min_history=1))
    assert _answer(guard, "honest", 2000, 1)
    assert not _answer(guard, "liar", 100 * 2000, 1)
    assert _answer(guard, "liar", 7 * 2000, 1)
    assert guard.bound() == 8.0 * 2000


def test_one_learner_answering_just_under_the_bound_cannot_raise_it() -> None:
    """The issue's reproduction: 120 answers of one learner, each just under the bound, raised the
    weight bound from 2,000 to 986,072 (the median was the fleet's pool of answers)."""
    guard = WeightGuard(WeightGuardPolicy(action="reject", factor=8.0, window=64))
    for _ in range(8):
        for honest in ("h1", "h2"):
            assert _answer(guard, honest, 250 * 4, 4)
    start = guard.bound()
    assert start == 2000
    for _ in range(120):
        bound = guard.bound()
        assert bound is not None
        assert _answer(guard, "liar", int(bound * 0.99), 1)
    assert guard.bound() == start, "one identity counts once: the honest learners' figure stands"
    assert not guard.judge(60 * 250 * 4, 4).accept, "a 60x claim is still refused"


def test_a_hostile_learner_among_honest_ones_cannot_move_the_median() -> None:
    guard = WeightGuard(WeightGuardPolicy(action="reject", factor=4.0, window=16))
    refused = 0
    for _ in range(60):
        assert _answer(guard, "honest", 2048 * 24, 24)
        if not _answer(guard, "hostile", 100 * 2048 * 24, 24):
            refused += 1
    assert refused == 60 and guard.bound() == 4.0 * 2048


def test_off_weighs_every_answer_as_claimed_and_bad_settings_are_refused() -> None:
    guard = WeightGuard(WeightGuardPolicy(action="off", min_history=1))
    for _ in range(5):
        assert _answer(guard, "a", 10, 1)
    assert guard.judge(10**9, 1).accept
    assert guard.bound() is None
    for bad in ({"factor": 1.0}, {"factor": float("inf")}, {"window": 0}, {"min_history": 0},
                {"window": 4, "min_history": 5}):
        with pytest.raises(ValueError, match="weight guard"):
            WeightGuardPolicy(**bad)


def test_bound_merges_an_outlier_as_a_typical_learner() -> None:
    """``action: bound``: an answer claiming 100x the fleet's tokens per step is admitted with
    the typical tokens per step over its steps (its weight a typical learner's, not 10,000x), and
    recording it so keeps the fleet's figure where it was."""
    guard = WeightGuard(WeightGuardPolicy(action="bound", factor=8.0))
    for who in ("a", "b", "c"):
        assert _answer(guard, who, 2048 * 24, 24)
    verdict = guard.judge(100 * 2048 * 24, 24)
    assert verdict.accept and verdict.tokens == 2048 * 24
    assert "merged as 49152 tokens" in verdict.detail and "204800 per step" in verdict.detail
    guard.record("liar", verdict.tokens, 24)
    assert guard.bound() == 8.0 * 2048
    inside = guard.judge(8 * 2048 * 24, 24)
    assert inside.accept and inside.tokens is None, "within factor: merged as claimed"
    assert WeightGuard(WeightGuardPolicy(action="reject")).judge(1, 1).tokens is None
