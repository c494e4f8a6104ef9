"""A sharded synchronizer in the fleet simulator: shard s owns fragments p % S == s, each shard fails
and restarts on its own, and a shard's outage stalls only its own fragments' merges.

Checked: one shard with no synchronizer failures reproduces numbers pinned from before shards
existed; one shard down for a hand-placed window leaves exactly its fragments without merges in it
while the others merge throughout and nobody's training stops; under a random failure process the
share of fragments one failure stalls, measured on the merge replay, falls as 1/S; bad input is
refused with a message that says what is wrong.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ddiloco.fragments.ownership import owned
from ddiloco.simulator import SimConfig, run_job, sample_trace, simulate, simulate_decoupled
from ddiloco.simulator.cli import main
from ddiloco.simulator.merges import simulate_merges
from ddiloco.simulator.shards import SyncOutages, sample_outages

QUIET = dict(chips=1_200_000, learners=4, mtbi_years=math.inf, hours=1.0, merge_hours=0.0)
"""No chip failures: every learner steps in phase, so every round's merges are predictable."""


@pytest.mark.parametrize("cfg,expected", [
    # Pinned from the simulator before shards existed (same seed, same trace).
    (SimConfig(hours=6, merge_hours=1),
     dict(goodput=0.90795985895514, merges=10800, late=3.39128341709351e-05, decide_calls=13799,
          grace=0.11884119276102525)),
    (SimConfig(chips=600_000, learners=4, overlap=1, quorum=2, hours=3, merge_hours=0.5, learner_recovery="restart"),
     dict(goodput=0.5734293726704662, merges=5310, late=0.14854488414083766, decide_calls=4445,
          grace=0.11423483153625082)),
])
def test_one_shard_without_sync_failures_is_unchanged(cfg: SimConfig, expected: dict) -> None:
    assert cfg.shards == 1 and math.isinf(cfg.sync_mtbf_hours)
    r = simulate(cfg, ("decoupled",))[0]
    assert r.label == f"decoupled M={cfg.learners}"
    assert r.goodput == expected["goodput"]
    assert r.merges == expected["merges"]
    assert r.lost["late_merges"] == expected["late"]
    assert r.details["decide_calls"] == expected["decide_calls"]
    assert r.details["mean_grace_s"] == expected["grace"]
    assert r.details["sync_failures"] == 0 and r.details["stalled_fragment_share"] == 0.0
    assert r.details["merge_uptime"] == 1.0 and r.details["dropped_contributions"] == 0


