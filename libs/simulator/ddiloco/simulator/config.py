"""The simulator's one config object: every knob of the fleet model, documented and validated.

Defaults are chosen to be defensible numbers for a large accelerator fleet, not fitted per cell
(docs/simulator.md explains each one). The two timing constants that dominate the baselines,
``restart_s`` and ``reconfig_s``, are the only ones chosen with the paper's data-parallel and
elastic columns in view; the decoupled columns use no constant of their own beyond the
synchronizer's real defaults (K = 1, gamma = 0.8, P = H = 24, tau = 2).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from pydantic.dataclasses import dataclass

from ddiloco.algorithm import policies
from ddiloco.core.config import STRICT

YEAR_S = 365.0 * 86400.0
"""One year in seconds: the unit of the per-chip mean time between interruptions."""

REPAIR_DISTRIBUTIONS = ("exp", "lognormal", "fixed")
LEARNER_RECOVERIES = ("elastic", "restart")


@dataclass(frozen=True, kw_only=True, config=STRICT)
class SimConfig:
    """One simulated fleet. Times in seconds unless the name says otherwise."""

    chips: int = 1_200_000
    """Allocated chips in the fleet (all strategies are charged for all of them, all the time)."""
    learners: int = 8
    """M: independent learners of the decoupled strategy (the fleet is split into M equal slices)."""
    mtbi_years: float = 1.0
    """Mean time between interruptions of one chip, in years (paper: one year). ``inf``: no failures."""
    repair_s: float = 3600.0
    """Mean time until a failed chip, or the spare replacing it, is back in the pool."""
    repair_dist: str = "exp"
    """Distribution of that time: ``exp``, ``lognormal`` (coefficient of variation 1) or ``fixed``."""
    restart_s: float = 75.0
    """Full restart of a non-elastic SPMD job onto a hot spare: detect, reschedule, re-initialise the
    runtime and collectives, restore state. Failures during a restart are handled by the same restart."""
    reconfig_s: float = 20.0
    """Elastic reconfiguration: detect the failure, drop the failed slice, rebuild the collectives
    among the survivors; no state reload (the survivors hold it). Also a decoupled learner's pause."""
    checkpoint_s: float = 0.0
    """Progress between two restorable checkpoints of a restarting job. 0: every step (in-memory
    redundancy), so a restart loses only the step in flight."""
    step_s: float = 2.0
    """Nominal inner step time (all chips at mean speed)."""
    speed_cv: float = 0.0
    """Coefficient of variation of per-chip speed. A synchronous group waits for its slowest chip
    every step; the slowest of n chips is sampled from the normal extreme-value law (no per-chip state)."""
    sync_s: float = 1.0
    """Synchronizer merge + commit + broadcast time of one fragment (the grace window's sync_time)."""
    quorum: int = 1
    """K: minimum contributing learners before a fragment may merge (0: every live learner)."""
    gamma: float = 0.8
    """Grace gamma < 1: share of the tau-step slack spent waiting for more learners (paper Eq. 3)."""
    max_grace_s: float = 10.0
    """Upper clamp of the grace window."""
    fragments: int = 24
    """P: parameter fragments, synced on staggered steps."""
    sync_every: int = 24
    """H: inner steps between two syncs of the same fragment."""
    overlap: int = 2
    """tau: steps between sending a fragment and applying its merged version."""
    shards: int = 1
    """S: synchronizer shards. Shard s owns the fragments p with p % S == s (the service's ownership
    rule); each shard is a process of its own, so it fails and restarts on its own, and while it is
    down only its fragments stop merging."""
    sync_mtbf_hours: float = math.inf
    """Mean time between failures of one synchronizer process (one shard), in hours: failures arrive
    as a Poisson process per shard, at this rate whatever S is. ``inf`` (the default): the
    synchronizer never fails."""
    sync_restart_s: float = 120.0
    """Time a failed synchronizer process is down: detect, reschedule, load the newest committed
    version of each of its fragments, let the learners reconnect. Its in-memory inboxes and round
    state are lost; the learners' progress is not (each answer carries everything since the last
    merge the learner applied)."""
    learner_recovery: str = "elastic"
    """What a decoupled learner does when one of its chips fails: ``elastic`` (pause ``reconfig_s`` and
    continue without the slice; the paper's "shrinks or pauses that learner") or ``restart`` (like a
    data-parallel job: ``restart_s`` onto a spare, back to the last checkpoint)."""
    hours: float = 72.0
    """Simulated wall-clock duration of the failure trace and of every chip-level book (long enough that
    a 150k-chip fleet sees ~1200 failures, so a cell's sampling noise is well under a point)."""
    merge_hours: float = 6.0
    """The merge level (one policy call per contribution: M x P x hours / step of them) replays the last
    ``merge_hours`` of the trace, by which time the learners' phases have decorrelated; its late-merge
    loss rate is applied to the whole horizon. 0, or >= ``hours``: replay the whole horizon."""
    seed: int = 0
    """Seed of the failure trace and of the chip speeds; the same seed gives every strategy the same trace."""

    def __post_init__(self) -> None:
        if self.chips < 1:
            raise ValueError(f"chips must be >= 1, got {self.chips}")
        if not 1 <= self.learners <= self.chips:
            raise ValueError(f"learners must be in 1..chips, got {self.learners}")
        if not self.mtbi_years > 0:
            raise ValueError(f"mtbi_years must be > 0 (inf: no failures), got {self.mtbi_years}")
        for name in ("repair_s", "restart_s", "reconfig_s", "checkpoint_s", "speed_cv", "sync_s", "sync_restart_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.repair_dist not in REPAIR_DISTRIBUTIONS:
            raise ValueError(f"repair_dist must be one of {REPAIR_DISTRIBUTIONS}, got {self.repair_dist!r}")
        if self.learner_recovery not in LEARNER_RECOVERIES:
            raise ValueError(f"learner_recovery must be one of {LEARNER_RECOVERIES}, "
                             f"got {self.learner_recovery!r}")
        if not (self.step_s > 0 and math.isfinite(self.step_s)):
            raise ValueError(f"step_s must be > 0, got {self.step_s}")
        if not (self.hours > 0 and math.isfinite(self.hours)):
            raise ValueError(f"hours must be > 0, got {self.hours}")
        if not (self.merge_hours >= 0 and math.isfinite(self.merge_hours)):
            raise ValueError(f"merge_hours must be >= 0, got {self.merge_hours}")
        if not self.sync_mtbf_hours > 0:
            raise ValueError(f"sync_mtbf_hours must be > 0 (inf: the synchronizer never fails), "
                             f"got {self.sync_mtbf_hours}")
        if self.quorum > self.learners:
            raise ValueError(f"quorum K={self.quorum} cannot exceed learners M={self.learners}")
        # The synchronizer's and the learners' own validation: same rules as the service.
        self.policy()
        self.schedule()
        if not 1 <= self.shards <= self.fragments:
            raise ValueError(f"shards must be in 1..fragments (P={self.fragments}): a shard owns at least one "
                             f"fragment, got shards={self.shards}")

    @property
    def horizon_s(self) -> float:
        return self.hours * 3600.0

    @property
    def merge_window_s(self) -> float:
        """Length of the merge-level replay (the end of the horizon)."""
        if self.merge_hours <= 0 or self.merge_hours >= self.hours:
            return self.horizon_s
        return self.merge_hours * 3600.0

    @property
    def chip_failure_rate(self) -> float:
        """Failures per chip-second."""
        return 0.0 if math.isinf(self.mtbi_years) else 1.0 / (self.mtbi_years * YEAR_S)

    @property
    def fleet_mtbi_s(self) -> float:
        """Mean time between failures anywhere in the fleet."""
        rate = self.chip_failure_rate * self.chips
        return math.inf if rate == 0 else 1.0 / rate

    @property
    def sync_failure_rate(self) -> float:
        """Failures per second of one synchronizer process (one shard)."""
        return 0.0 if math.isinf(self.sync_mtbf_hours) else 1.0 / (self.sync_mtbf_hours * 3600.0)

    def policy(self) -> policies.QuorumPolicy:
        """The synchronizer's merge policy, exactly as the service would build it."""
        return policies.QuorumPolicy(quorum=self.quorum, grace_gamma=self.gamma, max_grace_s=self.max_grace_s)

    def schedule(self):  # -> ddiloco.fragments.schedule.FragmentSchedule
        """The learners' fragment schedule (the learners' own class: same offsets, same validation)."""
        from ddiloco.fragments.schedule import FragmentSchedule

        return FragmentSchedule(num_fragments=self.fragments, sync_every=self.sync_every, overlap=self.overlap)

    def with_(self, **changes: Any) -> SimConfig:
        return replace(self, **changes)
