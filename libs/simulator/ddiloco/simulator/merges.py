"""The synchronizer at fleet scale: every fragment round of a decoupled run, as the service runs it.

Rounds are clocked by the synchronizer: fragment p falls due on the fleet's clock (the service's
own ``FleetClock``, at the pace of the K-th fastest learner), every learner that is up is asked
for it and answers at its next step completion (each learner's step clock comes from its
``JobResult``: running segments and pauses). This module replays the requests, the answers, the
learners' drop-outs and returns, and the grace wake-ups in time order, and runs each fragment's
round through the service's state machine (``ddiloco.algorithm.round.RoundState``: request,
quorum latch, freshness, grace, timeout); ``token_weights`` weighs each merge, ``RunningAverage``
keeps the step, quorum and sync times that feed the grace window. Nothing here re-implements a
decision. The pace is taken from the learners' nominal step times (a learner that is down does
not pace the service's clock either, but at equal nominal speeds that changes nothing).

Cost is one decision per answer or wake-up, M x P x (window / step) answers in all: independent
of the number of chips. The replay covers the last ``cfg.merge_window_s`` of the horizon
(learners' step clocks come from the full-horizon jobs, so their phases at the window's start are
those the failures left); the caller scales the late-merge loss to the horizon.

What the merge level can lose: a learner applies the merged fragment ``tau`` steps after it sent
its answer (the overlap the algorithm is built on, not a loss). When the merge comes back later
than that, because the round waited for a quorum or for stragglers, the learner's progress on
that fragment between its apply step and the merge's arrival is overwritten on arrival (the
paper's ``overwrite`` policy): ``1/P`` of the learner's chip-time over that window is lost. A
learner that is down is not asked and is not live, so the round does not wait for it; an answer
that arrives after its round merged waits for the fragment's next round.

A sharded synchronizer (``cfg.shards`` = S) runs fragment p's rounds on shard ``p % S``, each
shard with its own running averages. A shard that is down (``shards.SyncOutages``) requests
nothing and receives nothing; when it fails, its fragments' inboxes, round state, pending
wake-ups and averages are lost (the contributions they held are counted as dropped; their
progress is carried by the learners' next answers, so nothing is charged for them). The other
shards' rounds go on as if nothing happened.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from ddiloco.algorithm import policies
from ddiloco.algorithm.fleet_clock import FleetClock, fleet_pace
from ddiloco.algorithm.round import RoundRules, RoundState, Waiting
from ddiloco.core.averages import RunningAverage
from ddiloco.fragments.ownership import owned, owner
from ddiloco.simulator.config import SimConfig
from ddiloco.simulator.shards import SyncOutages
from ddiloco.simulator.spmd import JobResult

_REQUEST, _ANSWER, _DOWN, _UP, _SHARD_DOWN = 0, 1, 2, 3, 4


@dataclass
class MergeStats:
    merges: int = 0
    contributions: int = 0
    replaced: int = 0
    """Contributions superseded by a newer one from the same learner before their round merged."""
    decide_calls: int = 0
    late_chip_s: float = 0.0
    """Learner chip-time overwritten because a merge arrived after the learner's apply step."""
    contributors_sum: int = 0
    effective_sum: float = 0.0
    grace_sum: float = 0.0
    max_merge_gap_s: float = 0.0
    window_s: float = 0.0
    """Length of the replayed window (the end of the horizon)."""
    reasons: Counter = field(default_factory=Counter)
    dropped: int = 0
    """Contributions waiting in a shard's inbox when the shard failed (their progress is carried)."""
    merge_times: list[list[float]] = field(default_factory=list)
    """Per fragment: when each of its merges was decided, in order."""

    def max_fragment_gap_s(self, start: float, end: float) -> float:
        """The longest time any one fragment went without a merge in [start, end)."""
        gap = 0.0
        for ts in self.merge_times:
            edges = [start, *ts, end]
            gap = max(gap, max(b - a for a, b in pairwise(edges)))
        return gap

    def as_dict(self) -> dict:
        n = max(1, self.merges)
        return {
            "merge_window_hours": self.window_s / 3600.0,
            "merges_in_window": self.merges,
            "merges_per_hour": self.merges / (self.window_s / 3600.0) if self.window_s else 0.0,
            "contributions": self.contributions,
            "replaced_contributions": self.replaced,
            "decide_calls": self.decide_calls,
            "mean_contributors_per_merge": self.contributors_sum / n,
            "mean_effective_learners_per_merge": self.effective_sum / n,
            "mean_grace_s": self.grace_sum / n,
            "max_merge_gap_s": self.max_merge_gap_s,
            "merge_reasons": dict(self.reasons),
        }


