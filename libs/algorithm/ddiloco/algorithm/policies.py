"""Merge decisions as pure functions of (now, state, policy).

The synchronizer service, the tests and the fleet simulator all call these same functions, so a
behaviour proven in a test or measured in the simulator is the behaviour of the service. Nothing
here reads a clock or does I/O: ``now`` is always passed in, and every decision carries its
reason, which ends up in logs, metrics and status.

Decision for one fragment's round (a round opens when the fragment falls due and the
synchronizer asks the learners for it; see ``round``):

1. No contribution yet: wait. With none of them live, merge what is there (nobody else is coming).
2. Fewer than the required quorum K: wait (streaming mode: merge what arrived once ``timeout_s``
   has passed since the round opened, so one dead learner cannot stall everyone forever). K = 0
   means every live learner: it is reached when each of them has answered, whoever else did.
3. Every live learner has contributed to this round (against the current version): merge at once.
4. Quorum reached: wait out the adaptive grace window, paper Eq. 3,
   ``grace = clamp(gamma * (tau * step_time - quorum_time - sync_time), 0, max_grace)``,
   measured from the moment the quorum was reached, then merge whatever is there.

Token weights (paper Sec. 3.2): ``w_m = tok_m * (tok_m / steps_m)``, normalised: learners that
did more work, at a larger batch, count more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic.dataclasses import dataclass as config_dataclass

from ddiloco.core.config import STRICT


@config_dataclass(frozen=True, kw_only=True, config=STRICT)
class QuorumPolicy:
    """When a fragment's round may merge."""

    quorum: int = 1
    """K: minimum number of contributing learners. 0 means every live learner (streaming/diloco)."""
    grace_gamma: float = 0.8
    """gamma < 1: the share of the tau-step slack spent waiting for more learners."""
    max_grace_s: float = 10.0
    """Upper clamp of the grace window, seconds."""
    timeout_s: float | None = None
    """Merge whatever arrived this long after the round opened, even below the quorum (None = never).
    The streaming and diloco presets set it, so one dead learner cannot stall everyone forever."""

    def __post_init__(self) -> None:
        if self.quorum < 0:
            raise ValueError(f"quorum must be >= 0 (0 = all live learners), got {self.quorum}")
        if not 0.0 <= self.grace_gamma < 1.0:
            raise ValueError(f"grace_gamma must be in [0, 1), got {self.grace_gamma}")
        if self.max_grace_s < 0:
            raise ValueError(f"max_grace_s must be >= 0, got {self.max_grace_s}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")


@dataclass(frozen=True)
class RoundView:
    """What a merge decision needs to know about one fragment's open round."""

    opened_at: float | None
    """When the first contribution of this round arrived (the fragment fell due), or None."""
    quorum_at: float | None
    """When the round first reached its quorum, or None."""
    contributors: frozenset[str]
    """Learners with a contribution in the inbox."""
    live: frozenset[str]
    """Learners that currently count for quorums."""
    fresh: frozenset[str] | None = None
    """Contributors whose contribution was computed against the current version (None: all of
    them). The rejoin hold after a restart waits for these."""
    answered: frozenset[str] | None = None
    """Contributors that answered this round (None: all of them, or the fresh ones where those are
    given). Only these count for the
    quorum and for "every live learner has contributed": a leftover from an earlier round merges
    with this one but says nothing about whether the learner's answer to it is near."""
    since: float | None = None
    """When the contributions waiting were first asked for (None: ``opened_at``); the merge
    timeout counts from it."""


@dataclass(frozen=True)
class Timings:
    """Running averages feeding the grace window (seconds)."""

    step_time_s: float = 0.0
    """Learners' inner step time."""
    quorum_time_s: float = 0.0
    """Time from a fragment falling due to its quorum."""
    sync_time_s: float = 0.0
    """Merge + commit + broadcast time."""


@dataclass(frozen=True)
class Decision:
    merge: bool
    reason: str
    wake_at: float | None = None
    """When to decide again if nothing else happens (None: only on the next event)."""
    grace_s: float = 0.0


