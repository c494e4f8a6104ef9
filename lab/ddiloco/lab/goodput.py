"""Goodput, global downtime, merge gaps and contribution accounting from a run's event logs.

The measures of success (docs/algorithm.md) are computed here, after the fact, from the JSON Lines
event logs that ``ddiloco run`` collects: one log per learner process and the synchronizer's
merge log. The precise definitions live in ``docs/goodput.md``; this module implements them.

Design decisions:

- **Pure functions over dicts.** Every function takes already-parsed events (``list[dict]``) and
  returns plain JSON-able dicts, so the orchestrator, the tests and ad-hoc notebooks compute the
  same numbers. Reading the logs from disk is ``ddiloco.lab.event_logs``.
- **Credit is given only for merged work.** A step is good for fragment p when a contribution
  of p whose outcome is ``merged`` covers it (``from_step <= step <= to_step``). Rejected,
  dropped and unanswered contributions earn nothing; a ``superseded`` one earns nothing itself
  because the newer contribution from the same base carries (and covers) its window.
- **Fragments weigh by size.** A step whose progress reached the global model for half the
  parameters is half good: its good fraction is the reached fragments' share of ``numel``.
- **Killed processes leave ragged logs.** A learner incarnation without an ``end`` event ends
  at its last event.
- **Vectorised.** Coverage uses ``searchsorted`` + difference arrays and the downtime union a
  running maximum, so tens of thousands of steps cost milliseconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddiloco.core import events as schema

OUTCOMES = ("merged", "rejected", "superseded")
TOP_DOWNTIME_INTERVALS = 10
"""How many of the longest downtime intervals ``fleet_summary`` lists."""

# ------------------------------------------------------------------------------ one learner's log


@dataclass
class _Incarnation:
    """One learner process lifetime, with the arrays the fleet-wide measures need."""

    incarnation: Any
    learner_id: Any
    start_t: float | None
    end_t: float | None
    last_t: float | None
    sizes: np.ndarray
    step_t: np.ndarray
    step_s: np.ndarray
    blocked_s: np.ndarray
    good_frac: np.ndarray
    tokens: float
    good_tokens: float
    contributions: dict[str, Any]

    @property
    def wall_s(self) -> float:
        first = self.start_t
        if first is None and len(self.step_t):
            first = float(self.step_t[0] - self.step_s[0])
        last = self.end_t if self.end_t is not None else self.last_t
        if first is None or last is None:
            return 0.0
        return max(0.0, last - first)


@dataclass
class _Bucket:
    """One incarnation's events, sorted by kind in a single pass over the log."""

    start: Mapping[str, Any] | None = None
    end: Mapping[str, Any] | None = None
    incarnation: Any = None
    last_t: float | None = None
    by_kind: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)

    def of(self, kind: str) -> list[Mapping[str, Any]]:
        return self.by_kind.get(kind, [])


def _split_incarnations(events: Iterable[Mapping[str, Any]]) -> list[_Bucket]:
    """Group events by process lifetime: a ``start`` or a change of the ``incarnation`` field begins
    a new one, so events logged before a process's ``start`` (its first ``connect``) stay with it."""
    buckets: list[_Bucket] = []
    for e in events:
        kind = e.get("event")
        inc = e.get("incarnation")
        b = buckets[-1] if buckets else None
        if (b is None or (kind == schema.START and b.start is not None)
                or (inc is not None and b.incarnation is not None and inc != b.incarnation)):
            b = _Bucket()
            buckets.append(b)
        if b.incarnation is None:
            b.incarnation = inc
        if kind == schema.START:
            b.start = e
        b.by_kind.setdefault(str(kind), []).append(e)
        if kind == schema.END:
            b.end = e
        t = e.get("t")
        if t is not None and (b.last_t is None or t > b.last_t):
            b.last_t = float(t)
    return buckets


def _fragment_sizes(bucket: _Bucket) -> np.ndarray:
    start = bucket.start
    if start is not None and start.get("fragment_sizes"):
        return np.asarray(start["fragment_sizes"], dtype=np.float64)
    n = int(start.get("num_fragments") or 0) if start is not None else 0
    if n <= 0:
        seen = [int(e["fragment"]) for kind in (schema.SEND, schema.RESULT, schema.DROPPED, schema.APPLY)
                for e in bucket.of(kind) if e.get("fragment") is not None]
        n = max(seen) + 1 if seen else 1
    return np.ones(n, dtype=np.float64)


