"""One synchronous (SPMD) job replaying a failure trace: the building block of every strategy.

Data-parallel without elasticity is one job over the whole fleet in ``restart`` mode; elastic
data-parallel is one job in ``elastic`` mode; a decoupled learner is one job over its slice, in
either mode. What differs between strategies is only which failures a job sees and whether a
failure stops one slice or everyone, which is the whole point of the comparison.

A job alternates running segments and pauses, one Python iteration per failure (thousands, not
millions), and keeps the chip-time books exactly: allocated = useful + paused + rolled back +
unavailable + waiting for stragglers.

- ``restart``: a failure stops the job for ``pause_s`` (a restart onto a hot spare, so no chip is
  missing afterwards) and rolls progress back to the last checkpoint (``checkpoint_s``; 0 means
  every step, so only the step in flight is lost).
- ``elastic``: a failure stops the job for ``pause_s`` (a reconfiguration), the step in flight is
  lost, and the job continues without the failed chip; the chip (or a spare) rejoins at the first
  reconfiguration after it is back in the pool.

Failures that arrive while the job is already paused are absorbed by that pause (the restart or
reconfiguration in progress handles every chip lost so far). Straggling: every step waits for the
slowest chip, so a job of n chips runs at ``step_s * f`` with ``f`` the slowest chip's factor and
only ``1/f`` of its running chip-time is compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MODES = ("restart", "elastic")


def slowest_chip_factor(n: int, cv: float, rng: np.random.Generator) -> float:
    """Step-time factor of a synchronous group of n chips whose speeds vary with coefficient ``cv``.

    The slowest of n standard normals follows the Gumbel extreme-value law with location
    ``a_n = L - (ln ln n + ln 4 pi) / 2L`` and scale ``1/L`` (L = sqrt(2 ln n)); small groups are
    sampled directly. Either way nothing is allocated per chip.
    """
    if cv <= 0 or n <= 1:
        return 1.0
    if n <= 4096:
        worst = float(rng.standard_normal(n).max())
    else:
        big_l = math.sqrt(2.0 * math.log(n))
        loc = big_l - (math.log(math.log(n)) + math.log(4.0 * math.pi)) / (2.0 * big_l)
        worst = loc + float(rng.gumbel()) / big_l
    return max(1.0, 1.0 + cv * worst)


@dataclass
class JobResult:
    """What one job did over the horizon. Chip-times are in chip-seconds."""

    chips: int
    horizon_s: float
    mode: str
    step_s: float
    """Actual step time (nominal x slowest-chip factor)."""
    slow_factor: float
    pauses: np.ndarray
    """(k, 2) disjoint, sorted [start, end) pauses, clipped to the horizon."""
    segments: list[tuple[float, float, int]]
    """Running segments (start, end, step count at start): the learner's step clock."""
    failures: int
    interruptions: int
    """Failures that started a pause (the rest arrived during one and were absorbed)."""
    useful_chip_s: float
    lost_chip_s: dict[str, float] = field(default_factory=dict)
    """paused, rollback, unavailable, stragglers."""

    @property
    def allocated_chip_s(self) -> float:
        return self.chips * self.horizon_s

    @property
    def paused_s(self) -> float:
        return float((self.pauses[:, 1] - self.pauses[:, 0]).sum()) if len(self.pauses) else 0.0

    @property
    def goodput(self) -> float:
        return self.useful_chip_s / self.allocated_chip_s

    def is_paused(self, t: float) -> bool:
        j = int(np.searchsorted(self.pauses[:, 0], t, side="right")) - 1
        return j >= 0 and t < self.pauses[j, 1]

    def paused_between(self, t: np.ndarray) -> np.ndarray:
        """Paused time in [0, t], vectorised."""
        t = np.asarray(t, dtype=float)
        if not len(self.pauses):
            return np.zeros_like(t)
        starts, ends = self.pauses[:, 0], self.pauses[:, 1]
        before = np.concatenate(([0.0], np.cumsum(ends - starts)))
        j = np.searchsorted(starts, t, side="right")  # pauses that started at or before t
        last = np.maximum(j - 1, 0)
        partial = np.where(j > 0, np.minimum(t - starts[last], ends[last] - starts[last]), 0.0)
        return before[last] * (j > 0) + partial

    def running_until(self, t: np.ndarray) -> np.ndarray:
        """Running (not paused) time in [0, t]."""
        t = np.asarray(t, dtype=float)
        return t - self.paused_between(t)


def run_job(times: np.ndarray, return_s: np.ndarray, *, chips: int, horizon_s: float, mode: str,
            pause_s: float, step_s: float, checkpoint_s: float = 0.0, slow_factor: float = 1.0) -> JobResult:
    """Replay the failures ``times`` (sorted) against one synchronous job of ``chips`` chips."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    step = step_s * slow_factor
    ckpt_steps = max(1, round(checkpoint_s / step)) if (mode == "restart" and checkpoint_s > 0) else 1
    segments: list[tuple[float, float, int]] = []
    pauses: list[tuple[float, float]] = []
    rollback_s = 0.0
    run_from, steps_at_start = 0.0, 0
    for t in times.tolist():
        if t < run_from:
            continue  # absorbed: a restart/reconfiguration is already in progress
        elapsed = t - run_from
        done = int(elapsed // step)
        steps = steps_at_start + done
        kept = (steps // ckpt_steps) * ckpt_steps
        rollback_s += (elapsed - done * step) + (steps - kept) * step
        segments.append((run_from, t, steps_at_start))
        pauses.append((t, min(t + pause_s, horizon_s)))
        run_from, steps_at_start = t + pause_s, kept
    if run_from < horizon_s:
        segments.append((run_from, horizon_s, steps_at_start))
    pause_arr = np.asarray(pauses, dtype=float).reshape(-1, 2)
    result = JobResult(chips=chips, horizon_s=horizon_s, mode=mode, step_s=step, slow_factor=slow_factor,
                       pauses=pause_arr, segments=segments, failures=int(times.size),
                       interruptions=len(pauses), useful_chip_s=0.0)

    unavailable_s = 0.0
    if mode == "elastic" and times.size:
        # A failed chip is back in the pool after its return delay and rejoins at the job's next
        # reconfiguration; until then the job runs without it.
        back = times + return_s
        starts = pause_arr[:, 0]
        k = np.searchsorted(starts, back, side="left")
        rejoin = np.where(k < len(starts), starts[np.minimum(k, len(starts) - 1)], horizon_s)
        unavailable_s = float((result.running_until(rejoin) - result.running_until(times)).sum())

    paused_chip_s = chips * result.paused_s
    running_chip_s = chips * horizon_s - paused_chip_s
    rollback_chip_s = chips * rollback_s
    compute_chip_s = max(0.0, running_chip_s - rollback_chip_s - unavailable_s)
    result.useful_chip_s = compute_chip_s / slow_factor
    result.lost_chip_s = {
        "paused": paused_chip_s,
        "rollback": rollback_chip_s,
        "unavailable": unavailable_s,
        "stragglers": compute_chip_s - result.useful_chip_s,
    }
    return result