def required_quorum(policy: QuorumPolicy, live_count: int) -> int:
    """K in force: the configured quorum, or every live learner when it is 0 (at least 1)."""
    if policy.quorum == 0:
        return max(1, live_count)
    return policy.quorum


def quorum_reached(view: RoundView, policy: QuorumPolicy) -> tuple[bool, str]:
    """Whether the round has its quorum, and why. K answers from anyone count where K is set; where
    K is 0 ("every live learner") each live learner must have answered: an answer from a learner
    that is no longer live (it finished, it timed out) does not stand in for one that still trains.
    Counted instead, a finishing learner's last contribution met the quorum of a fleet that had one
    other learner left, and the round merged without it a step before it answered."""
    answers = view.contributors if view.answered is None else view.answered
    k = required_quorum(policy, len(view.live))
    n = len(answers & view.live) if policy.quorum == 0 and view.live else len(answers)
    if n >= k:
        return True, f"quorum {n}/{k}"
    leftovers = len(view.contributors) - len(answers)
    gone = len(answers) - n
    return False, (f"waiting for quorum: {n}/{k} answers" + (f" ({leftovers} leftover)" if leftovers else "")
                   + (f" ({gone} from learners no longer live)" if gone else ""))


def grace_window(timings: Timings, overlap: int, policy: QuorumPolicy) -> tuple[float, str]:
    """Paper Eq. 3: clamp(gamma * (tau * step_time - quorum_time - sync_time), 0, max_grace)."""
    slack = overlap * timings.step_time_s - timings.quorum_time_s - timings.sync_time_s
    grace = min(max(policy.grace_gamma * slack, 0.0), policy.max_grace_s)
    if slack <= 0:
        why = "no slack left in the overlap"
    elif grace >= policy.max_grace_s:
        why = "clamped to max_grace"
    else:
        why = "gamma * slack"
    return grace, (f"grace {grace:.3f}s ({why}: tau*step {overlap * timings.step_time_s:.3f}s, "
                   f"quorum {timings.quorum_time_s:.3f}s, sync {timings.sync_time_s:.3f}s)")


def decide(now: float, view: RoundView, timings: Timings, overlap: int, policy: QuorumPolicy) -> Decision:
    """Merge now, or wait (and until when)."""
    if not view.contributors:
        return Decision(False, "no contributions")
    if view.opened_at is None:
        return Decision(False, f"{len(view.contributors)} stale contributions; round not open yet")
    if not view.live:
        return Decision(True, f"no live learner to wait for; merging {len(view.contributors)} contributions")
    arrived = next(s for s in (view.answered, view.fresh, view.contributors) if s is not None)
    if view.live <= arrived:
        return Decision(True, f"all {len(view.live)} live learners contributed")
    reached, why = quorum_reached(view, policy)
    if not reached:
        if policy.timeout_s is not None:
            deadline = (view.opened_at if view.since is None else view.since) + policy.timeout_s
            if now >= deadline:
                return Decision(True, f"timeout after {policy.timeout_s:.3f}s with {len(view.contributors)} "
                                      "contributions")
            return Decision(False, why, wake_at=deadline)
        return Decision(False, why)
    grace, grace_why = grace_window(timings, overlap, policy)
    start = view.quorum_at if view.quorum_at is not None else view.opened_at
    deadline = start + grace
    if now >= deadline:
        return Decision(True, f"{why}; {grace_why} elapsed", grace_s=grace)
    return Decision(False, f"{why}; in {grace_why}", wake_at=deadline, grace_s=grace)


def token_weights(tokens: Sequence[int], steps: Sequence[int]) -> list[float]:
    """Normalised weights ``tok * (tok / steps)``; uniform if every weight is zero."""
    if len(tokens) != len(steps):
        raise ValueError("tokens and steps must have the same length")
    if not tokens:
        return []
    raw = [t * (t / s) if s > 0 and t > 0 else 0.0 for t, s in zip(tokens, steps, strict=True)]
    total = math.fsum(raw)
    if total <= 0:
        return [1.0 / len(raw)] * len(raw)
    return [r / total for r in raw]
