"""Synchronizer shards as failure domains: when each shard is down, and what that stalls.

The synchronizer may run as S shards; shard s owns the fragments p with ``p % S == s``, the same
rule the service uses (computed here from the fragment index alone, as every side of the service
does). Each shard is a process of its own, so each fails on its own: a Poisson process of rate
``1 / sync_mtbf`` while it is up, then ``sync_restart_s`` down, then up again (an alternating
renewal process; a process that is down cannot fail again). The per-process rate is the same
whatever S is, so S shards fail S times as often as one synchronizer, and each failure stalls 1/S
of the fragments.

While a shard is down its fragments are not requested and do not merge; a learner's answer for
them goes nowhere. Its inboxes and round state are in memory, so they are lost with it. The
learners lose nothing and never stop: an answer is the learner's whole progress on the fragment
since the last merge it applied, so its next answer, to the restarted shard, carries what the lost
one held. The other shards keep merging their fragments throughout.

Each shard's outages come from a random stream of their own, keyed by (seed, shard index) only:
shard 0 fails at the same times whatever S is, and the fleet's chip trace is untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddiloco.fragments.ownership import owned
from ddiloco.simulator.config import SimConfig

_STREAM = 0x53594E43
"""Key of the synchronizer's failure streams, apart from the chip trace's (seed, chips, purpose)."""


def overlap_all(intervals: list[np.ndarray]) -> float:
    """Time covered by every one of the interval sets at once (each a (k, 2) array of disjoint
    [start, end) intervals)."""
    if not intervals or any(not len(iv) for iv in intervals):
        return 0.0
    spans = np.concatenate(intervals)
    times = np.concatenate([spans[:, 0], spans[:, 1]])
    delta = np.concatenate([np.ones(len(spans)), -np.ones(len(spans))])
    order = np.lexsort((delta, times))  # at a tie, an end before a start
    times, count = times[order], np.cumsum(delta[order])
    return float(np.sum(np.diff(times)[count[:-1] == len(intervals)]))


def _clipped_length(iv: np.ndarray, a: float, b: float) -> float:
    if not len(iv):
        return 0.0
    return float(np.clip(np.minimum(iv[:, 1], b) - np.maximum(iv[:, 0], a), 0.0, None).sum())


@dataclass(frozen=True)
class SyncOutages:
    """When each shard of the synchronizer is down over the horizon."""

    shards: int
    horizon_s: float
    down: tuple[np.ndarray, ...]
    """Per shard: (k, 2) sorted, disjoint [start, end) outages, clipped to the horizon."""

    @classmethod
    def none(cls, shards: int, horizon_s: float) -> SyncOutages:
        return cls(shards, horizon_s, tuple(np.zeros((0, 2)) for _ in range(shards)))

    @classmethod
    def of(cls, shards: int, horizon_s: float, down: dict[int, list[tuple[float, float]]]) -> SyncOutages:
        """Hand-written outages ({shard: [(start, end), ...]}), e.g. one shard down for a window."""
        per = []
        for s in range(shards):
            iv = np.asarray(sorted(down.get(s, [])), dtype=float).reshape(-1, 2)
            iv = np.clip(iv, 0.0, horizon_s)
            if len(iv) and (np.any(iv[:, 1] < iv[:, 0]) or np.any(iv[1:, 0] < iv[:-1, 1])):
                raise ValueError(f"shard {s}: outages must be disjoint [start, end) intervals, got {down[s]}")
            per.append(iv)
        unknown = set(down) - set(range(shards))
        if unknown:
            raise ValueError(f"no shard {sorted(unknown)} among {shards}")
        return cls(shards, horizon_s, tuple(per))

    @property
    def failures(self) -> int:
        return sum(len(iv) for iv in self.down)

    def down_s(self, shard: int, start: float = 0.0, end: float | None = None) -> float:
        """Time ``shard`` is down within [start, end) (default: the horizon)."""
        return _clipped_length(self.down[shard], start, self.horizon_s if end is None else end)

    def is_down(self, shard: int, t: float) -> bool:
        iv = self.down[shard]
        j = int(np.searchsorted(iv[:, 0], t, side="right")) - 1 if len(iv) else -1
        return j >= 0 and t < iv[j, 1]

    def down_mask(self, shard: np.ndarray, t: np.ndarray) -> np.ndarray:
        """For each (shard, time) pair: is that shard down then (vectorised)."""
        shard, t = np.asarray(shard, dtype=np.int64), np.asarray(t, dtype=float)
        out = np.zeros(t.shape, dtype=bool)
        for s, iv in enumerate(self.down):
            if not len(iv):
                continue
            sel = shard == s
            j = np.searchsorted(iv[:, 0], t[sel], side="right") - 1
            out[sel] = (j >= 0) & (t[sel] < iv[np.clip(j, 0, None), 1])
        return out

    def all_down_s(self) -> float:
        """Time during which every shard is down at once: no fragment can merge anywhere."""
        return overlap_all(list(self.down))

    def stalled_fragment_s(self, num_fragments: int, start: float = 0.0, end: float | None = None) -> float:
        """Fragment-seconds within [start, end) during which the fragment's shard is down."""
        return sum(len(owned(num_fragments, s, self.shards)) * self.down_s(s, start, end)
                   for s in range(self.shards))


def sample_outages(cfg: SimConfig) -> SyncOutages:
    """Every shard's outages over the horizon for ``cfg`` (none when ``sync_mtbf_hours`` is inf)."""
    rate, horizon, restart = cfg.sync_failure_rate, cfg.horizon_s, cfg.sync_restart_s
    if rate == 0:
        return SyncOutages.none(cfg.shards, horizon)
    per = []
    for s in range(cfg.shards):
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, _STREAM, s]))
        spans, t = [], 0.0
        while True:
            t += float(rng.exponential(1.0 / rate))
            if t >= horizon:
                break
            spans.append((t, min(t + restart, horizon)))
            t += restart
        per.append(np.asarray(spans, dtype=float).reshape(-1, 2))
    return SyncOutages(cfg.shards, horizon, tuple(per))


def stalled_share_per_failure(outages: SyncOutages, merge_times: list[list[float]], start: float,
                              end: float) -> tuple[float, int]:
    """Measured on a merge replay over [start, end): for each outage that lies inside it, the share
    of all fragments that did not merge once while it lasted; their mean, and how many outages that
    is (nan, 0 when none lies inside). Not read from the ownership rule: from the merges."""
    times = [np.asarray(ts, dtype=float) for ts in merge_times]
    shares = []
    for iv in outages.down:
        for a, b in iv:
            if a < start or b > end or not b > a:
                continue
            idle = sum(1 for ts in times if not np.any((ts >= a) & (ts < b)))
            shares.append(idle / len(times))
    return (float(np.mean(shares)) if shares else math.nan), len(shares)