def _analyse_incarnation(bucket: _Bucket, index: int) -> _Incarnation:
    start, end = bucket.start, bucket.end
    steps, sends = bucket.of(schema.STEP), bucket.of(schema.SEND)
    sizes = _fragment_sizes(bucket)

    step_no = np.array([e["step"] for e in steps], dtype=np.int64)
    step_t = np.array([e["t"] for e in steps], dtype=np.float64)
    step_s = np.array([e.get("step_s") or 0.0 for e in steps], dtype=np.float64)
    blocked = np.array([e.get("blocked_s") or 0.0 for e in steps], dtype=np.float64)
    tokens = np.array([e.get("tokens") or 0.0 for e in steps], dtype=np.float64)

    outcome, accounting = _resolve_contributions(sends, bucket.of(schema.RESULT), bucket.of(schema.DROPPED))
    merged_windows: dict[int, list[tuple[int, int]]] = {}
    for send, out in zip(sends, outcome, strict=True):
        if out == "merged":
            merged_windows.setdefault(int(send["fragment"]), []).append(
                (int(send["from_step"]), int(send["to_step"])))
    good_frac = _good_fraction(step_no, merged_windows, sizes)

    token_deltas = np.diff(tokens, prepend=0.0)
    return _Incarnation(
        incarnation=start.get("incarnation", index) if start is not None else index,
        learner_id=start.get("learner_id") if start is not None else None,
        start_t=float(start["t"]) if start is not None else None,
        end_t=float(end["t"]) if end is not None else None,
        last_t=bucket.last_t,
        sizes=sizes, step_t=step_t, step_s=step_s, blocked_s=blocked, good_frac=good_frac,
        tokens=float(tokens.max()) if len(tokens) else 0.0,
        good_tokens=float(np.dot(token_deltas, good_frac)),
        contributions=accounting,
    )


LOOP_GAP_S = 0.25
"""A gap this short between two steps of one learner is its own loop's work (sampling the next
batch, handing a fragment over, logging), not an absence of progress: for global downtime the
step is taken to start where the previous one ended."""


def _busy_starts(step_t: np.ndarray, step_s: np.ndarray) -> np.ndarray:
    starts = step_t - step_s
    if len(step_t) > 1:
        gap = starts[1:] - step_t[:-1]
        bridge = (gap >= 0) & (gap <= LOOP_GAP_S)
        starts[1:] = np.where(bridge, step_t[:-1], starts[1:])
    return starts


def _good_fraction(step_no: np.ndarray, windows: Mapping[int, list[tuple[int, int]]],
                   sizes: np.ndarray) -> np.ndarray:
    """Per step, the size share of fragments whose merged contributions cover that step."""
    n = len(step_no)
    good = np.zeros(n, dtype=np.float64)
    total = float(sizes.sum())
    if n == 0 or total <= 0:
        return good
    order = np.argsort(step_no, kind="stable")
    sorted_steps = step_no[order]
    for fragment, spans in windows.items():
        if not 0 <= fragment < len(sizes):
            continue
        lo, hi = np.asarray(spans, dtype=np.int64).T
        diff = np.zeros(n + 1, dtype=np.int64)
        np.add.at(diff, np.searchsorted(sorted_steps, lo, side="left"), 1)
        np.add.at(diff, np.searchsorted(sorted_steps, hi, side="right"), -1)
        covered = np.cumsum(diff[:n]) > 0
        good[order[covered]] += sizes[fragment]
    return good / total


