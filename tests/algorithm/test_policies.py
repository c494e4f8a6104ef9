"""The merge policies (quorum, adaptive grace, token weights) against hand-computed cases.

References: docs/algorithm.md, synchronizer steps 2-4; paper Eq. 3 for the grace window
``clamp(gamma * (tau * step_time - quorum_time - sync_time), 0, max_grace)`` and Sec. 3.2 for
the token weights ``w_m = tok_m * (tok_m / steps_m)``, normalised.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from ddiloco.algorithm.policies import (
    QuorumPolicy,
    RoundView,
    Timings,
    decide,
    grace_window,
    quorum_reached,
    required_quorum,
    token_weights,
)
from ddiloco.core.averages import RunningAverage

# tau * step = 2 * 1.0, quorum 0.5, sync 0.3: slack 1.2 s, gamma 0.8 -> grace 0.96 s.
TIMINGS = Timings(step_time_s=1.0, quorum_time_s=0.5, sync_time_s=0.3)
TAU = 2
GRACE = 0.8 * 1.2


def view(contributors, live, opened_at=100.0, quorum_at=None):
    return RoundView(opened_at, quorum_at, frozenset(contributors), frozenset(live))


# -- token weights --------------------------------------------------------------------------------

def test_token_weights_hand_computed():
    # raw = tok^2 / steps: 100*10 = 1000 and 200*20 = 4000 -> 1/5, 4/5.
    assert token_weights([100, 200], [10, 10]) == pytest.approx([0.2, 0.8])
    # Same tokens, twice the steps (half the batch): 1000 vs 500 -> 2/3, 1/3.
    assert token_weights([100, 100], [10, 20]) == pytest.approx([2 / 3, 1 / 3])
    # Three learners: 40*40/4 = 400, 50*50/10 = 250, 30*30/3 = 300, over 950.
    assert token_weights([40, 50, 30], [4, 10, 3]) == pytest.approx([400 / 950, 250 / 950, 300 / 950])


def test_token_weights_sum_to_one_and_ignore_empty_contributions():
    w = token_weights([1000, 0, 500, 250], [7, 0, 3, 0])
    assert math.fsum(w) == pytest.approx(1.0)
    assert w[1] == 0.0 and w[3] == 0.0
    assert w == pytest.approx([1000**2 / 7 / (1000**2 / 7 + 500**2 / 3), 0.0,
                               500**2 / 3 / (1000**2 / 7 + 500**2 / 3), 0.0])


def test_token_weights_degenerate_inputs():
    assert token_weights([], []) == []
    assert token_weights([0, 0], [0, 5]) == [0.5, 0.5]  # nothing to go on: uniform
    assert token_weights([7], [3]) == [1.0]
    with pytest.raises(ValueError):
        token_weights([1, 2], [1])


# -- grace window ---------------------------------------------------------------------------------

def test_grace_between_the_clamps():
    grace, why = grace_window(TIMINGS, TAU, QuorumPolicy(grace_gamma=0.8, max_grace_s=10))
    assert grace == pytest.approx(GRACE)
    assert "gamma * slack" in why


def test_grace_clamped_to_zero_without_slack():
    # tau * step = 1.0 < quorum 0.7 + sync 0.6: the overlap is already spent.
    t = Timings(step_time_s=0.5, quorum_time_s=0.7, sync_time_s=0.6)
    grace, why = grace_window(t, TAU, QuorumPolicy())
    assert grace == 0.0
    assert "no slack" in why
    # tau = 0 (synchronous DiLoCo) never waits.
    assert grace_window(TIMINGS, 0, QuorumPolicy())[0] == 0.0


def test_grace_clamped_to_max():
    t = Timings(step_time_s=30.0, quorum_time_s=1.0, sync_time_s=1.0)  # slack 58 s
    grace, why = grace_window(t, TAU, QuorumPolicy(grace_gamma=0.5, max_grace_s=4.0))
    assert grace == 4.0
    assert "max_grace" in why
    # Exactly at the clamp: gamma * slack == max.
    assert grace_window(t, TAU, QuorumPolicy(grace_gamma=0.5, max_grace_s=29.0))[0] == 29.0


def test_grace_scales_with_gamma():
    for gamma in (0.0, 0.25, 0.9):
        assert grace_window(TIMINGS, TAU, QuorumPolicy(grace_gamma=gamma))[0] == pytest.approx(gamma * 1.2)


# -- decide ---------------------------------------------------------------------------------------

def test_no_contributions_waits_for_an_event():
    d = decide(100.0, view([], {"a", "b"}, opened_at=None), TIMINGS, TAU, QuorumPolicy())
    assert not d.merge and d.wake_at is None
    assert "no contributions" in d.reason


def test_quorum_not_reached_waits_without_deadline():
    policy = QuorumPolicy(quorum=2)
    d = decide(105.0, view({"a"}, {"a", "b", "c"}), TIMINGS, TAU, policy)
    assert not d.merge and d.wake_at is None
    assert "1/2" in d.reason


def test_all_live_contributed_merges_at_once_even_inside_grace():
    policy = QuorumPolicy(quorum=1, max_grace_s=10)
    d = decide(100.0, view({"a", "b"}, {"a", "b"}, quorum_at=100.0), TIMINGS, TAU, policy)
    assert d.merge
    assert "all 2 live learners" in d.reason
    # A departed learner's contribution still counts towards "everyone live is in".
    d = decide(100.0, view({"a", "b", "gone"}, {"a", "b"}, quorum_at=100.0), TIMINGS, TAU, policy)
    assert d.merge


def test_quorum_reached_waits_out_the_grace_then_merges():
    policy = QuorumPolicy(quorum=1, grace_gamma=0.8, max_grace_s=10)
    v = view({"a"}, {"a", "b", "c"}, quorum_at=100.5)
    d = decide(100.5, v, TIMINGS, TAU, policy)
    assert not d.merge
    assert d.wake_at == pytest.approx(100.5 + GRACE)
    assert d.grace_s == pytest.approx(GRACE)
    assert not decide(100.5 + GRACE - 1e-6, v, TIMINGS, TAU, policy).merge
    d = decide(100.5 + GRACE, v, TIMINGS, TAU, policy)
    assert d.merge and d.grace_s == pytest.approx(GRACE)
    assert "quorum 1/1" in d.reason


def test_quorum_reached_with_no_slack_merges_at_once():
    t = Timings(step_time_s=0.1, quorum_time_s=1.0, sync_time_s=1.0)
    d = decide(100.0, view({"a"}, {"a", "b"}, quorum_at=100.0), t, TAU, QuorumPolicy(quorum=1))
    assert d.merge and d.grace_s == 0.0


def test_grace_counts_from_quorum_not_from_round_open():
    # Quorum of 2 reached at 103 in a round opened at 100: the window runs to 103 + grace.
    policy = QuorumPolicy(quorum=2)
    v = view({"a", "b"}, {"a", "b", "c"}, opened_at=100.0, quorum_at=103.0)
    assert decide(103.5, v, TIMINGS, TAU, policy).wake_at == pytest.approx(103.0 + GRACE)


def test_streaming_timeout_merges_what_arrived():
    policy = QuorumPolicy(quorum=0, timeout_s=5.0)
    v = view({"a", "b"}, {"a", "b", "c"}, opened_at=100.0)
    d = decide(103.0, v, TIMINGS, TAU, policy)
    assert not d.merge and d.wake_at == pytest.approx(105.0)
    assert "2/3" in d.reason
    d = decide(105.0, v, TIMINGS, TAU, policy)
    assert d.merge and "timeout" in d.reason


def test_quorum_zero_means_every_live_learner():
    policy = QuorumPolicy(quorum=0)
    assert required_quorum(policy, 3) == 3
    assert required_quorum(policy, 0) == 1
    assert required_quorum(QuorumPolicy(quorum=2), 5) == 2
    assert not decide(100.0, view({"a", "b"}, {"a", "b", "c"}), TIMINGS, TAU, policy).merge
    assert decide(100.0, view({"a", "b", "c"}, {"a", "b", "c"}), TIMINGS, TAU, policy).merge
    reached, why = quorum_reached(view({"a"}, {"a", "b"}), policy)
    assert not reached and "1/2" in why


def test_quorum_larger_than_the_fleet_does_not_stall():
    # K=3 but only one learner is live: once it has contributed, everyone live is in.
    d = decide(100.0, view({"a"}, {"a"}), TIMINGS, TAU, QuorumPolicy(quorum=3))
    assert d.merge


@pytest.mark.parametrize("quorum", [0, 1, 3])
def test_with_no_live_learner_what_arrived_merges_at_once(quorum):
    # Every learner finished or dropped out after contributing: nobody else is coming, so the
    # work is merged at once, not lost and not held for a grace window.
    d = decide(100.0, view({"a"}, set(), quorum_at=100.0), TIMINGS, TAU, QuorumPolicy(quorum=quorum))
    assert d.merge and d.reason.startswith("no live learner")


# -- policy validation and running averages --------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"quorum": -1}, {"grace_gamma": 1.0}, {"grace_gamma": -0.1}, {"max_grace_s": -1.0}, {"timeout_s": 0.0},
])
def test_policy_validation(kwargs):
    with pytest.raises(ValueError):
        QuorumPolicy(**kwargs)


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QuorumPolicy().quorum = 2  # type: ignore[misc]


def test_running_average():
    avg = RunningAverage(alpha=0.2)
    assert avg.get() == 0.0 and avg.get(default=3.0) == 3.0
    assert avg.update(10.0) == 10.0          # the first sample initialises
    assert avg.update(20.0) == pytest.approx(12.0)
    assert avg.update(float("nan")) == pytest.approx(12.0)   # ignored
    assert avg.update(float("inf")) == pytest.approx(12.0)
    assert avg.get() == pytest.approx(12.0)
    assert RunningAverage(alpha=1.0).update(5.0) == 5.0
    seeded = RunningAverage(alpha=0.5, initial=4.0)
    assert seeded.update(8.0) == 6.0
    for alpha in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            RunningAverage(alpha=alpha)


def test_stale_leftovers_do_not_count_as_everyone_contributed() -> None:
    from ddiloco.algorithm.policies import QuorumPolicy, RoundView, Timings, decide

    live = frozenset({"a", "b", "c"})
    policy = QuorumPolicy(quorum=1, grace_gamma=0.5, max_grace_s=10.0)
    timings = Timings(step_time_s=1.0)
    # b and c only have contributions from the previous round: wait out the grace, don't merge at once
    view = RoundView(100.0, 100.0, live, live, fresh=frozenset({"a"}))
    d = decide(100.1, view, timings, 2, policy)
    assert not d.merge and d.wake_at == 101.0
    assert decide(101.0, view, timings, 2, policy).merge
    # all three fresh: at once
    assert decide(100.1, RoundView(100.0, 100.0, live, live, fresh=live), timings, 2, policy).merge


def test_quorum_zero_waits_for_each_live_learner_not_for_as_many_answers():
    # b finished (no longer live) and its last contribution waits; a still trains. Counted as an
    # answer, b's met "every live learner" (1 of 1) and the round merged without a, a step early.
    policy = QuorumPolicy(quorum=0, timeout_s=120.0)
    v = view({"b"}, {"a"}, opened_at=100.0)
    reached, why = quorum_reached(v, policy)
    assert not reached and "0/1" in why and "1 from learners no longer live" in why
    d = decide(100.5, v, TIMINGS, TAU, policy)
    assert not d.merge and d.wake_at == pytest.approx(220.0)
    assert decide(100.5, view({"a", "b"}, {"a"}, opened_at=100.0), TIMINGS, TAU, policy).merge
    assert decide(220.0, v, TIMINGS, TAU, policy).merge, "the merge timeout still ends the wait"
    # a quorum of K answers still counts anyone's: a finishing learner's last progress is one
    assert quorum_reached(v, QuorumPolicy(quorum=1))[0]
