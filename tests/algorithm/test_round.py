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
    StartHold,
    Verdict,
    Waiting,
    participation_scale,
    staleness_verdict,
)

RULES = RoundRules(policy=QuorumPolicy(quorum=1, grace_gamma=0.5, max_grace_s=10.0), overlap=2)
TIMINGS = Timings(step_time_s=1.0, quorum_time_s=0.0, sync_time_s=0.0)  # grace = 0.5 * 2 * 1.0 = 1.0 s
LIVE = frozenset({"a", "b", "c"})


def w(lid: str, base: int, at: float, round_no: int = 1) -> Waiting:
    """A contribution in the inbox, answering round ``round_no`` (0: a leftover or unsolicited)."""
    return Waiting(lid, base, at, round_no)


def test_a_round_opens_when_requested_and_latches_its_quorum() -> None:
    s = RoundState()
    waiting = [w("a", 4, 9.5, round_no=0)]
    d = s.decide(10.0, waiting, 5, LIVE, TIMINGS, RULES)
    assert not d.merge and s.opened_at is None, "a contribution alone does not open a round"
    s.open(10.0, 1, waiting=True)
    d = s.decide(10.0, waiting, 5, LIVE, TIMINGS, RULES)
    assert (s.round, s.opened_at, s.quorum_at) == (1, 10.0, None), "a leftover does not meet the quorum"
    assert not d.merge and "1 leftover" in d.reason
    waiting.append(w("b", 5, 10.2))
    d = s.decide(10.2, waiting, 5, LIVE, TIMINGS, RULES)
    assert s.quorum_at == 10.2 and s.quorum_time_s == pytest.approx(0.2), "the first answer meets it"
    assert not d.merge and d.wake_at == pytest.approx(11.2) and d.grace_s == pytest.approx(1.0)
    d = s.decide(10.5, [*waiting, w("c", 5, 10.4)], 5, LIVE, TIMINGS, RULES)
    assert s.quorum_at == 10.2 and not d.merge, "later arrivals do not move the grace window"
    d = s.decide(11.2, [*waiting, w("c", 4, 10.4, round_no=0)], 5, LIVE, TIMINGS, RULES)
    assert d.merge and "elapsed" in d.reason, "the leftovers merge with the round"
    assert s.close() == (10.0, 10.2) and (s.opened_at, s.quorum_at) == (None, None)


def test_with_quorum_one_a_leftover_from_the_last_round_does_not_end_the_round_at_its_request() -> None:
    """K = 1, an answer of round 1 still waits when round 2 is requested (it came after round 1
    merged). Counting it as a contributor would latch round 2's quorum at its request (quorum time
    0) and merge it after the grace window, whatever the others' answers to round 2."""
    s = RoundState()
    s.open(10.0, 2, waiting=True)
    late = [w("a", 4, 9.9, round_no=1)]
    d = s.decide(10.0, late, 5, LIVE, TIMINGS, RULES)
    assert not d.merge and s.quorum_at is None and d.wake_at is None
    d = s.decide(10.4, [*late, w("b", 5, 10.4, round_no=2)], 5, LIVE, TIMINGS, RULES)
    assert s.quorum_at == 10.4 and s.quorum_time_s == pytest.approx(0.4) and not d.merge
    learner_clocked = RoundRules(policy=RULES.policy, overlap=2, learner_clocked=True)
    t = RoundState()
    t.decide(10.0, [w("a", 4, 9.9, round_no=0)], 5, LIVE, TIMINGS, learner_clocked)
    assert t.opened_at is None, "where learners clock rounds, a contribution on an old version opens none"
    t.decide(10.1, [w("a", 4, 9.9, round_no=0), w("b", 5, 10.1, round_no=0)], 5, LIVE, TIMINGS, learner_clocked)
    assert (t.opened_at, t.quorum_at) == (10.1, 10.1), "... and one on the current version is an answer"


def test_quorum_time_counts_from_the_request() -> None:
    s = RoundState()
    s.open(20.0, 3, waiting=False)
    assert not s.decide(20.1, [], 5, LIVE, TIMINGS, RULES).merge
    s.decide(20.3, [w("a", 5, 20.3, round_no=3)], 5, LIVE, TIMINGS, RULES)
    assert s.quorum_time_s == pytest.approx(0.3)


def test_every_request_reopens_the_round_and_the_timeout_counts_from_the_first_one_waited_on() -> None:
    s = RoundState()
    s.open(1.0, 1, waiting=False)
    s.open(2.0, 2, waiting=False)
    assert (s.round, s.opened_at, s.since) == (2, 2.0, 2.0)
    s.open(3.0, 3, waiting=True)
    assert (s.round, s.opened_at, s.since) == (3, 3.0, 2.0), "quorum time from this request, timeout from 2.0"
    s.decide(3.1, [w("a", 5, 3.1, round_no=3)], 5, LIVE, TIMINGS, RULES)
    s.open(4.0, 4, waiting=True)
    assert (s.opened_at, s.quorum_at) == (3.0, 3.1), "a latched quorum keeps its grace deadline"


def test_every_live_learner_answering_merges_at_once_but_leftovers_do_not_count() -> None:
    s = RoundState()
    s.open(1.0, 2, waiting=True)
    # c's contribution answers round 1 (it came after that round merged): a leftover
    waiting = [w("a", 5, 1.1, round_no=2), w("b", 5, 1.1, round_no=2), w("c", 5, 0.9, round_no=1)]
    d = s.decide(1.3, waiting, 5, LIVE, TIMINGS, RULES)
    assert not d.merge, "c's answer to this round is not here yet"
    d = s.decide(1.3, [*waiting[:2], w("c", 5, 1.25, round_no=2)], 5, LIVE, TIMINGS, RULES)
    assert d.merge and d.reason == "all 3 live learners contributed"
    t = RoundState()
    t.open(1.0, 2, waiting=False)
    d = t.decide(1.3, [*waiting[:2], w("c", 5, 1.25, round_no=0)], 5, LIVE, TIMINGS, RULES)
    assert d.merge, "unsolicited progress on the current version counts as an answer"