def _resolve_contributions(
    sends: Sequence[Mapping[str, Any]],
    results: Sequence[Mapping[str, Any]],
    drops: Sequence[Mapping[str, Any]],
) -> tuple[list[str | None], dict[str, Any]]:
    """Each send's final outcome, and the incarnation's accounting of them.

    A send's outcome is ``merged`` if any result says so, else its last result's outcome, else
    ``dropped`` if the learner dropped it, else unaccounted (``None``).
    """
    by_key: dict[tuple[int, int], int] = {}
    by_seq: dict[int, list[int]] = {}
    for k, s in enumerate(sends):
        seq = int(s["sequence"])
        by_key[(int(s["fragment"]), seq)] = k
        by_seq.setdefault(seq, []).append(k)

    def match(e: Mapping[str, Any]) -> int | None:
        seq = e.get("sequence")
        if seq is None:
            return None
        frag = e.get("fragment")
        if frag is not None:
            return by_key.get((int(frag), int(seq)))
        candidates = by_seq.get(int(seq), [])
        return candidates[0] if len(candidates) == 1 else None

    outcomes: list[str | None] = [None] * len(sends)
    reasons: list[str] = [""] * len(sends)
    unmatched_results = 0
    for r in results:
        i = match(r)
        if i is None:
            unmatched_results += 1
        elif outcomes[i] != "merged":
            out = str(r.get("outcome"))
            if out in OUTCOMES:
                outcomes[i], reasons[i] = out, str(r.get("reason") or "unspecified")
            else:
                outcomes[i], reasons[i] = "rejected", f"outcome:{out}"
    unmatched_drops = 0
    for d in drops:
        j = match(d)
        if j is None:
            unmatched_drops += 1
        elif outcomes[j] is None:
            outcomes[j], reasons[j] = "dropped", str(d.get("reason") or "unspecified")

    counts = Counter(o for o in outcomes if o is not None)
    rejected_by = Counter(reasons[i] for i, o in enumerate(outcomes) if o == "rejected")
    dropped_by = Counter(reasons[i] for i, o in enumerate(outcomes) if o == "dropped")
    unaccounted = [
        {"sequence": int(s["sequence"]), "fragment": int(s["fragment"]), "t": float(s.get("t", 0.0))}
        for s, o in zip(sends, outcomes, strict=True) if o is None
    ]
    return outcomes, {
        "sent": len(sends),
        "merged": counts["merged"],
        "rejected": counts["rejected"],
        "rejected_by_reason": dict(rejected_by),
        "superseded": counts["superseded"],
        "dropped": counts["dropped"],
        "dropped_by_reason": dict(dropped_by),
        "unaccounted": len(unaccounted),
        "unaccounted_sequences": unaccounted,
        "unmatched_results": unmatched_results,
        "unmatched_drops": unmatched_drops,
    }


_COUNT_KEYS = ("sent", "merged", "rejected", "superseded", "dropped", "unaccounted",
               "unmatched_results", "unmatched_drops")


def _sum_contributions(parts: Iterable[tuple[Any, Mapping[str, Any]]], tag: str) -> dict[str, Any]:
    """Add up accounting dicts; unaccounted sequences are tagged with ``tag`` = their owner key."""
    total: dict[str, Any] = {k: 0 for k in _COUNT_KEYS}
    rejected: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    unaccounted: list[dict[str, Any]] = []
    for owner, c in parts:
        for k in _COUNT_KEYS:
            total[k] += c[k]
        rejected.update(c["rejected_by_reason"])
        dropped.update(c["dropped_by_reason"])
        unaccounted.extend({tag: owner, **u} for u in c["unaccounted_sequences"])
    total["rejected_by_reason"] = dict(rejected)
    total["dropped_by_reason"] = dict(dropped)
    total["unaccounted_sequences"] = unaccounted
    return total


KILLED_IN_FLIGHT = "in flight when the learner process was killed"


