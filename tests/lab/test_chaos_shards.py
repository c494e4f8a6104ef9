"""A run with two synchronizer shards (``ddiloco run --shards 2``), no fault and with one shard
killed: the shards merge their own fragments, and while one is down the other goes on merging at
its usual pace, training never stops, and the killed shard merges again after its restart.

The pace is fixed as in tests/lab/test_chaos.py: every inner step lasts at least ``STEP_S``, so
the kill falls at the same second on a machine of any speed and the steps after it give at least
the same seconds of training to recover in."""

from __future__ import annotations

import json
import sys

from ddiloco.lab.chaos import FaultPlan
from ddiloco.lab.event_logs import load_jsonl
from tests.lab.test_chaos import STEP_S, TINY, _chaos_run
from tests.procs import run_tree

DOWN_S = 8.0
"""How long shard 1 stays down: far longer than a healthy shard's gaps between merges."""


def test_a_sharded_run_merges_each_fragment_on_its_own_shard(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "run"
    proc = run_tree([sys.executable, "-m", "ddiloco.core.cli", "run", "--config", str(cfg), "--out", str(out),
                     "--no-progress", "--learners", "2", "--steps", "150", "--shards", "2"],
                    capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    for shard, owned in ((0, {0, 2}), (1, {1, 3})):
        merges = [e for e in load_jsonl(out / f"synchronizer-{shard}.jsonl") if e["event"] == "merge"]
        assert {e["fragment"] for e in merges} == owned
        assert s["shards"][shard]["merges"] == len(merges)
    assert s["merges"] == sum(sh["merges"] for sh in s["shards"])
    assert s["contributions"]["totals"]["unaccounted"] == 0 and s["rejected_contributions"] == 0
    assert (out / "state-0" / "meta.json").exists() and (out / "state-1" / "meta.json").exists()
    assert s["final_eval_loss"] < 4.0


def test_one_shard_killed_stalls_only_its_fragments(tmp_path):
    # the kill at step 100 (2 s at the floor), DOWN_S down, a process start and the rejoin hold,
    # then at least 15 s of training for the restarted shard to merge again
    steps = 100 + int((DOWN_S + 15.0) / STEP_S)
    plan = FaultPlan().kill_synchronizer(at_step=100, restart_after_s=DOWN_S, shard=1)
    s = _chaos_run(tmp_path, plan, steps=steps, learners=2, extra=("--shards", "2"))
    healthy, killed = s["shards"]
    # shard 1's fragments waited at least its downtime; shard 0 merged on through it
    assert killed["max_merge_gap_s"] >= DOWN_S
    assert healthy["max_merge_gap_s"] < DOWN_S / 2, s["shards"]
    assert healthy["restart_to_first_merge_s"] == []
    (again,) = killed["restart_to_first_merge_s"]
    assert again is not None and again < 60
    assert s["invariants"]["all_hold"], s["invariants"]