def test_with_nobody_live_to_ask_what_waits_merges() -> None:
    s = RoundState()
    waiting = [w("a", 4, 0.0), w("b", 5, 1.0)]
    assert s.observe(10.0, waiting, 5, LIVE, RULES).opened_at is None
    d = s.decide(10.0, waiting, 5, frozenset(), TIMINGS, RULES)
    assert s.opened_at == 10.0 and d.merge, "the end of a run: every learner finished"


def test_below_quorum_a_timeout_merges_what_arrived() -> None:
    rules = RoundRules(policy=QuorumPolicy(quorum=0, timeout_s=5.0), overlap=2)
    s = RoundState()
    s.open(1.0, 1, waiting=True)
    d = s.decide(1.0, [w("a", 0, 1.0)], 0, LIVE, TIMINGS, rules)
    assert not d.merge and d.wake_at == 6.0
    assert s.decide(6.0, [w("a", 0, 1.0)], 0, LIVE, TIMINGS, rules).merge


def test_the_rejoin_hold_waits_for_the_last_merges_learners_until_its_deadline() -> None:
    hold = RejoinHold(frozenset({"a", "b"}), until=20.0)
    s = RoundState()
    s.open(10.0, 1, waiting=True)
    d = s.decide(10.0, [w("a", 3, 10.0)], 3, frozenset({"a"}), TIMINGS, RULES, hold)
    assert not d.merge and d.wake_at == 20.0 and "rejoin hold" in d.reason
    d = s.decide(12.0, [w("a", 3, 10.0), w("b", 3, 11.0)], 3, frozenset({"a", "b"}), TIMINGS, RULES, hold)
    assert d.merge, "both are back: this fragment stops waiting"
    other = RoundState()
    other.open(20.0, 1, waiting=True)
    assert other.decide(20.0, [w("a", 3, 19.0)], 3, frozenset({"a"}), TIMINGS, RULES, hold).merge
    assert hold.until is None, "past the window the hold is gone for every fragment"


def test_the_start_hold_waits_until_enough_learners_were_live_at_once_or_its_window_passed() -> None:
    hold = StartHold(learners=2, window_s=30.0)
    s = RoundState()
    s.open(10.0, 1, waiting=True)
    d = s.decide(10.0, [w("a", 0, 10.0)], 0, frozenset({"a"}), TIMINGS, RULES, start=hold)
    assert not d.merge and d.wake_at == 40.0 and d.reason == "start hold: waiting for 2 learners (1 live)"
    assert s.decide(11.0, [w("a", 0, 10.0)], 0, frozenset({"a", "b"}), TIMINGS, RULES, start=hold).merge
    assert hold.released
    assert s.decide(12.0, [w("a", 0, 10.0)], 0, frozenset({"a"}), TIMINGS, RULES, start=hold).merge, \
        "released for good: a learner leaving later holds nothing back"
    alone = StartHold(learners=3, window_s=5.0)
    t = RoundState()
    t.open(10.0, 1, waiting=True)
    assert not t.decide(10.0, [w("a", 0, 10.0)], 0, frozenset({"a"}), TIMINGS, RULES, start=alone).merge
    assert t.decide(15.0, [w("a", 0, 10.0)], 0, frozenset({"a"}), TIMINGS, RULES, start=alone).merge
    assert StartHold().hold(0.0, frozenset()) is None, "0 learners: no hold"


def test_one_staleness_rule() -> None:
    assert staleness_verdict(5, 5, 4) is None and staleness_verdict(1, 5, 4) is None
    assert staleness_verdict(0, 5, 4) == Verdict("stale", "base 0 is 5 versions behind 5 (window 4)")
    assert staleness_verdict(6, 5, 4) == Verdict("future_version", "base 6 is newer than version 5")
    assert staleness_verdict(3, 5, 4, retained=False).reason == "stale"


def test_participation_scale() -> None:
    assert participation_scale(1, 4) == 0.25 and participation_scale(4, 4) == 1.0
    assert participation_scale(3, 2) == 1.0 and participation_scale(1, 0) == 1.0


def test_answers_to_a_request_that_did_not_merge_still_count_when_the_next_one_reopens_it() -> None:
    """A fleet whose answers take longer to arrive than its rounds last: round 1 is asked, round 2
    is asked before any answer came, then the answers to round 1 arrive. They answer this merge
    (round 1 never merged), so they make its quorum; were only round 2's answers counted, every
    request would find the answers to the one before late and the fragment would never merge."""
    s = RoundState()
    s.open(1.0, 1, waiting=False)
    s.open(2.0, 2, waiting=False)
    d = s.decide(2.5, [w("a", 5, 2.5, round_no=1)], 5, LIVE, TIMINGS, RULES)
    assert s.quorum_at == 2.5 and not d.merge and d.wake_at == pytest.approx(3.5)
    d = s.decide(2.6, [w("a", 5, 2.5, round_no=1), w("b", 5, 2.6, round_no=1), w("c", 5, 2.6, round_no=2)],
                 5, LIVE, TIMINGS, RULES)
    assert d.merge and d.reason == "all 3 live learners contributed"
    s.close()
    s.open(5.0, 3, waiting=True)
    d = s.decide(5.1, [w("a", 5, 4.0, round_no=2)], 6, LIVE, TIMINGS, RULES)
    assert s.quorum_at is None and not d.merge, "after the merge, an answer to round 2 is a leftover"
