"""The weight guard: a learner cannot claim most of every merge by reporting more tokens.

Token weights (``w = tokens * tokens / steps``) come from counters the learner reports. A
learner that claims 1000x the tokens it trained takes nearly all of every merge's weight, and the
norm guard does not see it: the update's size is honest, only its weight is not. The common case
is not an attack but a training loop that counts wrongly (bytes for tokens, the global batch on
every rank of a multi-process learner).

The guard compares each answer's tokens per inner step with the fleet's typical figure
(tokens per step is a property of the learner's batch, the same for every fragment, so the
history is the fleet's, not the fragment's): the lower median of the learners' own medians over
their last ``window`` admitted answers (``identity_median``), so one learner counts once however
many answers it sends. Beyond ``factor`` times that figure the answer is merged with its tokens
cut to the fleet's typical tokens per step over its steps as admitted (``action: bound``, the
default): its update counts, with the weight of a typical learner, so the progress of a learner
that only miscounts (or lies about) its tokens is kept, and a liar gains nothing a learner with
honest counters could not (its update is the norm guard's to judge). With ``action: reject`` it
is refused (``weight_outlier``), and the refusal says what was expected. Learners whose batches
differ by up to ``factor`` pass.

``judge`` only judges; the admission records an answer (``record``) once every other check has
passed too, so an answer refused later (a payload that does not decode, a norm outlier) never
enters the history. The guard acts from the first recorded answer (``min_history``, default 1):
the fleet's first answers are bounded by ``factor`` times the first one, and a learner that answers
first cannot set the fleet's figure unchecked (tokens per step does not warm up as norms do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic.dataclasses import dataclass as config_dataclass

from ddiloco.algorithm.identity_median import IdentityMedians
from ddiloco.algorithm.norm_guard import check_median_bound
from ddiloco.core.config import STRICT


@config_dataclass(frozen=True, kw_only=True, config=STRICT)
class WeightGuardPolicy:
    """What to do with an answer that claims an outlying number of tokens per step."""

    action: Literal["off", "reject", "bound"] = "bound"
    """off: weigh every answer by what it claims; bound: merge an outlier with its tokens cut to the
    fleet's typical tokens per step (logged and counted as a bounded claim; a learner claiming 100x
    its tokens from step 200 then ends within the clean runs' spread, where refusing its answers
    loses its third of the data); reject: refuse an outlier (reason weight_outlier)."""
    factor: float = 8.0
    """k: an outlier claims more than k times the median tokens per step of recent answers. Learners
    of one fleet may legitimately differ (a learner of 8 ranks beside single-process ones trains
    8x the tokens per step), so the default passes 8x; a fleet of equal learners may set 2-4,
    which also catches a loop that counts bytes instead of tokens."""
    window: int = 64
    """Admitted answers per learner its median is taken over."""
    min_history: int = 1
    """Admitted answers the fleet must have given before the guard acts (until then every answer
    passes and is recorded). 1: from the first answer on, the warm-up admits at most ``factor``
    times the first answer's tokens per step."""

    def __post_init__(self) -> None:
        check_median_bound("weight guard", self.factor, self.window, self.min_history)


@dataclass(frozen=True)
class WeightVerdict:
    accept: bool
    detail: str = ""
    tokens: int | None = None
    """With ``action: bound``, the tokens to merge an outlier with (None: as claimed)."""


class WeightGuard:
    """The fleet's recent tokens per step, per learner, and the verdict for each new answer."""

    def __init__(self, policy: WeightGuardPolicy) -> None:
        self.policy = policy
        self._history = IdentityMedians(policy.window)

    def bound(self) -> float | None:
        """The most tokens per step that pass now (None: not enough history)."""
        if self._history.count < self.policy.min_history:
            return None
        typical = self._history.typical()
        return None if typical is None else self.policy.factor * typical

    def judge(self, tokens: int, steps: int) -> WeightVerdict:
        """The verdict for an answer claiming ``tokens`` over ``steps`` inner steps. Nothing is
        recorded: the caller records the answer once it is admitted."""
        if self.policy.action == "off":
            return WeightVerdict(True)
        per_step = tokens / max(1, steps)
        limit = self.bound()
        if limit is not None and per_step > limit:
            typical = limit / self.policy.factor
            detail = (f"claims {tokens} tokens over {steps} steps ({per_step:.6g} per step), more than "
                      f"{self.policy.factor:g}x the fleet's recent answers (median {typical:.6g} per step): a loop "
                      f"that counts bytes or the global batch on every rank looks like this")
            if self.policy.action == "bound":
                cut = max(1, round(typical * max(1, steps)))
                return WeightVerdict(True, f"{detail}; merged as {cut} tokens", tokens=cut)
            return WeightVerdict(False, detail)
        return WeightVerdict(True)

    def record(self, identity: str, tokens: int, steps: int) -> None:
        """An answer of ``identity`` was admitted: its tokens per step join its history."""
        if self.policy.action != "off":
            self._history.record(identity, tokens / max(1, steps))
