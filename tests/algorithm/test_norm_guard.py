"""The norm guard's rule: per-step norms against the median of recent accepted ones."""

from __future__ import annotations

import math

import pytest

from ddiloco.algorithm.norm_guard import NormGuard, NormGuardPolicy


def _warm(guard: NormGuard, fragment: int = 0, norms=(1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.05, 0.95)) -> None:
    for n in norms:
        assert guard.judge(fragment, n * 4, steps=4).action == "accept"


def test_reject_is_the_default():
    assert NormGuardPolicy().action == "reject"


def test_off_accepts_anything_and_keeps_no_history():
    guard = NormGuard(NormGuardPolicy(action="off"))
    assert guard.judge(0, 1e30, steps=1).action == "accept"
    assert guard.bound(0) is None


def test_nothing_is_judged_before_min_history():
    guard = NormGuard(NormGuardPolicy(action="reject", min_history=8))
    _warm(guard, norms=(1.0,) * 7)
    assert guard.judge(0, 1000.0, steps=1).action == "accept"  # the 8th norm: still only recorded


def test_reject_an_outlier_and_keep_it_out_of_the_history():
    guard = NormGuard(NormGuardPolicy(action="reject", factor=10.0))
    _warm(guard)
    assert guard.bound(0) == pytest.approx(10.0)
    verdict = guard.judge(0, 100.0 * 4, steps=4)
    assert verdict.action == "reject" and "exceeds 10x" in verdict.detail
    for _ in range(20):  # a stream of outliers never moves the median
        assert guard.judge(0, 400.0, steps=4).action == "reject"
    assert guard.bound(0) == pytest.approx(10.0)
    assert guard.judge(0, 9.0 * 4, steps=4).action == "accept"  # within k x median


def test_norm_is_per_step_so_a_longer_contribution_is_not_an_outlier():
    guard = NormGuard(NormGuardPolicy(action="reject", factor=10.0))
    _warm(guard)
    assert guard.judge(0, 30.0 * 4, steps=4 * 12).action == "accept"  # 12 syncs' worth of steps


def test_clip_scales_down_to_the_bound():
    guard = NormGuard(NormGuardPolicy(action="clip", factor=10.0))
    _warm(guard)
    verdict = guard.judge(0, 1000.0, steps=4)
    assert verdict.action == "clip"
    assert 1000.0 / 4 * verdict.scale == pytest.approx(10.0)


def test_fragments_have_their_own_history():
    guard = NormGuard(NormGuardPolicy(action="reject", factor=10.0))
    _warm(guard, fragment=0)
    _warm(guard, fragment=1, norms=(100.0,) * 8)
    assert guard.judge(1, 500.0 * 4, steps=4).action == "accept"
    assert guard.judge(0, 500.0 * 4, steps=4).action == "reject"


def test_window_forgets_old_norms():
    guard = NormGuard(NormGuardPolicy(action="reject", factor=10.0, window=8, min_history=4))
    _warm(guard, norms=(100.0,) * 8)
    _warm(guard, norms=(1.0,) * 8)  # training calmed down: only recent norms count
    assert guard.bound(0) == pytest.approx(10.0)


def test_non_finite_norms_stay_out_of_the_history():
    guard = NormGuard(NormGuardPolicy(action="reject", min_history=1))
    guard.judge(0, math.inf, steps=1)
    assert guard.bound(0) is None


@pytest.mark.parametrize("kw, message", [
    ({"factor": 1.0}, "factor"), ({"factor": math.inf}, "factor"),
    ({"window": 0}, "window"), ({"min_history": 0}, "min_history"), ({"window": 4, "min_history": 5}, "min_history"),
])
def test_bad_policies_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        NormGuardPolicy(action="reject", **kw)