def _resolve_from_synchronizer(per_learner: Mapping[str, dict[str, Any]],
                               merge_log: Sequence[Mapping[str, Any]]) -> None:
    """Settle contributions a learner never heard back about, from the synchronizer's own log.

    A process killed right after sending cannot log the result; the synchronizer's merge log
    records every merged (learner, incarnation, sequence) and every rejection. What neither side
    recorded, from a process that was killed, was lost in flight with it (dropped, with that
    reason). Contributions of processes that ended normally stay unaccounted if unanswered.
    """
    merged: set[tuple[str, int, int]] = set()
    rejected: dict[tuple[str, int, int], str] = {}
    for e in merge_log:
        if e.get("event") == schema.MERGE:
            for lid, inc, seq in e.get("contributions") or ():
                merged.add((str(lid), int(inc), int(seq)))
        elif e.get("event") == schema.REJECT:
            rejected[(str(e["learner"]), int(e["incarnation"]), int(e["sequence"]))] = str(e.get("reason", ""))
    for lid, report in per_learner.items():
        c = report["contributions"]
        killed = {int(i["incarnation"]) for i in report.get("incarnations", []) if i.get("killed")}
        keep = []
        for u in c["unaccounted_sequences"]:
            key = (lid, int(u["incarnation"]), int(u["sequence"]))
            if key in merged:
                c["merged"] += 1
            elif key in rejected:
                c["rejected"] += 1
                c["rejected_by_reason"][rejected[key]] = c["rejected_by_reason"].get(rejected[key], 0) + 1
            elif key[1] in killed:
                c["dropped"] += 1
                c["dropped_by_reason"][KILLED_IN_FLIGHT] = c["dropped_by_reason"].get(KILLED_IN_FLIGHT, 0) + 1
            else:
                keep.append(u)
                continue
            c["unaccounted"] -= 1
        c["unaccounted_sequences"] = keep


def _share(num: float, den: float) -> float:
    return float(num / den) if den > 0 else 0.0


def _time_shares(wall: float, compute: float, blocked: float, good: float) -> dict[str, float]:
    return {"wall_s": wall, "compute_s": compute, "blocked_s": blocked, "good_s": good,
            "goodput": _share(good, wall), "compute_share": _share(compute, wall),
            "blocked_share": _share(blocked, wall)}


def _incarnation_report(inc: _Incarnation) -> dict[str, Any]:
    wall = inc.wall_s
    compute = float(inc.step_s.sum())
    blocked = float(inc.blocked_s.sum())
    good = float(np.dot(inc.step_s, inc.good_frac))
    return {
        "incarnation": inc.incarnation,
        "start_t": inc.start_t,
        "end_t": inc.end_t if inc.end_t is not None else inc.last_t,
        "killed": inc.end_t is None,
        "steps": len(inc.step_t),
        "tokens": inc.tokens,
        "good_tokens": inc.good_tokens,
        **_time_shares(wall, compute, blocked, good),
        "contributions": inc.contributions,
    }


def _analyse_learner(events: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], list[_Incarnation]]:
    incs = [_analyse_incarnation(g, i) for i, g in enumerate(_split_incarnations(events))]
    reports = [_incarnation_report(i) for i in incs]
    wall = sum(r["wall_s"] for r in reports)
    compute = sum(r["compute_s"] for r in reports)
    blocked = sum(r["blocked_s"] for r in reports)
    good = sum(r["good_s"] for r in reports)
    lid = next((i.learner_id for i in incs if i.learner_id is not None), None)
    report = {
        "learner_id": lid,
        "incarnations": reports,
        "restarts": max(0, len(reports) - 1),
        "steps": sum(r["steps"] for r in reports),
        "tokens": sum(r["tokens"] for r in reports),
        "good_tokens": sum(r["good_tokens"] for r in reports),
        **_time_shares(wall, compute, blocked, good),
        "contributions": _sum_contributions(
            ((r["incarnation"], r["contributions"]) for r in reports), "incarnation"),
    }
    return report, incs