def _reason_kind(reason: str) -> str:
    """Group the policy's reason strings ("all 8 live learners contributed", "quorum 3/1; grace ...")."""
    if reason.startswith("all"):
        return "all live learners contributed"
    if reason.startswith("tim"):
        return "timeout"
    return "quorum + grace elapsed"


def _step_events(job: JobResult) -> tuple[np.ndarray, np.ndarray]:
    """Completion time and step number of every inner step the job finished."""
    if not job.segments:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    seg = np.asarray(job.segments, dtype=float)
    starts, ends, first = seg[:, 0], seg[:, 1], seg[:, 2].astype(np.int64)
    n = np.floor((ends - starts) / job.step_s + 1e-9).astype(np.int64).clip(min=0)
    idx = np.repeat(np.arange(len(n)), n)
    within = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n) + 1
    return starts[idx] + within * job.step_s, first[idx] + within


def _requests(cfg: SimConfig, jobs: list[JobResult], start: float, horizon: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(time, fragment, round) of every request in [start, horizon), from the service's fleet clock."""
    schedule = cfg.schedule()
    pace = fleet_pace([job.step_s for job in jobs], cfg.quorum)
    clock = FleetClock(schedule, now=0.0)
    clock.set_pace(0.0, pace)
    times, frags, rounds = [], [], []
    while True:
        at = clock.next_due_at(clock.at)
        if at is None or at >= horizon:
            break
        for p, r in clock.due(at):
            if at >= start:
                times.append(at)
                frags.append(p)
                rounds.append(r)
    return np.asarray(times), np.asarray(frags, dtype=np.int64), np.asarray(rounds, dtype=np.int64)


def _answers(job: JobResult, req_t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the requests at ``req_t``: which this learner answers (it is up when asked and steps
    afterwards), when (the end of the step in progress: its next step completion after the
    request) and at which of its steps."""
    times, steps = _step_events(job)
    idx = np.searchsorted(times, req_t, side="right")
    ok = idx < times.size
    if len(job.pauses):
        j = np.searchsorted(job.pauses[:, 0], req_t, side="right") - 1
        paused = (j >= 0) & (req_t < job.pauses[np.clip(j, 0, None), 1])
        ok &= ~paused
    idx = np.clip(idx, 0, max(0, times.size - 1))
    if not times.size:
        return ok, np.zeros(req_t.size), np.zeros(req_t.size, dtype=np.int64)
    return ok, times[idx], steps[idx]


class _Uptime:
    """Running time of one learner over an interval (bisect over its pauses)."""

    def __init__(self, job: JobResult) -> None:
        self.starts = job.pauses[:, 0].tolist()
        self.ends = job.pauses[:, 1].tolist()
        cum = [0.0]
        for s, e in zip(self.starts, self.ends, strict=True):
            cum.append(cum[-1] + e - s)
        self.cum = cum

    def _paused(self, t: float) -> float:
        j = bisect_right(self.starts, t)
        if j == 0:
            return 0.0
        return self.cum[j - 1] + min(t - self.starts[j - 1], self.ends[j - 1] - self.starts[j - 1])

    def between(self, a: float, b: float) -> float:
        return max(0.0, (b - a) - (self._paused(b) - self._paused(a)))


def simulate_merges(cfg: SimConfig, jobs: list[JobResult], outages: SyncOutages | None = None) -> MergeStats:
    """Replay every fragment round of a decoupled run with M = len(jobs) learners over the merge window,
    with the synchronizer's shards down during ``outages`` (default: never)."""
    schedule = cfg.schedule()
    policy = cfg.policy()
    tau, frags, horizon = schedule.overlap, schedule.num_fragments, cfg.horizon_s
    start = horizon - cfg.merge_window_s
    names = [f"learner-{m}" for m in range(len(jobs))]
    step_of = [job.step_s for job in jobs]
    chips_of = [job.chips for job in jobs]
    sync_s = cfg.sync_s
    reasons: Counter = Counter()
    # Chip-time per second of a learner that is compute (its stragglers' wait is already charged).
    compute_rate = [job.chips / job.slow_factor for job in jobs]
    uptime = [_Uptime(job) for job in jobs]

    req_t, req_p, req_r = _requests(cfg, jobs, start, horizon)
    n_shards = cfg.shards
    shard_of = [owner(p, n_shards) for p in range(frags)]
    shard_arr = np.asarray(shard_of, dtype=np.int64)
    if outages is None:
        outages = SyncOutages.none(n_shards, horizon)
    if outages.shards != n_shards:
        raise ValueError(f"outages are given for {outages.shards} shards, the config has {n_shards}")
    failing = outages.failures > 0
    if failing:
        up = ~outages.down_mask(shard_arr[req_p], req_t)  # a shard that is down requests nothing
        req_t, req_p, req_r = req_t[up], req_p[up], req_r[up]
    cols_t, cols_k, cols_m, cols_p, cols_s = [req_t], [np.full(req_t.size, _REQUEST)], [np.zeros(req_t.size, np.int64)], \
        [req_p], [req_r]
    cols_r = [req_r]
    """The round each event belongs to: a request's own, an answer's request's."""
    for m, job in enumerate(jobs):
        ok, at, step = _answers(job, req_t)
        if failing:
            ok &= ~outages.down_mask(shard_arr[req_p], at)  # nobody receives an answer to a shard that is down
        n_a, n_p = int(ok.sum()), len(job.pauses)
        cols_t += [at[ok], job.pauses[:, 0], job.pauses[:, 1]]
        cols_k += [np.full(n_a, _ANSWER), np.full(n_p, _DOWN), np.full(n_p, _UP)]
        cols_m += [np.full(n_a + 2 * n_p, m)]
        cols_p += [req_p[ok], np.zeros(2 * n_p, dtype=np.int64)]
        cols_s += [step[ok], np.zeros(2 * n_p, dtype=np.int64)]
        cols_r += [req_r[ok], np.zeros(2 * n_p, dtype=np.int64)]
    if failing:
        for s, iv in enumerate(outages.down):
            cols_t.append(iv[:, 0])
            cols_k.append(np.full(len(iv), _SHARD_DOWN))
            cols_m.append(np.full(len(iv), s, dtype=np.int64))
            cols_p.append(np.zeros(len(iv), dtype=np.int64))
            cols_s.append(np.zeros(len(iv), dtype=np.int64))
            cols_r.append(np.zeros(len(iv), dtype=np.int64))
    ev_t, ev_k = np.concatenate(cols_t), np.concatenate(cols_k)
    ev_m, ev_p, ev_s = np.concatenate(cols_m), np.concatenate(cols_p), np.concatenate(cols_s)
    ev_r = np.concatenate(cols_r)
    keep = (ev_t >= start) & (ev_t < horizon)
    order = np.lexsort((ev_k[keep], ev_t[keep]))  # by time; at a tie: requests, answers, drop-outs, returns, shard failures
    events = zip(ev_t[keep][order].tolist(), ev_k[keep][order].tolist(), ev_m[keep][order].tolist(),
                 ev_p[keep][order].tolist(), ev_s[keep][order].tolist(), ev_r[keep][order].tolist(), strict=True)

    stats = MergeStats(window_s=horizon - start, merge_times=[[] for _ in range(frags)])
    # Each shard keeps its own running averages (one set when S = 1: the one synchronizer's).
    step_avg = [RunningAverage(initial=float(np.mean(step_of))) for _ in range(n_shards)]
    quorum_avg = [RunningAverage() for _ in range(n_shards)]
    sync_avg = [RunningAverage() for _ in range(n_shards)]
    timings = [policies.Timings(step_time_s=step_avg[s].get(), quorum_time_s=0.0, sync_time_s=0.0)
               for s in range(n_shards)]
    rules = RoundRules(policy=policy, overlap=tau)
    rounds = [RoundState() for _ in range(frags)]
    inbox: list[dict[str, tuple[float, int, int, int]]] = [{} for _ in range(frags)]
    round_id = [0] * frags
    # Step of each learner's last merged contribution per fragment (None: none yet in the window,
    # counted as one nominal H-step period for the token weights).
    last_merged_step: list[list[int | None]] = [[None] * frags for _ in jobs]
    period = schedule.sync_every
    live = {names[m] for m, job in enumerate(jobs) if not job.is_paused(start)}
    live_view = frozenset(live)
    wakes: list[tuple[float, int, int, int]] = []
    wake_seq = 0
    last_merge_at = start

    def refresh_timings(s: int) -> None:
        now_t = (step_avg[s].get(), quorum_avg[s].get(), sync_avg[s].get())
        t = timings[s]
        if now_t != (t.step_time_s, t.quorum_time_s, t.sync_time_s):
            timings[s] = policies.Timings(*now_t)

    def evaluate(p: int, now: float) -> None:
        nonlocal wake_seq, last_merge_at
        box, state, s = inbox[p], rounds[p], shard_of[p]
        latched = state.quorum_at
        waiting = [Waiting(name, 0, sent_at, round_no) for name, (sent_at, _, _, round_no) in box.items()]
        decision = state.decide(now, waiting, 0, live_view, timings[s], rules)
        if latched is None and state.quorum_at is not None:
            quorum_avg[s].update(state.quorum_time_s)
            refresh_timings(s)
        stats.decide_calls += 1
        if not decision.merge:
            if decision.wake_at is not None:
                wake_seq += 1
                heapq.heappush(wakes, (decision.wake_at, wake_seq, p, round_id[p]))
            return
        arrive = now + sync_s
        tokens, steps, step_sum = [], [], 0.0
        last = last_merged_step
        for sent_at, step, m, _ in box.values():
            apply_at = sent_at + tau * step_of[m]
            if arrive > apply_at:
                stats.late_chip_s += compute_rate[m] / frags * uptime[m].between(apply_at, arrive)
            prev = last[m][p]
            done = period if prev is None else step - prev
            last[m][p] = step
            tokens.append(chips_of[m] * done)
            steps.append(done)
            step_sum += step_of[m]
        weights = policies.token_weights(tokens, steps)
        step_avg[s].update(step_sum / len(box))
        sync_avg[s].update(sync_s)
        refresh_timings(s)
        stats.merges += 1
        stats.merge_times[p].append(now)
        stats.contributors_sum += len(box)
        stats.effective_sum += 1.0 / sum(w * w for w in weights)
        stats.grace_sum += decision.grace_s
        reasons[decision.reason[:3]] += 1
        if now - last_merge_at > stats.max_merge_gap_s:
            stats.max_merge_gap_s = now - last_merge_at
        last_merge_at = now
        box.clear()
        state.close()
        round_id[p] += 1

    def wake_until(t: float) -> None:
        while wakes and wakes[0][0] <= t:
            at, _, p, rid = heapq.heappop(wakes)
            if rid == round_id[p]:
                evaluate(p, at)

    for t, kind, m, p, step, round_no in events:
        if wakes and wakes[0][0] <= t:
            wake_until(t)
        if kind == _REQUEST:
            rounds[p].open(t, step, waiting=bool(inbox[p]), asked=live_view)
            if inbox[p]:
                evaluate(p, t)
        elif kind == _ANSWER:
            stats.contributions += 1
            box = inbox[p]
            name = names[m]
            if name in box:
                stats.replaced += 1  # the newer contribution carries the older one's progress
            box[name] = (t, step, m, round_no)
            evaluate(p, t)
        elif kind == _DOWN:
            live.discard(names[m])
            live_view = frozenset(live)
            for q in range(frags):  # a drop-out can complete "every live learner contributed"
                if inbox[q]:
                    evaluate(q, t)
        elif kind == _UP:
            live.add(names[m])
            live_view = frozenset(live)
        else:  # shard m failed: what it held in memory is gone, its pending wake-ups with it
            for q in owned(frags, m, n_shards):
                stats.dropped += len(inbox[q])
                inbox[q].clear()
                rounds[q] = RoundState()
                round_id[q] += 1
            step_avg[m] = RunningAverage(initial=float(np.mean(step_of)))
            quorum_avg[m], sync_avg[m] = RunningAverage(), RunningAverage()
            timings[m] = policies.Timings(step_time_s=step_avg[m].get(), quorum_time_s=0.0, sync_time_s=0.0)
    wake_until(horizon)
    stats.max_merge_gap_s = max(stats.max_merge_gap_s, horizon - last_merge_at)
    for prefix, count in reasons.items():
        stats.reasons[_reason_kind(prefix)] += count
    return stats