def test_default_cli_output_shows_no_synchronizer(capsys) -> None:
    assert main(["--chips", "150k", "--learners", "2", "--hours", "1", "--merge-hours", "0.2", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "synchronizer" not in out and "sync fails" not in out and "S=" not in out


def _merges_in(ts: list[float], a: float, b: float) -> int:
    return sum(a <= t < b for t in ts)


@pytest.mark.parametrize("shards,down_shard", [(2, 1), (2, 0), (3, 2), (4, 1)])
def test_a_shard_down_stalls_only_its_own_fragments(shards: int, down_shard: int) -> None:
    cfg = SimConfig(shards=shards, **QUIET)
    a, b = 1200.0, 1800.0
    trace = sample_trace(cfg)
    outages = SyncOutages.of(shards, cfg.horizon_s, {down_shard: [(a, b)]})
    calm = simulate_decoupled(cfg, trace, SyncOutages.none(shards, cfg.horizon_s))
    hit = simulate_decoupled(cfg, trace, outages)
    # simulate_decoupled does not return per-fragment merge times: replay the merge level directly.
    jobs = [run_job(sub.times, sub.return_s, chips=c, horizon_s=cfg.horizon_s, mode="elastic",
                    pause_s=cfg.reconfig_s, step_s=cfg.step_s) for c, sub in trace.split(cfg.learners)]
    stats = simulate_merges(cfg, jobs, outages)
    period = cfg.sync_every * cfg.step_s  # each fragment falls due once per period
    mine = set(owned(cfg.fragments, down_shard, shards))
    assert mine == {p for p in range(cfg.fragments) if p % shards == down_shard}
    for p, ts in enumerate(stats.merge_times):
        if p in mine:
            assert _merges_in(ts, a, b) == 0, p
            # back within a period (plus an answer's step) of the restart, and merging before it
            assert _merges_in(ts, b, b + period + 2 * cfg.step_s) >= 1, p
            assert _merges_in(ts, a - period, a) >= 1, p
        else:
            assert _merges_in(ts, a, b) >= math.floor((b - a) / period) - 1, p
    # Fewer merges by the stalled fragments' rounds only; nobody's training stopped.
    missed = calm.merges - hit.merges
    expected = len(mine) * (b - a) / period
    assert expected - len(mine) <= missed <= expected + len(mine)
    assert hit.goodput == pytest.approx(calm.goodput, abs=1e-9)
    assert hit.uptime == calm.uptime == 1.0
    assert hit.details["sync_failures"] == 1
    assert hit.details["stalled_fragment_share"] == pytest.approx(len(mine) / cfg.fragments * (b - a) / cfg.horizon_s)
    assert hit.details["stalled_share_per_failure"] == pytest.approx(len(mine) / cfg.fragments)
    assert hit.details["merge_downtime_s"] == 0.0  # the other shards were up throughout
    assert hit.details["max_fragment_gap_s"] >= b - a
    assert calm.details["max_fragment_gap_s"] < period + 3 * cfg.step_s


def test_merges_outside_the_replayed_window_scale_by_up_fragment_time() -> None:
    """The merge level replays the last hour of two; an outage inside it must not be extrapolated
    to the hour before, where every shard was up."""
    cfg = SimConfig(shards=2, **(QUIET | dict(hours=2.0, merge_hours=1.0)))
    a, b = 5400.0, 6000.0
    trace = sample_trace(cfg)
    calm = simulate_decoupled(cfg, trace, SyncOutages.none(2, cfg.horizon_s))
    hit = simulate_decoupled(cfg, trace, SyncOutages.of(2, cfg.horizon_s, {1: [(a, b)]}))
    missed = 12 * (b - a) / (cfg.sync_every * cfg.step_s)  # 12 fragments, one round each per 48 s
    assert calm.merges - hit.merges == pytest.approx(missed, abs=12)
    # The shard's share of the stall is counted over the whole horizon, not the window's.
    assert hit.details["stalled_fragment_share"] == pytest.approx(0.5 * (b - a) / cfg.horizon_s)


def test_one_synchronizer_down_stalls_every_fragment() -> None:
    cfg = SimConfig(**QUIET)
    a, b = 1200.0, 1800.0
    r = simulate_decoupled(cfg, sample_trace(cfg), SyncOutages.of(1, cfg.horizon_s, {0: [(a, b)]}))
    assert r.details["stalled_share_per_failure"] == 1.0
    assert r.details["merge_downtime_s"] == b - a
    assert r.details["merge_uptime"] == pytest.approx(1 - (b - a) / cfg.horizon_s)
    assert r.details["max_merge_gap_s"] >= b - a
    assert r.uptime == 1.0  # the learners trained on


def test_more_shards_stall_a_smaller_share_per_failure() -> None:
    """Random failures, same per-process rate: the share of fragments one failure stalls, measured
    from which fragments merged while it lasted, is about 1/S; S shards fail about S times as often,
    and a time with every shard down at once gets rare."""
    base = SimConfig(chips=150_000, learners=4, hours=12.0, merge_hours=0.0, sync_mtbf_hours=2.0,
                     sync_restart_s=600.0, seed=1)
    out = {}
    for s in (1, 2, 4):
        r = simulate(base.with_(shards=s), ("decoupled",))[0]
        assert r.details["failures_measured_in_window"] >= 3 * s, (s, r.details["sync_failures"])
        out[s] = r
    share = {s: r.details["stalled_share_per_failure"] for s, r in out.items()}
    assert share[1] == 1.0
    assert share[1] > share[2] > share[4]
    for s in (2, 4):
        # concurrent outages of two shards make a failure stall a little more than 1/S
        assert 1 / s <= share[s] < 1 / s + 0.1, share
    assert out[4].details["sync_failures"] > out[1].details["sync_failures"]
    assert out[1].details["merge_downtime_s"] > 0
    assert out[4].details["merge_downtime_s"] < out[1].details["merge_downtime_s"]
    # Training never stops for the synchronizer: the learners' books are the same for every S.
    for s in (2, 4):
        assert out[s].uptime == out[1].uptime
        for k in ("paused", "rollback", "unavailable", "stragglers"):
            assert out[s].lost[k] == out[1].lost[k]


def test_shard_outages_are_the_same_process_whatever_s() -> None:
    cfg = SimConfig(hours=72.0, sync_mtbf_hours=6.0, sync_restart_s=300.0, seed=3)
    one, four = sample_outages(cfg), sample_outages(cfg.with_(shards=4))
    np.testing.assert_array_equal(one.down[0], four.down[0])  # shard 0 fails at the same times
    assert sample_outages(cfg.with_(seed=4)).down[0].tolist() != one.down[0].tolist()
    for iv in four.down:
        assert np.all(np.diff(iv[:, 0]) >= cfg.sync_restart_s)  # a shard that is down cannot fail again
        assert np.allclose(iv[:, 1] - iv[:, 0], np.minimum(cfg.sync_restart_s, cfg.horizon_s - iv[:, 0]))
    # Poisson at 1/MTBF while up: 4 shards x 72 h / (6 h + 300 s) ~ 47 failures; 5 sigma either side.
    n = four.failures
    lam = 4 * cfg.horizon_s / (6 * 3600 + 300)
    assert abs(n - lam) < 5 * math.sqrt(lam)
    assert sample_outages(cfg.with_(sync_mtbf_hours=math.inf)).failures == 0


def test_dropped_contributions_are_counted_and_cost_no_training() -> None:
    # Chip failures put learners out of phase, so answers wait in inboxes when a shard fails.
    cfg = SimConfig(chips=1_200_000, learners=8, quorum=0, hours=2.0, merge_hours=0.0, shards=2)
    trace = sample_trace(cfg)
    down = {0: [(float(t), float(t) + 300.0) for t in np.arange(600.0, 6600.0, 900.0)]}
    hit = simulate_decoupled(cfg, trace, SyncOutages.of(2, cfg.horizon_s, down))
    calm = simulate_decoupled(cfg, trace, SyncOutages.none(2, cfg.horizon_s))
    assert hit.details["dropped_contributions"] > 0
    assert hit.details["sync_failures"] == 7 and hit.merges < calm.merges
    for k in ("paused", "rollback", "unavailable", "stragglers"):
        assert hit.lost[k] == calm.lost[k]


@pytest.mark.parametrize("changes,message", [
    (dict(shards=0), "shards must be in 1..fragments"),
    (dict(shards=25), "shards must be in 1..fragments (P=24)"),
    (dict(fragments=4, sync_every=4, shards=5), "shards must be in 1..fragments (P=4)"),
    (dict(sync_mtbf_hours=0.0), "sync_mtbf_hours must be > 0"),
    (dict(sync_restart_s=-1.0), "sync_restart_s must be a finite number >= 0"),
])
def test_bad_shard_settings_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        SimConfig(**changes)
    assert SimConfig(shards=24).shards == 24


def test_bad_outages_are_refused() -> None:
    cfg = SimConfig(shards=2, **QUIET)
    with pytest.raises(ValueError, match="no shard"):
        SyncOutages.of(2, cfg.horizon_s, {2: [(0.0, 1.0)]})
    with pytest.raises(ValueError, match="disjoint"):
        SyncOutages.of(2, cfg.horizon_s, {0: [(0.0, 10.0), (5.0, 20.0)]})
    with pytest.raises(ValueError, match="outages are given for 3 shards"):
        simulate_decoupled(cfg, sample_trace(cfg), SyncOutages.none(3, cfg.horizon_s))


def test_cli_shards_flag(tmp_path, capsys) -> None:
    out = tmp_path / "shards.json"
    rc = main(["--chips", "150k", "--learners", "4", "--strategies", "decoupled", "--shards", "1,4",
               "--sync-mtbf-hours", "1", "--sync-restart-s", "300", "--hours", "3", "--merge-hours", "0", "--seed", "1",
               "--workers", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "synchronizer: S=1,4 shard(s), a failure every 1 h per shard, down 300 s each" in text
    assert "sync fails" in text and "per fail %" in text and "decoupled M=4 S=4" in text
    data = json.loads(out.read_text())
    assert data["config"]["shards"] == [1, 4]
    by = {r["label"]: r["details"] for r in data["results"]}
    assert by["decoupled M=4"]["shards"] == 1 and by["decoupled M=4 S=4"]["shards"] == 4
    assert by["decoupled M=4 S=4"]["sync_failures"] > by["decoupled M=4"]["sync_failures"] > 0

    assert main(["--shards", "25", "--workers", "1"]) == 2
    assert "shards must be in 1..fragments (P=24)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--shards", "0"])
    assert "not a positive whole count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--sync-mtbf-hours", "0"])
