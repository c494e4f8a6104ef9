"""The norm guard: one faulty or hostile learner cannot wreck a fragment of the global model.

A learner whose data, hardware or code went wrong (or that was taken over) can send an outer
gradient that is finite, of the right shape and fresh, and still far larger than anything the
fleet produces: a loss spike, a scaled or random update. Token weighting gives it a share of the
merge like anyone else, so one such contribution moves the global fragment by its own size.

The guard compares each contribution's norm *per inner step* with the typical one of the same
fragment (per step, because a contribution that carries several syncs' worth of steps is
legitimately larger; the steps are the ones the claim guard admitted, not the ones claimed, so
claiming more steps does not shrink the norm per step). The typical norm is the lower median of
the learners' own medians over their last ``window`` accepted contributions of the fragment
(``identity_median``): one learner counts once, however many contributions it sends, so it cannot
drag the bound up by sending many just under it. Beyond ``factor`` times that value a
contribution is refused (``reject``, with reason ``norm_outlier``) or scaled down to the bound
(``clip``); refused contributions never enter the history. Until ``min_history`` norms of the
fragment are known the guard only records (the first merges of a run are the largest and the
most varied, and the inner learning rate is still warming up).

This is a bound on damage, not a proof against an adversary that knows the rule: a contribution
of up to ``factor`` times the typical size in any direction still passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic.dataclasses import dataclass as config_dataclass

from ddiloco.algorithm.identity_median import IdentityMedians
from ddiloco.core.config import STRICT


@config_dataclass(frozen=True, kw_only=True, config=STRICT)
class NormGuardPolicy:
    """What to do with a contribution whose norm is an outlier."""

    action: Literal["off", "reject", "clip"] = "reject"
    """off: merge every admissible contribution as it is; reject: refuse an outlier (reason
    norm_outlier); clip: scale it down to the bound and merge it."""
    factor: float = 10.0
    """k: an outlier's norm per inner step exceeds k times the median of recent ones."""
    window: int = 32
    """Accepted norms per fragment and learner each learner's median is taken over."""
    min_history: int = 8
    """Norms a fragment must have seen before the guard acts."""

    def __post_init__(self) -> None:
        check_median_bound("norm guard", self.factor, self.window, self.min_history)


def check_median_bound(name: str, factor: float, window: int, min_history: int) -> None:
    """The settings of a guard that bounds a value by ``factor`` times the median of the last
    ``window`` accepted ones, acting once ``min_history`` are known (the norm and weight guards)."""
    if not factor > 1.0 or not math.isfinite(factor):
        raise ValueError(f"{name} factor must be a finite number > 1, got {factor}")
    if window < 1 or not 1 <= min_history <= window:
        raise ValueError(f"{name} needs window >= 1 and 1 <= min_history <= window, "
                         f"got window={window}, min_history={min_history}")


@dataclass(frozen=True)
class NormVerdict:
    """The guard's answer for one contribution."""

    action: Literal["accept", "reject", "clip"]
    scale: float = 1.0
    """Multiply the contribution by this (1 unless clipped)."""
    detail: str = ""


class NormGuard:
    """Per-fragment, per-learner history of accepted norms and the verdict for each new one."""

    def __init__(self, policy: NormGuardPolicy) -> None:
        self.policy = policy
        self._history: dict[int, IdentityMedians] = {}

    def bound(self, fragment: int, identity: str | None = None) -> float | None:
        """The largest norm per step that passes for ``fragment`` now (None: not enough history).
        ``identity`` is accepted for symmetry with the other guards: the bound is the fleet's."""
        history = self._history.get(fragment)
        if history is None or history.count < self.policy.min_history:
            return None
        typical = history.typical()
        return None if typical is None else self.policy.factor * typical

    def judge(self, fragment: int, norm: float, steps: int, identity: str = "") -> NormVerdict:
        """The verdict for a contribution of ``norm`` over ``steps`` inner steps from
        ``identity``; an accepted (or clipped) one joins that identity's history."""
        p = self.policy
        if p.action == "off":
            return NormVerdict("accept")
        per_step = norm / max(1, steps)
        limit = self.bound(fragment)
        if limit is not None and per_step > limit:
            history = self._history[fragment]
            detail = (f"norm {norm:.4g} over {steps} steps ({per_step:.4g}/step) exceeds {p.factor:g}x the typical "
                      f"norm of the {history.identities()} learners' recent accepted ones ({limit / p.factor:.4g}/step)")
            if p.action == "reject":
                return NormVerdict("reject", detail=detail)
            self._record(fragment, identity, limit)
            return NormVerdict("clip", scale=limit / per_step, detail=detail)
        if math.isfinite(per_step):
            self._record(fragment, identity, per_step)
        return NormVerdict("accept")

    def _record(self, fragment: int, identity: str, per_step: float) -> None:
        history = self._history.get(fragment)
        if history is None:
            history = self._history[fragment] = IdentityMedians(self.policy.window)
        history.record(identity, per_step)
