"""What must hold after a run with faults, checked from the run's own logs.

- zero global downtime: at every moment of the training window some live learner was making
  progress that later reached the global model (``global_downtime_s`` from the goodput
  accounting, up to ``DOWNTIME_TOLERANCE_S`` of scheduling gaps between steps);
- merges continued: the longest gap between merges, and each synchronizer restart's
  restart-to-first-merge time;
- versions are monotonic per fragment across synchronizer restarts (merge log order);
- no contribution unaccounted for: every one sent ended merged, rejected or superseded with a
  result, or dropped by the learner with a reason;
- every restarted learner contributed again, with its time from start to first merged result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddiloco.core import events as schema

DOWNTIME_TOLERANCE_S = 0.5


def versions_monotonic(merge_log: Sequence[Mapping[str, Any]]) -> tuple[bool, list[str]]:
    last: dict[int, int] = {}
    problems = []
    for e in merge_log:
        if e.get("event") != schema.MERGE:
            continue
        p, v = int(e["fragment"]), int(e["version"])
        if p in last and v <= last[p]:
            problems.append(f"fragment {p}: version {v} after {last[p]}")
        last[p] = v
    return not problems, problems


def restarted_learners(logs: Mapping[str, Sequence[Mapping[str, Any]]], chaos_t: float) -> dict[str, list[dict]]:
    """Per learner id, every incarnation started after the faults began (restarts, new learners):
    when it started and how long until its first merged contribution."""
    out: dict[str, list[dict]] = {}
    for lid, events in logs.items():
        starts = {e["incarnation"]: e["t"] for e in events if e["event"] == schema.START}
        first_merge: dict[int, float] = {}
        for e in events:
            if e["event"] == schema.RESULT and e.get("outcome") == "merged":
                first_merge.setdefault(e["incarnation"], e["t"])
        for inc, t in sorted(starts.items(), key=lambda kv: kv[1]):
            if t < chaos_t:
                continue
            merged_t = first_merge.get(inc)
            out.setdefault(lid, []).append({
                "incarnation": inc, "start_t": t, "contributed_again": merged_t is not None,
                "restart_to_first_merge_s": (merged_t - t) if merged_t is not None else None})
    return out


def check(logs: Mapping[str, Sequence[Mapping[str, Any]]], merge_log: Sequence[Mapping[str, Any]],
          fleet: Mapping[str, Any], chaos_t: float) -> dict[str, Any]:
    """``chaos_t``: when the fault plan started (every learner had joined)."""
    mono, problems = versions_monotonic(merge_log)
    restarts = restarted_learners(logs, chaos_t)
    unaccounted = int(((fleet.get("contributions") or {}).get("totals") or {}).get("unaccounted", 0))
    downtime = float(fleet.get("global_downtime_s") or 0.0)
    result = {
        "zero_global_downtime": downtime <= DOWNTIME_TOLERANCE_S,
        "global_downtime_s": downtime,
        "max_merge_gap_s": fleet.get("max_merge_gap_s"),
        "restart_to_first_merge_s": fleet.get("restart_to_first_merge_s", []),
        "versions_monotonic": mono,
        "version_problems": problems[:10],
        "unaccounted_contributions": unaccounted,
        "restarted_learners": restarts,
        "every_restarted_learner_contributed": all(r["contributed_again"] for rs in restarts.values() for r in rs),
    }
    result["all_hold"] = bool(result["zero_global_downtime"] and mono and unaccounted == 0
                              and result["every_restarted_learner_contributed"])
    return result
