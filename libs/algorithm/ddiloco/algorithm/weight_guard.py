"""The weight guard: a learner cannot claim most of every merge by reporting more tokens.

Token weights (``w = tokens * tokens / steps``) come from counters the learner reports. A
learner that claims 1000x the tokens it trained takes nearly all of every merge's weight, and the
norm guard does not see it: the update's size is honest, only its weight is not. The common case
is not an attack but a training loop that counts wrongly (bytes for tokens, the global batch on
every rank of a multi-process learner).

The guard compares each answer's tokens per inner step with the median of the last ``window``
accepted answers of the fleet (tokens per step is a property of the learner's batch, the same for
every fragment, so the history is the fleet's, not the fragment's). Beyond ``factor`` times that
median the answer is refused (``weight_outlier``), and the refusal says what was expected.
Learners whose batches differ by up to ``factor`` pass. The median is robust: up to
half of the recent answers may be inflated before it moves, and refused answers never enter the
history. Until ``min_history`` answers are known the guard only records.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from pydantic.dataclasses import dataclass as config_dataclass

from ddiloco.algorithm.norm_guard import check_median_bound
from ddiloco.core.config import STRICT


@config_dataclass(frozen=True, kw_only=True, config=STRICT)
class WeightGuardPolicy:
    """What to do with an answer that claims an outlying number of tokens per step."""

    action: Literal["off", "reject"] = "reject"
    """off: weigh every answer by what it claims; reject: refuse an outlier (reason weight_outlier)."""
    factor: float = 8.0
    """k: an outlier claims more than k times the median tokens per step of recent answers. Learners
    of one fleet may legitimately differ (a learner of 8 ranks beside single-process ones trains
    8x the tokens per step), so the default passes 8x; a fleet of equal learners may set 2-4,
    which also catches a loop that counts bytes instead of tokens."""
    window: int = 64
    """Accepted answers the median is taken over."""
    min_history: int = 8
    """Answers the fleet must have given before the guard acts."""

    def __post_init__(self) -> None:
        check_median_bound("weight guard", self.factor, self.window, self.min_history)


@dataclass(frozen=True)
class WeightVerdict:
    accept: bool
    detail: str = ""


class WeightGuard:
    """The fleet's recent tokens per step and the verdict for each new answer."""

    def __init__(self, policy: WeightGuardPolicy) -> None:
        self.policy = policy
        self._history: deque[float] = deque(maxlen=policy.window)

    def bound(self) -> float | None:
        """The most tokens per step that pass now (None: not enough history)."""
        if len(self._history) < self.policy.min_history:
            return None
        return self.policy.factor * statistics.median(self._history)

    def judge(self, tokens: int, steps: int) -> WeightVerdict:
        """The verdict for an answer claiming ``tokens`` over ``steps`` inner steps; an accepted
        one joins the history."""
        if self.policy.action == "off":
            return WeightVerdict(True)
        per_step = tokens / max(1, steps)
        limit = self.bound()
        if limit is not None and per_step > limit:
            typical = limit / self.policy.factor
            return WeightVerdict(False, f"claims {tokens} tokens over {steps} steps ({per_step:.6g} per step), more "
                                        f"than {self.policy.factor:g}x the fleet's recent answers (median "
                                        f"{typical:.6g} per step): a loop that counts bytes or the global batch "
                                        f"on every rank looks like this")
        self._history.append(per_step)
        return WeightVerdict(True)
