"""The claim guard: the inner steps a contribution claims are bounded by what the synchronizer saw.

A contribution carries the tokens and inner steps its learner says it trained. Both are
self-reported, and both matter: the merge weight is ``tokens * tokens / steps`` (at a given batch,
proportional to the steps), and the norm guard judges an update's norm *per step*, so a learner
that claims 1000x the steps (and 1000x the tokens, keeping its tokens per step honest) with a
1000x update passes the norm guard and takes the whole merge (it moved a fragment 1,500 times as
far as an honest merge does). The weight guard bounds tokens *per step*; this guard bounds the
steps.

The synchronizer cannot see a learner's steps, but it sees time. For each learner (its identity,
the learner id bound to its credentials) and fragment it keeps when its last answer arrived
(admitted or not: a learner's counters start over at its sends), and for each learner the pace
its admitted answers implied (steps / seconds since its previous answer of the same fragment). A
new contribution may claim at most

    ``bound = slack + rate * (now - its last answer of this fragment)``,
    ``rate = min(growth * own pace, fleet_factor * typical pace of the other learners)``
    (``growth * typical pace of the others`` for a learner with fewer than ``window / 2`` paces of
    its own)

where ``slack`` is ``slack_periods`` sync periods of steps (an honest contribution covers about
one period: the fleet's clock asks for each fragment once a period, at the pace of its fast
learners) and the paces are medians over the last ``window`` admitted contributions (the other
learners' figure is the lower median of their own medians, ``identity_median``, so no one learner
sets it). A learner with no pace or no earlier answer of this fragment (a newcomer, or
any learner after a synchronizer restart, whose first answers carry one period plus what it trained
while the synchronizer was away) may claim ``first_periods`` periods. With ``action: bound``
(the default) a claim beyond the bound is merged as if it claimed the bound: its steps are cut to
it and its tokens in proportion (tokens per step as claimed, for the weight guard to judge), and
the norm guard judges the update against the bounded steps, so an inflated update over an
inflated claim is refused as ``norm_outlier``. With ``reject`` it is refused (``claim_outlier``).

Why honest learners are not bounded: an answer covers about one period (within ``slack``); one
that covers more (a learner cut off from the synchronizer that kept training, or one that held
its answer while its previous merge was on its way) comes with the time it took, at the
learner's own pace. A faster learner
(a GPU beside CPUs) answers about one period too, since the clock runs at the fast learners'
pace; where it claims more, its bound grows by about ``growth + 1`` per ``window / 2`` admitted
contributions (the median moves once half the window is at the new pace), up to ``fleet_factor``
times the others' pace.

What a patient liar still gains: by claiming the bound on every answer it raises its own pace by
that factor per half window, until ``fleet_factor`` times the fleet's typical pace; from then on
its answers weigh up to ``fleet_factor`` times an honest learner's and the norm guard admits
updates of up to the norm guard's ``factor`` times the typical norm per step over those steps.
Bounded, not prevented: the synchronizer cannot tell a faster learner from one that says it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic.dataclasses import dataclass as config_dataclass

from ddiloco.algorithm.identity_median import MAX_IDENTITIES, IdentityMedians
from ddiloco.core.config import STRICT

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
    """When the learner's answer of the fragment before this one arrived (None: none known)."""


class ClaimGuard:
    """Per learner: when it last answered each fragment, and the pace its admitted answers implied."""

    def __init__(self, policy: ClaimGuardPolicy, *, period_steps: int) -> None:
        if period_steps < 1:
            raise ValueError(f"period_steps must be >= 1, got {period_steps}")
        self.policy = policy
        self.slack = policy.slack_periods * period_steps
        self.first = policy.first_periods * period_steps
        self._last: dict[str, dict[int, float]] = {}
        self._paces = IdentityMedians(policy.window)

    def rate(self, identity: str) -> float | None:
        """The most steps per second ``identity`` may claim now (None: no pace known)."""
        p = self.policy
        # An own pace counts once half the window holds it: a median of two or three samples would
        # follow a liar's every answer.
        own = self._paces.of(identity) if self._paces.samples(identity) >= max(1, p.window // 2) else None
        fleet = self._paces.typical(exclude=identity)
        if own is None:  # a newcomer starts from the fleet's pace, and grows from there
            return None if fleet is None else p.growth * fleet
        return p.growth * own if fleet is None else min(p.growth * own, p.fleet_factor * fleet)

    def bound(self, identity: str, fragment: int, now: float) -> int | None:
        """The most steps a contribution of ``fragment`` from ``identity`` may claim at ``now``."""
        if self.policy.action == "off":
            return None
        since = self._last.get(identity, {}).get(fragment)
        rate = self.rate(identity)
        if since is None or rate is None:
            return math.ceil(self.first)
        return math.ceil(self.slack + rate * max(0.0, now - since))

    def judge(self, identity: str, fragment: int, *, steps: int, tokens: int, now: float) -> ClaimVerdict:
        """The steps and tokens to admit a contribution claiming ``steps`` and ``tokens`` with. The
        answer counts as the learner's last of ``fragment`` from ``now`` on, whatever becomes of it:
        a learner's counters start over at its sends, not at its merges, and timed from the last
        *admitted* answer, a learner whose answers are refused (for their norm, say) would bank the
        time since and claim more steps with every refusal."""
        limit = self.bound(identity, fragment, now)
        since = self._answered(identity, fragment, now)
        if limit is None or steps <= limit:
            return ClaimVerdict("accept", steps, tokens, since=since)
        seen = "no earlier answer of it" if since is None else f"{now - since:.3g}s since its last answer"
        rate = self.rate(identity)
        pace = "no pace known yet" if rate is None else f"at most {rate:.4g} steps/s"
        detail = (f"claims {steps} steps for fragment {fragment}, more than the {limit} the synchronizer can "
                  f"account for ({seen}, {pace}, slack {self.slack:g})")
        if self.policy.action == "reject":
            return ClaimVerdict("reject", steps, tokens, detail, since=since)
        return ClaimVerdict("bound", limit, max(1, round(tokens * limit / steps)), detail, since=since)

    def admitted(self, identity: str, verdict: ClaimVerdict, now: float) -> None:
        """The answer ``verdict`` was given for passed every check, with ``verdict.steps``: the pace
        it implies joins ``identity``'s history."""
        if verdict.since is not None and now - verdict.since >= MIN_ELAPSED_S:
            self._paces.record(identity, verdict.steps / (now - verdict.since))

    def _answered(self, identity: str, fragment: int, now: float) -> float | None:
        """Mark ``identity``'s answer of ``fragment`` at ``now``; the time of the one before (None)."""
        if self.policy.action == "off":
            return None
        last = self._last.pop(identity, {})
        self._last[identity] = last  # most recently heard last
        while len(self._last) > MAX_IDENTITIES:
            del self._last[next(iter(self._last))]
        since, last[fragment] = last.get(fragment), now
        return since