def learner_goodput(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Goodput and contribution accounting of one learner log (all its incarnations).

    Returns a JSON-able dict with keys ``learner_id``, ``incarnations`` (one dict per process
    lifetime with the keys below plus ``incarnation``, ``start_t``, ``end_t``, ``killed``),
    ``restarts``, ``steps``, ``tokens``, ``good_tokens``, ``wall_s``, ``compute_s``,
    ``blocked_s``, ``good_s``, ``goodput`` (= good_s / wall_s), ``compute_share``,
    ``blocked_share`` and ``contributions`` (``sent``, ``merged``, ``rejected``,
    ``rejected_by_reason``, ``superseded``, ``dropped``, ``dropped_by_reason``, ``unaccounted``,
    ``unaccounted_sequences``, ``unmatched_results``, ``unmatched_drops``).
    """
    return _analyse_learner(events)[0]


# ------------------------------------------------------------------------------------ fleet-wide


def _union_gaps(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Gaps ``[[a, b], ...]`` of ``[lo, hi]`` not covered by any interval ``[starts[i], ends[i]]``."""
    if len(starts) == 0:
        return np.array([[lo, hi]]) if hi > lo else np.empty((0, 2))
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    begins = np.concatenate(([True], s[1:] > reach[:-1]))
    seg_start = s[begins]
    seg_end = reach[np.concatenate((np.flatnonzero(begins)[1:] - 1, [len(s) - 1]))]
    gap_lo = np.concatenate(([lo], seg_end))
    gap_hi = np.concatenate((seg_start, [hi]))
    gap_lo, gap_hi = np.maximum(gap_lo, lo), np.minimum(gap_hi, hi)
    keep = gap_hi > gap_lo
    return np.stack((gap_lo[keep], gap_hi[keep]), axis=1)


def _merge_timing(merge_log: Sequence[Mapping[str, Any]], window: tuple[float, float] | None) -> dict[str, Any]:
    log = sorted(merge_log, key=lambda e: float(e.get("t", 0.0)))
    merge_t = np.array([float(e["t"]) for e in log if e.get("event") == schema.MERGE], dtype=np.float64)
    per_fragment = Counter(int(e["fragment"]) for e in log if e.get("event") == schema.MERGE and "fragment" in e)

    max_gap: float | None = None
    gap_at: list[float] | None = None
    if window is not None:
        lo, hi = window
        inside = merge_t[(merge_t >= lo) & (merge_t <= hi)]
        points = np.concatenate(([lo], inside, [hi]))
        gaps = np.diff(points)
        k = int(np.argmax(gaps))
        max_gap, gap_at = float(gaps[k]), [float(points[k]), float(points[k + 1])]

    restarts: list[dict[str, Any]] = []
    stop_t: float | None = None
    for e in log:
        kind = e.get("event")
        if kind == schema.SYNC_STOP:
            stop_t = float(e["t"])
        elif kind == schema.SYNC_START and stop_t is not None:
            start_t = float(e["t"])
            next_stop = next((float(x["t"]) for x in log if x.get("event") == schema.SYNC_STOP
                              and float(x["t"]) > start_t), np.inf)
            after = merge_t[(merge_t >= start_t) & (merge_t < next_stop)]
            first = float(after.min()) if len(after) else None
            restarts.append({
                "stop_t": stop_t,
                "start_t": start_t,
                "down_s": start_t - stop_t,
                "first_merge_t": first,
                "restart_to_first_merge_s": first - start_t if first is not None else None,
                "stop_to_first_merge_s": first - stop_t if first is not None else None,
            })
            stop_t = None
    return {
        "merges": len(merge_t),
        "merges_per_fragment": {str(k): v for k, v in sorted(per_fragment.items())},
        "max_merge_gap_s": max_gap,
        "max_merge_gap_at": gap_at,
        "sync_restarts": restarts,
        "restart_to_first_merge_s": [r["restart_to_first_merge_s"] for r in restarts],
        "rounds": round_summary(log),
    }


def round_summary(merge_log: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How the merges went, per fragment and overall: participation (contributions per merge), the
    share of merged contributions that were stale (re-anchored from an older version), and the
    longest a merge waited from its round's request (``wait_s``)."""
    merges = [e for e in merge_log if e.get("event") == schema.MERGE]

    def stats(of: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        sizes = [int(e.get("quorum") or len(e.get("learners") or [])) for e in of]
        staleness = [int(s) for e in of for s in e.get("staleness") or []]
        waits = [float(e["wait_s"]) for e in of if e.get("wait_s") is not None]
        return {
            "merges": len(of),
            "participation_mean": float(np.mean(sizes)) if sizes else None,
            "participation_min": min(sizes) if sizes else None,
            "stale_share": _share(sum(1 for s in staleness if s > 0), len(staleness)),
            "max_merge_wait_s": max(waits) if waits else None,
            "mean_merge_wait_s": float(np.mean(waits)) if waits else None,
        }

    by_fragment: dict[int, list[Mapping[str, Any]]] = {}
    for e in merges:
        by_fragment.setdefault(int(e.get("fragment", 0)), []).append(e)
    return {**stats(merges), "per_fragment": {str(p): stats(of) for p, of in sorted(by_fragment.items())}}


def fleet_summary(learner_logs: Mapping[str, Sequence[Mapping[str, Any]]],
                  merge_log: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Fleet-wide goodput, downtime, merge gaps and contribution accounting of one run.

    Returns a JSON-able dict with keys:

    - ``learner_goodput``: sum of good seconds / sum of wall seconds over all learner incarnations;
      ``compute_share`` and ``blocked_share`` likewise; ``wall_s``, ``good_s``, ``compute_s``,
      ``blocked_s``, ``steps``, ``tokens``, ``good_tokens`` are the fleet sums.
    - ``training_window``: ``[start, end]`` = [earliest step start, latest end of a good step
      (of any step when none is good)] (``None`` without steps); ``global_downtime_s`` (time in it with no good step running anywhere) and
      ``downtime_intervals`` (the longest such gaps, ``[start, end]``, longest first).
    - ``merges``, ``merges_per_fragment``, ``max_merge_gap_s`` and ``max_merge_gap_at``,
      ``sync_restarts`` (per stop/start pair: ``stop_t``, ``start_t``, ``down_s``,
      ``first_merge_t``, ``restart_to_first_merge_s``, ``stop_to_first_merge_s``) and
      ``restart_to_first_merge_s`` (the list of those values).
    - ``contributions``: ``{"per_learner": {id: accounting}, "totals": accounting}`` where the
      totals' ``unaccounted_sequences`` carry ``learner`` and ``incarnation``;
      ``rejected_contributions`` = total rejected.
    - ``per_learner``: ``{id: learner_goodput(...)}``.
    """
    per_learner: dict[str, dict[str, Any]] = {}
    incs: list[_Incarnation] = []
    for lid, events in learner_logs.items():
        report, learner_incs = _analyse_learner(events)
        per_learner[str(lid)] = report
        incs.extend(learner_incs)

    def total(key: str) -> float:
        return float(sum(r[key] for r in per_learner.values()))

    step_t = np.concatenate([i.step_t for i in incs]) if incs else np.empty(0)
    good_frac = np.concatenate([i.good_frac for i in incs]) if incs else np.empty(0)
    starts = np.concatenate([_busy_starts(i.step_t, i.step_s) for i in incs]) if incs else np.empty(0)
    window: tuple[float, float] | None = None
    downtime, intervals = None, np.empty((0, 2))
    if len(step_t):
        good = good_frac > 0
        # The window closes with the last good step: a learner whose work never reaches the model
        # (refused, or cut off before its last answer) and trains on after the others have
        # finished does not keep the run open, nor make its tail downtime.
        window = (float(starts.min()), float(step_t[good].max() if good.any() else step_t.max()))
        intervals = _union_gaps(starts[good], step_t[good], *window)
        downtime = float((intervals[:, 1] - intervals[:, 0]).sum())
    longest = intervals[np.argsort(intervals[:, 0] - intervals[:, 1], kind="stable")][:TOP_DOWNTIME_INTERVALS]

    _resolve_from_synchronizer(per_learner, merge_log)
    contributions = {
        "per_learner": {lid: r["contributions"] for lid, r in per_learner.items()},
        "totals": _sum_contributions(
            ((lid, r["contributions"]) for lid, r in per_learner.items()), "learner"),
    }
    wall = total("wall_s")
    summary: dict[str, Any] = {
        "learners": len(per_learner),
        "learner_goodput": _share(total("good_s"), wall),
        "compute_share": _share(total("compute_s"), wall),
        "blocked_share": _share(total("blocked_s"), wall),
        "wall_s": wall,
        "good_s": total("good_s"),
        "compute_s": total("compute_s"),
        "blocked_s": total("blocked_s"),
        "steps": int(total("steps")),
        "tokens": total("tokens"),
        "good_tokens": total("good_tokens"),
        "training_window": list(window) if window is not None else None,
        "global_downtime_s": downtime,
        "downtime_intervals": longest.tolist(),
        **_merge_timing(merge_log, window),
        "contributions": contributions,
        "rejected_contributions": contributions["totals"]["rejected"],
        "per_learner": per_learner,
    }
    return summary
