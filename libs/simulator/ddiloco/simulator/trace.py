"""The failure trace: when chips fail, which chip, and when it (or its spare) is back.

A fleet of N chips, each failing at rate 1/MTBI, is a superposition of N Poisson processes, which
is itself a Poisson process of rate N/MTBI. So the trace is sampled in aggregate with numpy: a
Poisson count over the horizon, uniform sorted times, a uniform chip id per failure. No Python
object exists per chip, which is what lets 2.4M chips run in well under a second.

Every strategy replays the *same* trace. A decoupled learner owns a contiguous range of chip ids,
so its own failures (the failures whose chip id falls in its range) form a Poisson process of
rate c/MTBI, and the learners' traces superpose back to the fleet's.

Assumption: a chip under repair is replaced by a spare in the failure process, so the fleet's
failure rate stays N/MTBI (the share of chips under repair is repair_s/MTBI, about 0.01%).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.simulator.config import SimConfig


@dataclass(frozen=True)
class FailureTrace:
    horizon_s: float
    chips: int
    times: np.ndarray
    """Sorted failure times, seconds from the start."""
    chip_ids: np.ndarray
    """The failed chip of each failure, 0..chips-1."""
    return_s: np.ndarray
    """Per failure: time until the chip (or its replacement) is back in the pool."""

    def __len__(self) -> int:
        return int(self.times.size)

    def learner_bounds(self, learners: int) -> np.ndarray:
        """Chip-id boundaries of M near-equal contiguous slices: learner m owns [b[m], b[m+1])."""
        return (np.arange(learners + 1, dtype=np.int64) * self.chips) // learners

    def learner_of(self, learners: int) -> np.ndarray:
        """The learner that owns each failure's chip."""
        bounds = self.learner_bounds(learners)
        return np.searchsorted(bounds, self.chip_ids, side="right") - 1

    def split(self, learners: int) -> list[tuple[int, FailureTrace]]:
        """Per learner: its chip count and its own sub-trace (same times, same return delays)."""
        bounds = self.learner_bounds(learners)
        owner = self.learner_of(learners)
        out = []
        for m in range(learners):
            mask = owner == m
            sub = FailureTrace(self.horizon_s, int(bounds[m + 1] - bounds[m]), self.times[mask],
                               self.chip_ids[mask] - bounds[m], self.return_s[mask])
            out.append((sub.chips, sub))
        return out


def trace_rng(cfg: SimConfig, stream: int) -> np.random.Generator:
    """Independent, reproducible random streams per (seed, fleet size, purpose)."""
    return np.random.default_rng(np.random.SeedSequence([cfg.seed, cfg.chips, stream]))


def sample_return_delays(cfg: SimConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    mean = cfg.repair_s
    if n == 0 or mean == 0:
        return np.zeros(n)
    if cfg.repair_dist == "fixed":
        return np.full(n, mean)
    if cfg.repair_dist == "exp":
        return rng.exponential(mean, n)
    sigma2 = np.log(2.0)  # lognormal with coefficient of variation 1: sigma^2 = ln(1 + cv^2)
    return rng.lognormal(np.log(mean) - sigma2 / 2, np.sqrt(sigma2), n)


def sample_trace(cfg: SimConfig) -> FailureTrace:
    """The fleet's failure trace for ``cfg`` (depends only on seed, chips, MTBI, repair law, hours)."""
    rng = trace_rng(cfg, 0)
    horizon = cfg.horizon_s
    n = int(rng.poisson(cfg.chip_failure_rate * cfg.chips * horizon))
    times = np.sort(rng.uniform(0.0, horizon, n))
    chip_ids = rng.integers(0, cfg.chips, n, dtype=np.int64)
    return FailureTrace(horizon, cfg.chips, times, chip_ids, sample_return_delays(cfg, n, rng))
