"""The three strategies compared on one failure trace, and what goodput means for each.

Goodput is the share of allocated chip-time (all N chips, the whole horizon) spent on training
progress that the final model keeps. Everything else is charged to a named loss:

- ``dp`` (data-parallel SPMD, no elasticity): one job over all chips. Any failure stops every chip
  for ``restart_s`` and rolls back to the last checkpoint.
- ``elastic`` (elastic data-parallel): one job over all chips. Any failure stops every chip for
  ``reconfig_s``; the job then continues without the failed chip until it rejoins.
- ``decoupled`` (Decoupled DiLoCo, M learners): M independent jobs over N/M chips each. A failure
  pauses (``elastic``) or restarts (``restart``) only its own learner; the others keep training.
  On top, the merge level (``merges.simulate_merges``) charges whatever the quorum/grace policy
  makes learners overwrite, and reports merges, global downtime and merge gaps. The synchronizer
  may be split into ``shards`` that fail and restart independently (``shards.sample_outages``):
  a shard's outage stalls its own fragments' merges and nobody's training, and the report says how
  much of the model went unmerged, for how long, and how much of it one failure stalls.

Uptime is the share of wall-clock time in which the global model is making progress: the job
runs (dp, elastic), or at least one learner runs (decoupled).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ddiloco.simulator.config import SimConfig
from ddiloco.simulator.merges import simulate_merges
from ddiloco.simulator.shards import SyncOutages, overlap_all, sample_outages, stalled_share_per_failure
from ddiloco.simulator.spmd import JobResult, run_job, slowest_chip_factor
from ddiloco.simulator.trace import FailureTrace, sample_trace, trace_rng

STRATEGIES = ("dp", "elastic", "decoupled")


@dataclass
class StrategyResult:
    strategy: str
    chips: int
    learners: int
    goodput: float
    uptime: float
    failures: int
    interruptions: int
    """Failures that started a pause (of everyone for dp/elastic, of one learner for decoupled)."""
    lost: dict[str, float]
    """Share of allocated chip-time per loss: paused, rollback, unavailable, stragglers, late_merges."""
    merges: int | None = None
    details: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.strategy != "decoupled":
            return self.strategy
        shards = self.details.get("shards", 1)
        return f"decoupled M={self.learners}" + (f" S={shards}" if shards > 1 else "")

    def as_dict(self) -> dict:
        return asdict(self) | {"label": self.label}


def _job_result(strategy: str, learners: int, job: JobResult) -> StrategyResult:
    alloc = job.allocated_chip_s
    return StrategyResult(
        strategy=strategy, chips=job.chips, learners=learners, goodput=job.goodput,
        uptime=1.0 - job.paused_s / job.horizon_s, failures=job.failures, interruptions=job.interruptions,
        lost={k: v / alloc for k, v in job.lost_chip_s.items()} | {"late_merges": 0.0},
        details={"step_s": job.step_s, "global_downtime_s": job.paused_s},
    )


def simulate_dp(cfg: SimConfig, trace: FailureTrace) -> StrategyResult:
    slow = slowest_chip_factor(cfg.chips, cfg.speed_cv, trace_rng(cfg, 1))
    job = run_job(trace.times, trace.return_s, chips=cfg.chips, horizon_s=cfg.horizon_s, mode="restart",
                  pause_s=cfg.restart_s, step_s=cfg.step_s, checkpoint_s=cfg.checkpoint_s, slow_factor=slow)
    return _job_result("dp", 1, job)


def simulate_elastic(cfg: SimConfig, trace: FailureTrace) -> StrategyResult:
    slow = slowest_chip_factor(cfg.chips, cfg.speed_cv, trace_rng(cfg, 1))
    job = run_job(trace.times, trace.return_s, chips=cfg.chips, horizon_s=cfg.horizon_s, mode="elastic",
                  pause_s=cfg.reconfig_s, step_s=cfg.step_s, slow_factor=slow)
    return _job_result("elastic", 1, job)


def simulate_decoupled(cfg: SimConfig, trace: FailureTrace, outages: SyncOutages | None = None) -> StrategyResult:
    """M learners on ``trace``; the synchronizer's shards down during ``outages`` (default: sampled
    from ``cfg``, none unless ``sync_mtbf_hours`` is finite)."""
    m_count = cfg.learners
    restart = cfg.learner_recovery == "restart"
    speed_rng = trace_rng(cfg, 1 + m_count)
    jobs = []
    for chips, sub in trace.split(m_count):
        slow = slowest_chip_factor(chips, cfg.speed_cv, speed_rng)
        jobs.append(run_job(sub.times, sub.return_s, chips=chips, horizon_s=cfg.horizon_s,
                            mode="restart" if restart else "elastic",
                            pause_s=cfg.restart_s if restart else cfg.reconfig_s, step_s=cfg.step_s,
                            checkpoint_s=cfg.checkpoint_s, slow_factor=slow))
    if outages is None:
        outages = sample_outages(cfg)
    stats = simulate_merges(cfg, jobs, outages)
    alloc = cfg.chips * cfg.horizon_s
    late = stats.late_chip_s * (cfg.horizon_s / stats.window_s)  # the window's loss rate, whole horizon
    useful = sum(job.useful_chip_s for job in jobs) - late
    lost = {k: sum(job.lost_chip_s[k] for job in jobs) / alloc
            for k in ("paused", "rollback", "unavailable", "stragglers")}
    lost["late_merges"] = late / alloc
    learner_uptime = [1.0 - job.paused_s / job.horizon_s for job in jobs]
    global_down = all_paused_s(jobs)
    horizon, start = cfg.horizon_s, cfg.horizon_s - stats.window_s
    frags = cfg.fragments
    if outages.failures:
        # Merges happen only on fragments whose shard is up: scale by up fragment-time, not by time.
        up_window = frags * stats.window_s - outages.stalled_fragment_s(frags, start, horizon)
        up_horizon = frags * horizon - outages.stalled_fragment_s(frags)
        merges = round(stats.merges * up_horizon / up_window) if up_window > 0 else 0
    else:
        merges = round(stats.merges * cfg.horizon_s / stats.window_s)
    per_failure, measured = stalled_share_per_failure(outages, stats.merge_times, start, horizon)
    merge_down = outages.all_down_s()
    return StrategyResult(
        strategy="decoupled", chips=cfg.chips, learners=m_count, goodput=max(0.0, useful / alloc),
        uptime=1.0 - global_down / cfg.horizon_s, failures=len(trace),
        interruptions=sum(job.interruptions for job in jobs), lost=lost,
        merges=merges,
        details=stats.as_dict() | {
            "global_downtime_s": global_down,
            "learner_recovery": cfg.learner_recovery,
            "mean_learner_uptime": sum(learner_uptime) / m_count,
            "min_learner_uptime": min(learner_uptime),
            "chips_per_learner": [job.chips for job in jobs],
            "step_s": [job.step_s for job in jobs],
            "quorum": cfg.quorum,
            "shards": cfg.shards,
            "sync_mtbf_hours": cfg.sync_mtbf_hours,
            "sync_restart_s": cfg.sync_restart_s,
            "sync_failures": outages.failures,
            "sync_downtime_s": sum(outages.down_s(s) for s in range(cfg.shards)),
            "stalled_fragment_share": outages.stalled_fragment_s(frags) / (frags * horizon),
            "merge_downtime_s": merge_down,
            "merge_uptime": 1.0 - merge_down / horizon,
            "stalled_share_per_failure": per_failure,
            "failures_measured_in_window": measured,
            "max_fragment_gap_s": stats.max_fragment_gap_s(start, horizon),
            "dropped_contributions": stats.dropped,
        },
    )


def all_paused_s(jobs: list[JobResult]) -> float:
    """Time during which every job is paused at once (for learners: global downtime)."""
    return overlap_all([job.pauses for job in jobs])


def simulate(cfg: SimConfig, strategies: tuple[str, ...] = STRATEGIES,
             learners: tuple[int, ...] | None = None) -> list[StrategyResult]:
    """Run ``strategies`` on one sampled failure trace; ``decoupled`` once per M in ``learners``."""
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
    trace = sample_trace(cfg)
    out = []
    if "dp" in strategies:
        out.append(simulate_dp(cfg, trace))
    if "elastic" in strategies:
        out.append(simulate_elastic(cfg, trace))
    if "decoupled" in strategies:
        for m in learners or (cfg.learners,):
            out.append(simulate_decoupled(cfg.with_(learners=m, quorum=min(cfg.quorum, m)), trace))
    for r in out:
        r.details |= {"fleet_mtbi_s": cfg.fleet_mtbi_s, "hours": cfg.hours, "seed": cfg.seed}
    return out
