"""The pure round state machine (``ddiloco.algorithm.round``), driven by an injected clock.

Every decision a fragment's round makes, checked by passing ``now`` explicitly: no server, no
sleeps. The service's asyncio rounds and the fleet simulator both run these functions.
"""

from __future__ import annotations

import pytest

from ddiloco.algorithm.policies import QuorumPolicy, Timings
from ddiloco.algorithm.round import (
    RejoinHold,
    RoundRules,
    RoundState,
    Verdict,
    Waiting,
    participation_scale,
    staleness_verdict,
)

RULES = RoundRules(policy=QuorumPolicy(quorum=1, grace_gamma=0.5, max_grace_s=10.0), overlap=2, sync_every=4,
                   stale_round_s=30.0)
TIMINGS = Timings(step_time_s=1.0, quorum_time_s=0.0, sync_time_s=0.0)  # grace = 0.5 * 2 * 1.0 = 1.0 s
LIVE = frozenset({"a", "b", "c"})


def w(lid: str, base: int, at: float) -> Waiting:
    return Waiting(lid, base, at)


def test_a_round_opens_with_its_first_fresh_contribution_and_latches_its_quorum() -> None:
    s = RoundState()
    d = s.decide(10.0, [w("a", 5, 9.5)], 5, LIVE, TIMINGS, RULES)
    assert (s.opened_at, s.quorum_at) == (9.5, 10.0)
    assert not d.merge and d.wake_at == pytest.approx(11.0) and d.grace_s == pytest.approx(1.0)
    d = s.decide(10.5, [w("a", 5, 9.5), w("b", 5, 10.4)], 5, LIVE, TIMINGS, RULES)
    assert s.quorum_at == 10.0 and not d.merge, "later arrivals do not move the grace window"
    d = s.decide(11.0, [w("a", 5, 9.5), w("b", 5, 10.4)], 5, LIVE, TIMINGS, RULES)
    assert d.merge and "elapsed" in d.reason
    assert s.quorum_time_s == pytest.approx(0.5)
    assert s.close() == (9.5, 10.0) and (s.opened_at, s.quorum_at) == (None, None)


def test_every_live_learner_fresh_merges_at_once_but_stale_leftovers_do_not_count() -> None:
    s = RoundState()
    waiting = [w("a", 5, 1.0), w("b", 5, 1.1), w("c", 4, 1.2)]
    d = s.decide(1.3, waiting, 5, LIVE, TIMINGS, RULES)
    assert not d.merge, "c's contribution is from the previous version: its next one is not here yet"
    d = s.decide(1.3, [*waiting[:2], w("c", 5, 1.25)], 5, LIVE, TIMINGS, RULES)
    assert d.merge and d.reason == "all 3 live learners contributed"


def test_stale_contributions_alone_wait_then_open_a_round() -> None:
    s = RoundState()
    waiting = [w("a", 4, 0.0)]
    assert s.observe(10.0, waiting, 5, LIVE, 1.0, RULES).opened_at is None
    assert s.observe(29.9, waiting, 5, LIVE, 1.0, RULES).opened_at is None
    assert s.observe(30.0, waiting, 5, LIVE, 1.0, RULES).opened_at == 30.0


def test_stale_contributions_of_every_live_learner_open_after_one_period() -> None:
    s = RoundState()
    waiting = [w("a", 4, 0.0), w("b", 4, 1.0)]
    live = frozenset({"a", "b"})
    assert s.observe(3.9, waiting, 5, live, 1.0, RULES).opened_at is None  # H * step = 4 s
    assert s.observe(4.0, waiting, 5, live, 1.0, RULES).opened_at == 4.0


def test_below_quorum_a_timeout_merges_what_arrived() -> None:
    rules = RoundRules(policy=QuorumPolicy(quorum=0, timeout_s=5.0), overlap=2, sync_every=4, stale_round_s=30.0)
    s = RoundState()
    d = s.decide(1.0, [w("a", 0, 1.0)], 0, LIVE, TIMINGS, rules)
    assert not d.merge and d.wake_at == 6.0
    assert s.decide(6.0, [w("a", 0, 1.0)], 0, LIVE, TIMINGS, rules).merge


def test_the_rejoin_hold_waits_for_the_last_merges_learners_until_its_deadline() -> None:
    hold = RejoinHold(frozenset({"a", "b"}), until=20.0)
    s = RoundState()
    d = s.decide(10.0, [w("a", 3, 10.0)], 3, frozenset({"a"}), TIMINGS, RULES, hold)
    assert not d.merge and d.wake_at == 20.0 and "rejoin hold" in d.reason
    d = s.decide(12.0, [w("a", 3, 10.0), w("b", 3, 11.0)], 3, frozenset({"a", "b"}), TIMINGS, RULES, hold)
    assert d.merge, "both are back: this fragment stops waiting"
    other = RoundState()
    assert other.decide(20.0, [w("a", 3, 19.0)], 3, frozenset({"a"}), TIMINGS, RULES, hold).merge
    assert hold.until is None, "past the window the hold is gone for every fragment"


def test_one_staleness_rule() -> None:
    assert staleness_verdict(5, 5, 4) is None and staleness_verdict(1, 5, 4) is None
    assert staleness_verdict(0, 5, 4) == Verdict("stale", "base 0 is 5 versions behind 5 (window 4)")
    assert staleness_verdict(6, 5, 4) == Verdict("future_version", "base 6 is newer than version 5")
    assert staleness_verdict(3, 5, 4, retained=False).reason == "stale"


def test_participation_scale() -> None:
    assert participation_scale(1, 4) == 0.25 and participation_scale(4, 4) == 1.0
    assert participation_scale(3, 2) == 1.0 and participation_scale(1, 0) == 1.0
