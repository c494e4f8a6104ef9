"""The claim guard: the inner steps a contribution claims are bounded by what the synchronizer saw.

A contribution carries the tokens and inner steps its learner says it trained. Both are
self-reported, and both matter: the merge weight is ``tokens * tokens / steps`` (at a given batch,
proportional to the steps), and the norm guard judges an update's norm *per step*, so a learner
that claims 1000x the steps (and 1000x the tokens, keeping its tokens per step honest) with a
1000x update passes the norm guard and takes the whole merge (it moved a fragment 1,500 times as
far as an honest merge does). The weight guard bounds tokens *per step*; this guard bounds the
steps.

The synchronizer cannot see a learner's steps, but it sees time. A learner's counters for a
fragment run from the last merge of it the learner applied, which comes back after its previous
answer. So for each learner (its identity, the learner id bound to its credentials) and fragment
the guard keeps its last answer (admitted or not), and times a new answer's counters from the
moment that answer can have been sent at the earliest: the synchronizer's latest request of the
fragment before it arrived (a learner answers a request; answers queued on the way, behind a
busy synchronizer or a cut link, arrive closer together than they were sent), or its arrival
where the fleet asks for nothing (learner-clocked modes). From the answer before where the new
answer is from the same base version and process (the previous answer's merge had not come back,
so this one carries its steps too). Where it knows no earlier answer, from the earlier of the
commit of the version the answer was trained from (a synchronizer that restarted) and the moment
the learner's process joined (a newcomer trains from the base it got then). For
each learner it keeps the pace its admitted answers implied (steps / seconds their counters
cover). A new contribution may claim at most

    ``bound = slack + rate * (now - when its counters started)``,
    ``rate = min(growth * own pace, fleet_factor * typical pace of the other learners)``
    (``growth * typical pace of the others`` for a learner with fewer than ``window / 2`` paces of
    its own; ``growth *`` the median step time the live learners report where no learner's pace
    is known yet: a single learner, a fleet's first rounds, after a restart)

where ``slack`` is ``slack_periods`` sync periods of steps (an honest contribution covers about
one period: the fleet's clock asks for each fragment once a period, at the pace of its fast
learners) and the paces are medians over the last ``window`` admitted contributions (the other
learners' figure is the lower median of their own medians, ``identity_median``, so no one learner
sets it). Where neither a start nor a pace is known, and for a learner's first answer of a
fragment at the least, a contribution may claim ``first_periods`` periods. With ``action: bound``
(the default) a claim beyond the bound is merged as if it claimed the bound: its steps are cut to
it and its tokens in proportion (tokens per step as claimed, for the weight guard to judge), and
the norm guard judges the update against the bounded steps, so an inflated update over an
inflated claim is refused as ``norm_outlier``. With ``reject`` it is refused (``claim_outlier``).

Why honest learners are not bounded: an answer covers about one period (within ``slack``); one
that covers more (a learner cut off from the synchronizer that kept training, one that answered
again before its previous merge came back, one whose synchronizer was down) comes with the time
it took, at the learner's pace or, where that is not known yet, ``growth`` times the fleet's. A
faster learner (a GPU beside CPUs) answers about one period too, since the clock runs at the fast
learners' pace; where it claims more, its bound grows by about ``growth + 1`` per ``window / 2``
admitted contributions (the median moves once half the window is at the new pace), up to
``fleet_factor`` times the others' pace. The learners' paces ride with each commit (``paces``,
``restore``), so after a restart the answers that carry what learners trained meanwhile are
bounded by their own pace. Where none of this holds (a learner more than ``growth`` times faster
than the rest that answers late in its first rounds; a restart whose state holds no pace; a
wiped state), an honest claim is cut: merged with fewer steps, never refused for it.

What a patient liar still gains: by claiming the bound on every answer it raises its own pace by
that factor per half window, until ``fleet_factor`` times the fleet's typical pace; from then on
its answers weigh up to ``fleet_factor`` times an honest learner's and the norm guard admits
updates of up to the norm guard's ``factor`` times the typical norm per step over those steps.
Bounded, not prevented: the synchronizer cannot tell a faster learner from one that says it is.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from pydantic.dataclasses import dataclass as config_dataclass

from ddiloco.algorithm.identity_median import MAX_IDENTITIES, IdentityMedians
from ddiloco.core.config import STRICT

ASKED_KEPT = 16
"""Requests per fragment the guard remembers (an answer arrives well within 16 rounds of the
request it answers, or is stale)."""

KEPT_PACES = 1024
"""Learners' paces a commit carries at most (the most recently heard)."""

MIN_ELAPSED_S = 1e-3
"""Contributions of one fragment closer together than this give no pace (too noisy to use)."""


