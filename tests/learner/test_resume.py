"""A learner that joins a fleet already training starts at the fleet's progress: its learning-rate
schedule and fragment schedule go on from there (a pod restarted by Kubernetes does not warm up
from step 1 on a trained model), and a learner joining a fleet that has trained all its steps
leaves at once. Pure schedule checks, then real synchronizer and learner processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddiloco.algorithm.fleet_clock import fleet_progress
from ddiloco.training.config import TrainConfig
from ddiloco.training.inner_loop import lr_at
from tests.procs import synchronizer


def test_fleet_progress_takes_the_further_of_the_clock_and_the_durable_versions():
    assert fleet_progress(0, {}, 8, 600) == 0  # nothing merged yet
    assert fleet_progress(0, {0: 5, 1: 4}, 8, 600) == 32  # a restarted synchronizer: versions count
    assert fleet_progress(100, {0: 5, 1: 4}, 8, 600) == 100  # the clock is further
    assert fleet_progress(10_000, {0: 900}, 8, 600) == 600  # never past the run's steps


def test_a_resumed_schedule_goes_on_from_the_fleet_and_ramps_its_fresh_optimizer_in():
    cfg = TrainConfig(steps=600, lr=1e-3, warmup_steps=30)
    assert lr_at(1, cfg) == pytest.approx(1e-3 / 30)
    at = 300
    ramp_end = lr_at(at + 30, cfg, resumed_at=at)
    assert ramp_end == pytest.approx(lr_at(at + 30, cfg))  # after the ramp: the fleet's schedule
    assert lr_at(at + 1, cfg, resumed_at=at) == pytest.approx(lr_at(at + 1, cfg) / 30)
    assert lr_at(at + 1, cfg, resumed_at=at) < lr_at(1 + 30, cfg) / 10  # not the peak rate at once
    with pytest.raises(ValueError):
        TrainConfig(resume="sometimes")


CONFIG = """
protocol: {num_fragments: 2, sync_every: 4, mode: diloco}
model: {d_model: 32, n_layer: 1, n_head: 2, context: 32}
data: {batch_size: 4, context: 32, max_bytes: 200000}
train: {steps: 40, eval_every: 0, warmup_steps: 4}
"""


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddiloco.core.cli", *args]


def _events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_late_learner_starts_at_the_fleet_step_and_one_after_the_end_leaves(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG)
    with synchronizer(tmp_path, "--config", str(cfg), "--quorum", "1") as target:

        def learner(lid: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(_cli("learner", "--synchronizer", target, "--learner-id", lid, "--config", str(cfg),
                                       "--threads", "1", "--event-log", str(tmp_path / f"{lid}.jsonl"),
                                       "--summary-file", str(tmp_path / f"{lid}.summary.json")),
                                  capture_output=True, text=True, timeout=240)

        first = learner("learner-0")  # uploads the genesis model and trains the whole run alone
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        start0 = next(e for e in _events(tmp_path / "learner-0.jsonl") if e["event"] == "start")
        assert start0["genesis"] and start0["start_step"] == 0

        # the same run's steps, asked of a learner that joins after them: nothing is left
        late = learner("learner-1")
        assert late.returncode == 0, late.stdout[-2000:] + late.stderr[-2000:]
        start1 = next(e for e in _events(tmp_path / "learner-1.jsonl") if e["event"] == "start")
        versions = start1["versions"]
        assert min(versions.values()) >= 8  # 40 steps / sync_every 4, less the last rounds in flight
        assert start1["start_step"] == 40
        assert "nothing left to do" in late.stdout + late.stderr
        assert not [e for e in _events(tmp_path / "learner-1.jsonl") if e["event"] == "step"]

        # a longer run: a learner joining now goes on from the fleet's step
        cfg.write_text(CONFIG.replace("steps: 40", "steps: 60"))
        more = learner("learner-2")
        assert more.returncode == 0, more.stdout[-2000:] + more.stderr[-2000:]
        events = _events(tmp_path / "learner-2.jsonl")
        start2 = next(e for e in events if e["event"] == "start")
        steps = [e["step"] for e in events if e["event"] == "step"]
        assert start2["start_step"] >= 32 and steps[0] == start2["start_step"] + 1 and steps[-1] == 60
        summary = json.loads((tmp_path / "learner-2.summary.json").read_text())
        assert summary["steps"] == 60 - start2["start_step"]
