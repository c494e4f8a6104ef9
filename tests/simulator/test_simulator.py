"""The fleet simulator against closed-form cases, and its use of the synchronizer's real policy.

References checked: no failures gives 100% for every strategy; one learner is data-parallel on
the same trace; failure counts are Poisson with rate chips/MTBI (mean and variance within bounds
taken from the Poisson law itself); the renewal-reward formula of a job with a fixed pause per
interruption; and the paper's table (arXiv 2604.21428) within 5 points where it reports a cell.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from ddiloco.algorithm import policies
from ddiloco.algorithm.round import RoundState
from ddiloco.simulator import (
    YEAR_S,
    SimConfig,
    sample_trace,
    simulate,
    simulate_decoupled,
    simulate_dp,
    simulate_elastic,
    slowest_chip_factor,
)
from ddiloco.simulator.cli import main
from ddiloco.simulator.report import PAPER_GOODPUT

FAST = dict(hours=2.0, merge_hours=0.0)


def test_no_failures_gives_full_goodput() -> None:
    cfg = SimConfig(chips=1_200_000, learners=8, mtbi_years=math.inf, **FAST)
    results = simulate(cfg, learners=(1, 8))
    assert [r.label for r in results] == ["dp", "elastic", "decoupled M=1", "decoupled M=8"]
    for r in results:
        assert r.failures == 0
        assert r.goodput == pytest.approx(1.0, abs=1e-12), r.label
        assert r.uptime == pytest.approx(1.0)
    # In phase and never interrupted, every round merges with everyone at once.
    assert results[-1].details["merge_reasons"] == {"all live learners contributed": results[-1].details[
        "merges_in_window"]}
    assert results[-1].details["mean_contributors_per_merge"] == pytest.approx(8.0)


@pytest.mark.parametrize("recovery,baseline", [("restart", "dp"), ("elastic", "elastic")])
def test_one_learner_behaves_like_data_parallel(recovery: str, baseline: str) -> None:
    cfg = SimConfig(chips=1_200_000, learners=1, learner_recovery=recovery, checkpoint_s=0.0, hours=6.0)
    trace = sample_trace(cfg)
    base = (simulate_dp if baseline == "dp" else simulate_elastic)(cfg, trace)
    one = simulate_decoupled(cfg, trace)
    assert base.failures == one.failures > 100
    assert one.goodput == pytest.approx(base.goodput, abs=1e-9)
    assert one.interruptions == base.interruptions
    assert one.lost["late_merges"] == 0.0


def test_failure_counts_are_poisson_with_rate_chips_over_mtbi() -> None:
    chips, learners, hours = 150_000, 8, 4000.0
    cfg = SimConfig(chips=chips, learners=learners, hours=hours, seed=7)
    trace = sample_trace(cfg)
    # Whole fleet: one Poisson draw with mean N*T/MTBI.
    lam_fleet = chips * cfg.horizon_s / YEAR_S
    assert abs(len(trace) - lam_fleet) < 5 * math.sqrt(lam_fleet)
    # Per learner and per hour: c/MTBI * 3600 each, independent windows.
    windows = np.arange(0.0, cfg.horizon_s + 1, 3600.0)
    counts, sizes = [], []
    for c, sub in trace.split(learners):
        counts.append(np.histogram(sub.times, bins=windows)[0])
        sizes.append(c)
    assert sum(sizes) == chips and sum(len(s.times) for _, s in trace.split(learners)) == len(trace)
    x = np.concatenate(counts).astype(float)
    lam = (chips / learners) * 3600.0 / YEAR_S
    n = x.size
    # Sampling sd of the mean is sqrt(lam/n); of the variance sqrt((lam + 2 lam^2)/n) (Poisson moments).
    assert abs(x.mean() - lam) < 5 * math.sqrt(lam / n)
    assert abs(x.var(ddof=1) - lam) < 5 * math.sqrt((lam + 2 * lam * lam) / n)
    # Inter-failure gaps of one learner are exponential with the same rate: mean 1/rate, cv 1.
    gaps = np.diff(trace.split(learners)[0][1].times)
    rate = (chips / learners) / YEAR_S
    assert abs(gaps.mean() * rate - 1) < 5 / math.sqrt(gaps.size)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1


@pytest.mark.parametrize("strategy", ["dp", "elastic"])
def test_renewal_reward_closed_form(strategy: str) -> None:
    """Fixed pause R per interruption, failures absorbed while paused, in-flight step lost:
    goodput = (1/lam - step/2) / (1/lam + R) for a fleet failing at rate lam."""
    cfg = SimConfig(chips=600_000, hours=500.0, seed=3)
    trace = sample_trace(cfg)
    r = (simulate_dp if strategy == "dp" else simulate_elastic)(cfg, trace)
    pause = cfg.restart_s if strategy == "dp" else cfg.reconfig_s
    mtbf = cfg.fleet_mtbi_s
    expected = (mtbf - cfg.step_s / 2) / (mtbf + pause)
    assert r.goodput == pytest.approx(expected, abs=0.01)


def test_dp_goodput_decreases_with_fleet_size() -> None:
    goodput = [simulate(SimConfig(chips=n, hours=24.0), ("dp",))[0].goodput
               for n in (150_000, 300_000, 600_000, 1_200_000, 2_400_000)]
    assert all(a > b for a, b in itertools.pairwise(goodput)), goodput


def test_decoupled_merges_are_decided_by_the_services_round_state_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SimConfig(chips=1_200_000, learners=4, hours=1.0, merge_hours=0.0)
    calls = []
    real = RoundState.decide

    def spy(self, now, waiting, version, live, timings, rules, rejoin=None):
        calls.append(rules)
        return real(self, now, waiting, version, live, timings, rules, rejoin)

    monkeypatch.setattr(RoundState, "decide", spy)
    r = simulate(cfg, ("decoupled",))[0]
    assert len(calls) == r.details["decide_calls"] > r.details["merges_in_window"] > 0
    assert all(rules.policy == cfg.policy() and rules.overlap == cfg.overlap for rules in calls[:10])

    monkeypatch.setattr(RoundState, "decide", lambda *a, **k: policies.Decision(False, "test: never merge"))
    never = simulate(cfg, ("decoupled",))[0]
    assert never.merges == 0


def test_quorum_of_all_learners_loses_more_than_quorum_one() -> None:
    cfg = SimConfig(chips=1_200_000, learners=8, hours=3.0, merge_hours=0.0)
    k1 = simulate(cfg.with_(quorum=1), ("decoupled",))[0]
    k8 = simulate(cfg.with_(quorum=8), ("decoupled",))[0]
    # Under K=1 almost nothing comes back late; K=8 waits for every live learner's answer to the
    # round, so a learner that comes back up holds its rounds until it answers. (Before the quorum
    # counted answers to the open round only, a leftover from an earlier round merged in every
    # round it waited in, late: K=8 lost 5.1% to late merges, K=1 0.3%.)
    assert k1.lost["late_merges"] < 0.001
    assert k8.lost["late_merges"] > 10 * k1.lost["late_merges"]
    assert k8.goodput < k1.goodput - 0.003
    # Every learner is asked at once and answers within one step, so K=1 with the grace window
    # gathers nearly the whole fleet (all but the paused) without waiting for anyone.
    assert k1.details["mean_contributors_per_merge"] > 0.85 * cfg.learners
    assert k1.details["mean_contributors_per_merge"] <= k8.details["mean_contributors_per_merge"]


def test_failures_only_pause_one_learner() -> None:
    cfg = SimConfig(chips=2_400_000, learners=16, hours=6.0, merge_hours=1.0)
    r = simulate(cfg, ("dp", "decoupled"))
    dp, dec = r
    assert dec.uptime == 1.0 and dec.details["global_downtime_s"] == 0.0
    assert dp.uptime < 0.3
    assert dec.goodput > 0.85 > 0.2 > dp.goodput


def test_stragglers_and_checkpoints() -> None:
    assert slowest_chip_factor(1, 0.05, np.random.default_rng(0)) == 1.0
    big = slowest_chip_factor(1_000_000, 0.02, np.random.default_rng(0))
    assert 1.07 < big < 1.12  # about 1 + cv * sqrt(2 ln n)
    cfg = SimConfig(chips=150_000, learners=8, hours=6.0, merge_hours=0.5)
    base = {r.label: r for r in simulate(cfg)}
    slow = {r.label: r for r in simulate(cfg.with_(speed_cv=0.02))}
    for label, r in slow.items():
        assert r.goodput < base[label].goodput and r.lost["stragglers"] > 0
    # A classic checkpoint every 10 minutes with a failure every ~26 s never completes one.
    ckpt = simulate(SimConfig(chips=1_200_000, hours=6.0, checkpoint_s=600.0), ("dp",))[0]
    assert ckpt.goodput < 0.01


def test_reproduces_the_papers_reported_cells() -> None:
    """Every cell the paper reports, within 5 points (decoupled merge level on a short window)."""
    for chips, cells in PAPER_GOODPUT.items():
        cfg = SimConfig(chips=chips, hours=72.0, merge_hours=0.25)
        got = {r.label: 100 * r.goodput for r in simulate(cfg, learners=(8, 16))}
        for label, paper in cells.items():
            assert abs(got[label] - paper) <= 5.0, (chips, label, got[label], paper)


def test_cli_json_plot_and_errors(tmp_path, capsys) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(["--chips", "150k,300000", "--learners", "2,4", "--hours", "2", "--merge-hours", "0.5",
               "--workers", "1", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    labels = [(r["chips"], r["label"]) for r in data["results"]]
    assert labels == [(n, s) for n in (150_000, 300_000)
                      for s in ("dp", "elastic", "decoupled M=2", "decoupled M=4")]
    assert {c["strategy"] for c in data["comparison"] if c["paper"] is not None} == {"dp", "elastic"}
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "paper" in text and "150k" in text

    assert main(["--chips", "1000", "--learners", "8", "--quorum", "9", "--workers", "1"]) == 2
    assert "cannot exceed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--chips", "lots"])


def test_table_mode_runs_every_size(tmp_path) -> None:
    out = tmp_path / "table.json"
    assert main(["--table", "--hours", "1", "--merge-hours", "0.1", "--workers", "2", "--json", str(out)]) == 0
    cells = json.loads(out.read_text())["comparison"]
    assert len(cells) == 5 * 4
    assert sum(c["paper"] is not None for c in cells) == 8
