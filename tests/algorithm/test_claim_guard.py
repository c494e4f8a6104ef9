"""The claim guard (``ddiloco.algorithm.claim_guard``): the steps a contribution may claim are
bounded by the time the synchronizer saw pass and the learner's own pace."""

from __future__ import annotations

import itertools

import pytest

from ddiloco.algorithm.claim_guard import ClaimGuard, ClaimGuardPolicy

H = 24


def _run(guard: ClaimGuard, identity: str, *, steps_per_s: float, seconds: float, start: float = 0.0,
         fragments: int = 4, claim: float = 1.0) -> float:
    """``identity`` answers every fragment once per period (H steps at ``steps_per_s``) for
    ``seconds``, claiming ``claim`` times the steps it trained; every answer admitted as the guard
    rules. Returns the time it ends at."""
    period = H / steps_per_s
    now = start
    while now < start + seconds:
        for p in range(fragments):
            t = now + p * period / fragments
            verdict = guard.judge(identity, p, steps=round(H * claim), tokens=round(H * claim) * 100, now=t)
            assert verdict.action != "reject"
            guard.admitted(identity, verdict, t)
        now += period
    return now


def test_honest_learners_at_any_speed_are_never_bounded() -> None:
    guard = ClaimGuard(ClaimGuardPolicy(), period_steps=H)
    for who in ("cpu-1", "cpu-2", "gpu"):  # first answers of one period each, whatever their speed
        for p in range(4):
            assert guard.judge(who, p, steps=H, tokens=H * 100, now=0.0).action == "accept"
    end = _run(guard, "cpu-1", steps_per_s=2.0, seconds=60)
    _run(guard, "gpu", steps_per_s=40.0, seconds=60)
    # A learner cut off for 30 s that kept training: its answer carries 30 s of its steps.
    assert guard.judge("cpu-1", 0, steps=H + 60, tokens=(H + 60) * 100, now=end + 30).action == "accept"


def test_a_claim_beyond_the_bound_is_cut_to_it_tokens_in_proportion() -> None:
    guard = ClaimGuard(ClaimGuardPolicy(), period_steps=H)
    end = _run(guard, "honest", steps_per_s=2.0, seconds=120)
    end = max(end, _run(guard, "liar", steps_per_s=2.0, seconds=120))
    bound = guard.bound("liar", 0, end + 12)
    assert bound == H + 2 * 2.0 * 24, "one period of slack + growth x its pace x the 24 s since its last answer of 0"
    verdict = guard.judge("liar", 0, steps=1000 * H, tokens=1000 * H * 100, now=end + 12)
    assert verdict.action == "bound" and verdict.steps == bound and verdict.tokens == bound * 100
    assert f"claims {1000 * H} steps" in verdict.detail and f"than the {bound}" in verdict.detail
    strict = ClaimGuard(ClaimGuardPolicy(action="reject"), period_steps=H)
    assert strict.judge("x", 0, steps=1000 * H, tokens=1, now=0.0).action == "reject"


def test_a_newcomer_may_claim_first_periods() -> None:
    guard = ClaimGuard(ClaimGuardPolicy(first_periods=3.0), period_steps=H)
    assert guard.bound("new", 3, 100.0) == 3 * H
    assert guard.judge("new", 3, steps=3 * H, tokens=1, now=100.0).action == "accept"
    assert guard.judge("new", 3, steps=3 * H + 1, tokens=1, now=101.0).action == "bound"


def test_a_patient_liar_grows_by_a_bounded_factor_and_stops_at_the_fleets_cap() -> None:
    """Claiming the bound on every answer, a newcomer starts at growth x the fleet's pace; its own
    pace counts once half its window holds it, grows by about growth + 1 per half window after
    that, and never passes fleet_factor x the honest learners' pace."""
    policy = ClaimGuardPolicy(growth=2.0, fleet_factor=16.0, window=8)
    guard = ClaimGuard(policy, period_steps=H)
    period = H / 2.0  # the honest learner: 2 steps/s
    for t in range(0, 1200, int(period)):
        for p in range(4):
            guard.admitted("honest", guard.judge("honest", p, steps=H, tokens=H, now=float(t + p)), float(t + p))
    claimed = []
    for k in range(40):  # the liar answers fragment 0 every period, claiming all it may
        now = float(k * period)
        verdict = guard.judge("liar", 0, steps=10**6, tokens=10**6, now=now)
        guard.admitted("liar", verdict, now)
        claimed.append(verdict.steps)
    assert claimed[0] == 3 * H, "no earlier answer of the fragment: first_periods periods"
    assert claimed[1:5] == [H + 2 * 2 * 12] * 4, "growth x the fleet's pace until half its window is its own"
    assert all(b <= (2 + 1) * a for a, b in itertools.pairwise(claimed))
    rate = guard.rate("liar")
    assert rate is not None and rate == 16.0 * 2.0, "capped at fleet_factor x the honest pace"
    assert max(claimed) == H + 16 * 2 * 12


def test_refused_answers_bank_no_time() -> None:
    """Timed from its last admitted answer, a learner whose inflated updates were refused (for their
    norm) was allowed more steps with every refusal: 6 s after its last admitted answer a chaos run's
    liar could claim 508 steps where an honest answer carries 5, and its next 1000x update passed
    the norm guard."""
    guard = ClaimGuard(ClaimGuardPolicy(), period_steps=H)
    for k in range(60):
        for who in ("honest", "liar"):
            guard.admitted(who, guard.judge(who, 0, steps=H, tokens=H, now=k * 12.0), k * 12.0)
    limits = []
    for k in range(60, 80):  # the liar's answers, each judged and then refused by a later check
        verdict = guard.judge("liar", 0, steps=1000 * H, tokens=1000 * H, now=k * 12.0)
        limits.append(verdict.steps)
    assert max(limits) == min(limits) == H + 2 * 2 * 12, "one period's slack + growth x pace x one period"


