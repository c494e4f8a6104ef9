"""The norm guard: one faulty or hostile learner cannot wreck a fragment of the global model.

A learner whose data, hardware or code went wrong (or that was taken over) can send an outer
gradient that is finite, of the right shape and fresh, and still far larger than anything the
fleet produces: a loss spike, a scaled or random update. Token weighting gives it a share of the
merge like anyone else, so one such contribution moves the global fragment by its own size.

The guard compares each contribution's norm *per inner step* with the median of the last
``window`` accepted ones of the same fragment (per step, because a contribution that carries
several syncs' worth of steps is legitimately larger). Beyond ``factor`` times that median it is
refused (``reject``, with reason ``norm_outlier``) or scaled down to the bound (``clip``). The
median is robust: up to half of the recent contributions may be outliers before it moves, and
refused contributions never enter the history. Until ``min_history`` norms are known the guard
only records (the first merges of a run are the largest and the most varied).

This is a bound on damage, not a proof against an adversary that knows the rule: a contribution
of up to ``factor`` times the typical size in any direction still passes.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from pydantic.dataclasses import dataclass as config_dataclass

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
    """Accepted norms per fragment the median is taken over."""
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
    """Per-fragment history of accepted norms and the verdict for each new one."""

    def __init__(self, policy: NormGuardPolicy) -> None:
        self.policy = policy
        self._history: dict[int, deque[float]] = {}

    def bound(self, fragment: int) -> float | None:
        """The largest norm per step that passes for ``fragment`` now (None: not enough history)."""
        history = self._history.get(fragment)
        if history is None or len(history) < self.policy.min_history:
            return None
        return self.policy.factor * statistics.median(history)

    def judge(self, fragment: int, norm: float, steps: int) -> NormVerdict:
        """The verdict for a contribution of ``norm`` over ``steps`` inner steps; an accepted (or
        clipped) one joins the history."""
        p = self.policy
        if p.action == "off":
            return NormVerdict("accept")
        per_step = norm / max(1, steps)
        limit = self.bound(fragment)
        if limit is not None and per_step > limit:
            detail = (f"norm {norm:.4g} over {steps} steps ({per_step:.4g}/step) exceeds {p.factor:g}x the median "
                      f"of the last {len(self._history[fragment])} accepted ({limit / p.factor:.4g}/step)")
            if p.action == "reject":
                return NormVerdict("reject", detail=detail)
            self._record(fragment, limit)
            return NormVerdict("clip", scale=limit / per_step, detail=detail)
        if math.isfinite(per_step):
            self._record(fragment, per_step)
        return NormVerdict("accept")

    def _record(self, fragment: int, per_step: float) -> None:
        history = self._history.get(fragment)
        if history is None:
            history = self._history[fragment] = deque(maxlen=self.policy.window)
        history.append(per_step)
