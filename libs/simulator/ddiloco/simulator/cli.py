"""``ddiloco simulate``: fleet-scale goodput of data-parallel, elastic and Decoupled DiLoCo training.

Every fleet size gets one failure trace, replayed by every strategy. Independent (size, strategy)
runs go to a process pool: the merge level of a decoupled run is the costly part, it does not grow
with the number of chips, and the paper table's 15 runs spread over every core. The defaults are
documented in ``SimConfig`` and docs/simulator.md.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

from ddiloco.simulator.config import LEARNER_RECOVERIES, REPAIR_DISTRIBUTIONS, SimConfig
from ddiloco.simulator.report import (
    PAPER,
    PAPER_GOODPUT,
    TABLE_CHIPS,
    TABLE_LEARNERS,
    fmt_chips,
    paper_table,
    plot,
    results_table,
    write_json,
)
from ddiloco.simulator.strategies import StrategyResult, simulate

_D = SimConfig()


def _count(text: str) -> int:
    """150000, 150k, 1.2M -> chips."""
    t = text.strip().lower().replace("_", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(t[-1:], 1)
    value = float(t[:-1] if scale > 1 else t) * scale
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive whole count: {text!r}")
    return int(value)


def _counts(text: str) -> list[int]:
    return [_count(part) for part in text.split(",") if part.strip()]


def _mtbi(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("mtbi-years must be > 0 (inf: no failures)")
    return value


def _sync_mtbf(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("sync-mtbf-hours must be > 0 (inf: the synchronizer never fails)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddiloco simulate",
        description="Goodput of data-parallel, elastic data-parallel and Decoupled DiLoCo on the same "
                    "failure trace, at fleet scale. Times in seconds.")
    p.add_argument("--chips", type=_counts, default=[_D.chips], help="fleet size(s), e.g. 2400000 or 150k,1.2M")
    p.add_argument("--learners", type=_counts, default=[_D.learners], help="M for the decoupled strategy (list ok)")
    p.add_argument("--mtbi-years", type=_mtbi, default=_D.mtbi_years, help="per-chip mean time between interruptions")
    p.add_argument("--repair-s", type=float, default=_D.repair_s, help="mean time until a failed chip/spare is back")
    p.add_argument("--repair-dist", choices=REPAIR_DISTRIBUTIONS, default=_D.repair_dist)
    p.add_argument("--restart-s", type=float, default=_D.restart_s, help="non-elastic restart time")
    p.add_argument("--reconfig-s", type=float, default=_D.reconfig_s, help="elastic reconfiguration pause")
    p.add_argument("--checkpoint-s", type=float, default=_D.checkpoint_s,
                   help="progress between restorable checkpoints (0: every step)")
    p.add_argument("--step-s", type=float, default=_D.step_s, help="nominal inner step time")
    p.add_argument("--speed-cv", type=float, default=_D.speed_cv, help="per-chip speed coefficient of variation")
    p.add_argument("--sync-s", type=float, default=_D.sync_s, help="merge + commit + broadcast time per fragment")
    p.add_argument("--quorum", type=int, default=_D.quorum, help="K, capped at each M (0: every live learner)")
    p.add_argument("--gamma", type=float, default=_D.gamma, help="grace gamma (paper Eq. 3)")
    p.add_argument("--max-grace-s", type=float, default=_D.max_grace_s)
    p.add_argument("--fragments", type=int, default=_D.fragments, help="P")
    p.add_argument("--sync-every", type=int, default=_D.sync_every, help="H")
    p.add_argument("--overlap", type=int, default=_D.overlap, help="tau")
    p.add_argument("--learner-recovery", choices=LEARNER_RECOVERIES, default=_D.learner_recovery)
    p.add_argument("--shards", type=_counts, default=[_D.shards],
                   help="S: synchronizer shards, shard s owning fragments p %% S == s (list ok: one decoupled "
                        "run per S)")
    p.add_argument("--sync-mtbf-hours", type=_sync_mtbf, default=_D.sync_mtbf_hours,
                   help="mean time between failures of one synchronizer process (per shard); inf: never fails")
    p.add_argument("--sync-restart-s", type=float, default=_D.sync_restart_s,
                   help="time a failed synchronizer process (shard) is down")
    p.add_argument("--hours", type=float, default=_D.hours, help="simulated duration")
    p.add_argument("--merge-hours", type=float, default=_D.merge_hours,
                   help="replay the merge level (policy calls) over the last this-many hours (0: all)")
    p.add_argument("--seed", type=int, default=_D.seed)
    p.add_argument("--strategies", default="dp,elastic,decoupled", help="subset of dp,elastic,decoupled")
    p.add_argument("--table", action="store_true",
                   help="the paper's table: 150k..2.4M chips, DP / elastic / M=8 / M=16, paper column beside")
    p.add_argument("--json", metavar="PATH", help="write config, results and the paper comparison as JSON")
    p.add_argument("--plot", metavar="PNG", help="write goodput vs fleet size as a PNG")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel processes")
    return p


def _config(args: argparse.Namespace, chips: int, learners: int, shards: int = 1) -> SimConfig:
    return SimConfig(
        chips=chips, learners=learners, mtbi_years=args.mtbi_years, repair_s=args.repair_s,
        repair_dist=args.repair_dist, restart_s=args.restart_s, reconfig_s=args.reconfig_s,
        checkpoint_s=args.checkpoint_s, step_s=args.step_s, speed_cv=args.speed_cv, sync_s=args.sync_s,
        quorum=args.quorum, gamma=args.gamma, max_grace_s=args.max_grace_s, fragments=args.fragments,
        sync_every=args.sync_every, overlap=args.overlap, learner_recovery=args.learner_recovery,
        hours=args.hours, merge_hours=args.merge_hours, seed=args.seed, shards=shards,
        sync_mtbf_hours=args.sync_mtbf_hours, sync_restart_s=args.sync_restart_s)


def _run(job: tuple[SimConfig, tuple[str, ...], tuple[int, ...] | None]) -> list[StrategyResult]:
    cfg, strategies, learners = job
    return simulate(cfg, strategies, learners)


def run_jobs(jobs: list, workers: int) -> list[StrategyResult]:
    """Each job is (config, strategies, learners); results keep the jobs' order."""
    if workers <= 1 or len(jobs) <= 1:
        chunks = [_run(j) for j in jobs]
    else:
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        # Heaviest first (decoupled with many learners), so the pool's tail is short.
        order = sorted(range(len(jobs)), key=lambda i: -max(jobs[i][2] or (0,)))
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
            done = dict(zip(order, pool.map(_run, [jobs[i] for i in order]), strict=True))
        chunks = [done[i] for i in range(len(jobs))]
    return [r for chunk in chunks for r in chunk]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    sizes, learner_list = (list(TABLE_CHIPS), list(TABLE_LEARNERS)) if args.table else (args.chips, args.learners)
    if args.table:
        strategies = ("dp", "elastic", "decoupled")
    try:
        base = {n: _config(args, n, max(learner_list)) for n in sizes}
        for m in learner_list:
            _config(args, min(sizes), m).with_(quorum=min(args.quorum, m))
        for shards in args.shards:
            _config(args, min(sizes), max(learner_list), shards)
        if set(strategies) - {"dp", "elastic", "decoupled"}:
            raise ValueError(f"unknown strategies in {args.strategies!r}")
    except ValueError as exc:
        print(f"ddiloco simulate: error: {exc}", file=sys.stderr)
        return 2

    jobs: list[tuple[SimConfig, tuple[str, ...], tuple[int, ...] | None]] = []
    for n in sizes:
        sync = tuple(s for s in strategies if s != "decoupled")
        if sync:
            jobs.append((base[n], sync, None))
        if "decoupled" in strategies:
            jobs += [(base[n] if s == 1 else base[n].with_(shards=s), ("decoupled",), (m,))
                     for m in learner_list for s in args.shards]
    started = time.perf_counter()
    results = run_jobs(jobs, args.workers)
    wall = time.perf_counter() - started

    cfg = base[sizes[0]]
    print(f"fleet goodput simulation: MTBI {cfg.mtbi_years:g} year(s)/chip, {cfg.hours:g} h simulated "
          f"(merge level: last {cfg.merge_window_s / 3600:g} h), "
          f"step {cfg.step_s:g} s, restart {cfg.restart_s:g} s, reconfig {cfg.reconfig_s:g} s, "
          f"K={cfg.quorum}, gamma={cfg.gamma:g}, P={cfg.fragments}, H={cfg.sync_every}, tau={cfg.overlap}, "
          f"seed {cfg.seed}")
    if args.shards != [1] or math.isfinite(cfg.sync_mtbf_hours):
        mtbf = (f"a failure every {cfg.sync_mtbf_hours:g} h per shard, down {cfg.sync_restart_s:g} s each"
                if math.isfinite(cfg.sync_mtbf_hours) else "never fails")
        print(f"  synchronizer: S={','.join(map(str, args.shards))} shard(s), {mtbf}")
    for n in sizes:
        mtbi = base[n].fleet_mtbi_s
        print(f"  {fmt_chips(n)} chips: a failure every {mtbi:.1f} s" if math.isfinite(mtbi)
              else f"  {fmt_chips(n)} chips: no failures")
    print()
    print(results_table(results))
    cells: list[dict] = []
    if args.table or any(n in PAPER_GOODPUT for n in sizes):
        text, cells = paper_table(results)
        print()
        print(text)
    print(f"\nsimulated in {wall:.1f} s ({len(jobs)} runs, {min(args.workers, len(jobs))} worker(s))")

    if args.json:
        write_json(args.json, {
            "config": asdict(cfg) | {"chips": sizes, "learners": learner_list, "shards": args.shards,
                                     "strategies": list(strategies)},
            "results": [r.as_dict() for r in results],
            "paper": {"source": PAPER, "goodput_percent": {str(k): v for k, v in PAPER_GOODPUT.items()}},
            "comparison": cells,
            "wall_s": wall,
        })
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