def test_an_answer_from_the_same_base_is_timed_from_the_one_before() -> None:
    """A learner whose previous answer's merge has not come back answers again from the same base:
    its counters did not start over, so it carries that answer's steps too. Timed from the
    previous answer alone, a newcomer twice as fast as the others' pace was cut."""
    guard = ClaimGuard(ClaimGuardPolicy(), period_steps=H)
    for k in range(40):  # the others: 1 step/s
        t = k * 24.0
        guard.admitted("slow", guard.judge("slow", 0, steps=H, tokens=H, now=t, base=k, incarnation=1), t)
    a = guard.judge("fast", 0, steps=H, tokens=H, now=1000.0, base=7, incarnation=1)
    guard.admitted("fast", a, 1000.0)
    b = guard.judge("fast", 0, steps=H, tokens=H, now=1006.0, base=8, incarnation=1)  # 4 steps/s
    guard.admitted("fast", b, 1006.0)
    held = guard.judge("fast", 0, steps=2 * H, tokens=2 * H, now=1012.0, base=8, incarnation=1)
    assert held.action == "accept", held.detail
    other_process = guard.judge("fast", 0, steps=2 * H, tokens=2 * H, now=1018.0, base=8, incarnation=2)
    assert other_process.action == "bound", "a new process's answer is timed from the last answer"


def test_answers_queued_on_the_way_are_timed_from_the_requests_they_answer() -> None:
    """Rounds slower than the learner's period: each answer covers 1.5 periods. One answer waits
    1.4 s behind a busy synchronizer, so the next arrives 0.11 s after it: timed from arrivals the
    honest claim was cut to 1.2 periods; timed from the request the delayed answer can have been
    sent after at the earliest, it is not."""
    for asked in (True, False):
        guard = ClaimGuard(ClaimGuardPolicy(), period_steps=H)
        verdicts = []
        for k in range(40):
            q = 1.5 * k
            if asked:
                guard.asked(0, q)
            delay = 1.4 if k == 30 else 0.01
            v = guard.judge("a", 0, steps=36, tokens=36, now=q + delay, base=k, incarnation=1)
            guard.admitted("a", v, q + delay)
            verdicts.append(v.action)
        assert verdicts[:31] == ["accept"] * 31
        assert verdicts[31] == ("accept" if asked else "bound")
    # A request after an answer arrived (the next round's) never times that answer.
    guard = ClaimGuard(ClaimGuardPolicy(), period_steps=H)
    guard.asked(0, 0.0)
    guard.judge("b", 0, steps=H, tokens=H, now=0.5, base=0, incarnation=1)
    guard.asked(0, 1.0)
    assert guard.judge("b", 0, steps=H + 1, tokens=1, now=1.01, base=1, incarnation=1,
                       fallback_rate=1.0).steps == H + 1, "timed from the request at 0.0: H + 2 allowed"
    assert guard.judge("b", 0, steps=2 * H, tokens=1, now=1.02, base=2, incarnation=1,
                       fallback_rate=1.0).action == "bound", "timed from the request at 1.0"


def test_after_a_restart_the_counters_are_timed_from_the_fragments_last_commit() -> None:
    """A synchronizer that restarted knows no earlier answer and no pace: the learner's first
    answer carries what it trained while the synchronizer was away. With the fragment's last commit
    and the fleet's reported pace it may claim that much; without them, first_periods periods."""
    guard = ClaimGuard(ClaimGuardPolicy(), period_steps=H)
    long_outage = dict(steps=H + 100, tokens=1, now=500.0, base=3, incarnation=1)
    assert guard.judge("a", 0, **long_outage, fallback_since=440.0, fallback_rate=1.0).action == "accept"
    assert guard.judge("b", 0, **long_outage).action == "bound"
    assert guard.judge("c", 0, **long_outage, fallback_since=440.0).action == "bound", "no pace: first_periods"


def test_a_single_learner_cut_off_is_bounded_by_the_fleets_reported_pace() -> None:
    guard = ClaimGuard(ClaimGuardPolicy(), period_steps=H)
    for k in range(5):
        t = k * 12.0
        guard.admitted("only", guard.judge("only", 0, steps=H, tokens=H, now=t, base=k, incarnation=1,
                                           fallback_rate=2.0), t)
    # no other learner's pace and fewer than window / 2 of its own: the reported pace stands in
    after = guard.judge("only", 0, steps=H + 120, tokens=1, now=48.0 + 60.0, base=5, incarnation=1,
                        fallback_rate=2.0)
    assert after.action == "accept", after.detail


def test_off_trusts_every_claim_and_bad_settings_are_refused() -> None:
    guard = ClaimGuard(ClaimGuardPolicy(action="off"), period_steps=H)
    assert guard.judge("a", 0, steps=10**9, tokens=10**9, now=0.0).action == "accept"
    assert guard.bound("a", 0, 0.0) is None
    for bad in ({"growth": 0.5}, {"fleet_factor": float("inf")}, {"slack_periods": 0}, {"first_periods": 0.0},
                {"window": 0}):
        with pytest.raises(ValueError, match="claim guard"):
            ClaimGuardPolicy(**bad)
    with pytest.raises(ValueError, match="period_steps"):
        ClaimGuard(ClaimGuardPolicy(), period_steps=0)