@config_dataclass(frozen=True, kw_only=True, config=STRICT)
class ClaimGuardPolicy:
    """The bound on the inner steps a contribution may claim."""

    action: Literal["off", "bound", "reject"] = "bound"
    """off: trust the claimed steps; bound: merge a claim beyond the bound as the bound (steps cut
    to it, tokens in proportion); reject: refuse it (reason claim_outlier)."""
    growth: float = 2.0
    """A learner's rate may exceed its own recent pace by this factor (a learner that speeds up is
    admitted within a few rounds)."""
    fleet_factor: float = 16.0
    """... and the other learners' typical pace by this factor (a GPU learner beside CPU ones may
    be this much faster before its claims are cut)."""
    slack_periods: float = 1.0
    """Steps any contribution may claim beyond the pace bound, in sync periods (H steps)."""
    window: int = 48
    """Admitted contributions per learner its pace median is taken over (two periods at P = 24)."""
    first_periods: float = 3.0
    """Steps a contribution may claim, in sync periods, where the synchronizer knows no earlier
    answer of the learner for the fragment or no pace (a newcomer; every learner after a
    synchronizer restart, whose answers then carry what it trained while the synchronizer was
    away: 2.4 periods after a 10 s restart in a measured run)."""

    def __post_init__(self) -> None:
        for name in ("growth", "fleet_factor"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 1.0:
                raise ValueError(f"claim guard {name} must be a finite number >= 1, got {value}")
        for name in ("slack_periods", "first_periods"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"claim guard {name} must be a finite number > 0, got {value}")
        if self.window < 1:
            raise ValueError(f"claim guard window must be >= 1, got {self.window}")


@dataclass(frozen=True)
class ClaimVerdict:
    """The guard's answer for one contribution: the steps and tokens to merge it with."""

    action: Literal["accept", "bound", "reject"]
    steps: int
    tokens: int
    detail: str = ""
    since: float | None = None
    """What the answer's counters were timed from (None: nothing known)."""
    paced: bool = False
    """Whether ``since`` comes from an earlier answer of the learner (only then does the answer
    give a pace: a first answer's window holds the learner's start-up, and understates it)."""


@dataclass
class _Answer:
    """A learner's last answer of a fragment, as the guard saw it."""

    at: float
    """The earliest it can have been sent: the latest request of the fragment before it arrived,
    or its arrival."""
    base: int | None
    incarnation: int | None
    since: float | None
    """What its counters were timed from."""


class ClaimGuard:
    """Per learner: when it last answered each fragment, and the pace its admitted answers implied."""

    def __init__(self, policy: ClaimGuardPolicy, *, period_steps: int) -> None:
        if period_steps < 1:
            raise ValueError(f"period_steps must be >= 1, got {period_steps}")
        self.policy = policy
        self.slack = policy.slack_periods * period_steps
        self.first = policy.first_periods * period_steps
        self._last: dict[str, dict[int, _Answer]] = {}
        self._paces = IdentityMedians(policy.window)
        self._asked: dict[int, deque[float]] = {}
        """Per fragment, when the synchronizer last asked for it (the newest ``ASKED_KEPT``)."""

    def paces(self, limit: int = KEPT_PACES) -> dict[str, float]:
        """The learners' own paces (steps per second) where they count (half a window of samples),
        the ``limit`` most recently heard: what a restarted synchronizer starts from (``restore``)."""
        known = [(who, pace) for who in self._paces.identities_by_recency()
                 if self._paces.samples(who) >= max(1, self.policy.window // 2) and (pace := self._paces.of(who))]
        return {who: float(f"{pace:.4g}") for who, pace in known[-limit:]}

    def restore(self, paces: dict[str, float]) -> None:
        """Start from the paces a synchronizer before this one measured (the state's newest commit
        carries them): each counts as half a window of samples, so a learner's first answers after
        a restart are bounded by its own pace, not by a fleet figure that its waits slowed."""
        for who, pace in paces.items():
            if isinstance(who, str) and isinstance(pace, int | float) and math.isfinite(pace) and pace > 0:
                for _ in range(max(1, self.policy.window // 2)):
                    self._paces.record(who, float(pace))

    def asked(self, fragment: int, now: float) -> None:
        """The synchronizer asked every live learner for ``fragment`` at ``now``."""
        self._asked.setdefault(fragment, deque(maxlen=ASKED_KEPT)).append(now)

    def _sent_after(self, fragment: int, arrived: float) -> float:
        """The earliest an answer of ``fragment`` that arrived at ``arrived`` can have been sent:
        the latest request of it before then (a learner answers requests), or ``arrived``."""
        return next((t for t in reversed(self._asked.get(fragment, ())) if t <= arrived), arrived)

    def rate(self, identity: str, fallback: float | None = None) -> float | None:
        """The most steps per second ``identity`` may claim now (None: no pace known).
        ``fallback``: a pace for the fleet from elsewhere (the fleet clock's), used where no
        admitted answer gave one yet (a single learner, a fleet's first rounds, after a restart)."""
        p = self.policy
        # An own pace counts once half the window holds it: a median of two or three samples would
        # follow a liar's every answer.
        own = self._paces.of(identity) if self._paces.samples(identity) >= max(1, p.window // 2) else None
        fleet = self._paces.typical(exclude=identity)
        if fleet is None:
            fleet = fallback
        if own is None:  # a newcomer starts from the fleet's pace, and grows from there
            return None if fleet is None else p.growth * fleet
        return p.growth * own if fleet is None else min(p.growth * own, p.fleet_factor * fleet)

    def bound(self, identity: str, fragment: int, now: float, *, fallback_rate: float | None = None) -> int | None:
        """The most steps a contribution of ``fragment`` from ``identity`` may claim at ``now``,
        timed from the learner's last answer of the fragment (see ``judge`` for the other cases)."""
        last = self._last.get(identity, {}).get(fragment)
        return self._limit(identity, now, None if last is None else last.at, known=last is not None,
                           fallback_rate=fallback_rate)

    def _limit(self, identity: str, now: float, since: float | None, *, known: bool,
               fallback_rate: float | None) -> int | None:
        if self.policy.action == "off":
            return None
        rate = self.rate(identity, fallback_rate)
        if since is None or rate is None:
            return math.ceil(self.first)
        paced = math.ceil(self.slack + rate * max(0.0, now - since))
        return paced if known else max(paced, math.ceil(self.first))

    def judge(self, identity: str, fragment: int, *, steps: int, tokens: int, now: float,
              base: int | None = None, incarnation: int | None = None, fallback_since: float | None = None,
              fallback_rate: float | None = None) -> ClaimVerdict:
        """The steps and tokens to admit a contribution claiming ``steps`` and ``tokens`` with.

        Its counters are timed from the learner's previous answer of the fragment, admitted or not
        (a learner whose answers are refused for their norm would otherwise bank the time since its
        last admitted one and claim more with every refusal); from the one before that where the
        previous answer was from the same base and process (its merge had not come back, so the
        learner's counters did not start over: this answer carries that one's steps too); from
        ``fallback_since`` where the guard knows no earlier answer (the earlier of the commit of
        the answer's base version and the moment the learner's process joined)."""
        last = self._last.get(identity, {}).get(fragment)
        if last is None:
            since = fallback_since
        elif base is not None and (last.base, last.incarnation) == (base, incarnation):
            since = last.since if last.since is not None else fallback_since
        else:
            since = last.at
        limit = self._limit(identity, now, since, known=last is not None, fallback_rate=fallback_rate)
        self._answered(identity, fragment, _Answer(self._sent_after(fragment, now), base, incarnation, since))
        paced = last is not None
        if limit is None or steps <= limit:
            return ClaimVerdict("accept", steps, tokens, since=since, paced=paced)
        seen = "no earlier answer of it known" if since is None else f"counters timed from {now - since:.3g}s ago"
        rate = self.rate(identity, fallback_rate)
        pace = "no pace known yet" if rate is None else f"at most {rate:.4g} steps/s"
        detail = (f"claims {steps} steps for fragment {fragment}, more than the {limit} the synchronizer can "
                  f"account for ({seen}, {pace}, slack {self.slack:g})")
        if self.policy.action == "reject":
            return ClaimVerdict("reject", steps, tokens, detail, since=since, paced=paced)
        return ClaimVerdict("bound", limit, max(1, round(tokens * limit / steps)), detail, since=since, paced=paced)

    def admitted(self, identity: str, verdict: ClaimVerdict, now: float) -> None:
        """The answer ``verdict`` was given for passed every check, with ``verdict.steps``: the pace
        it implies joins ``identity``'s history."""
        if verdict.paced and verdict.since is not None and now - verdict.since >= MIN_ELAPSED_S:
            self._paces.record(identity, verdict.steps / (now - verdict.since))

    def _answered(self, identity: str, fragment: int, answer: _Answer) -> None:
        """Mark ``identity``'s answer of ``fragment``."""
        if self.policy.action == "off":
            return
        last = self._last.pop(identity, {})
        self._last[identity] = last  # most recently heard last
        while len(self._last) > MAX_IDENTITIES:
            del self._last[next(iter(self._last))]
        last[fragment] = answer
