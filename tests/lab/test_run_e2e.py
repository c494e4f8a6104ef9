"""End to end: real ``ddiloco`` processes (synchronizer + learners) on loopback, a tiny GPT, real data.

Each test runs the CLI exactly as a user would and checks the run folder: merges happened, every
fragment advanced, loss fell far below its start, and the summary's numbers agree with the logs.
The final evaluation, of every mode, reads the whole held-out split (the default).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import yaml

from ddiloco.lab.cluster import wait_ready
from ddiloco.lab.event_logs import load_jsonl
from tests.procs import children_of, gone, run_tree

TINY = """
protocol: {num_fragments: 4, sync_every: 8, overlap: 2}
model: {d_model: 32, n_layer: 2, n_head: 2, context: 32}
data: {batch_size: 8, context: 32, max_bytes: 1000000}
train: {eval_every: 20, eval_batches: 2, lr: 0.003, warmup_steps: 5}
run: {global_eval_every_s: 1.0}
synchronizer: {policy: {quorum: 1, grace_gamma: 0.5, max_grace_s: 1.0}, heartbeat_interval_s: 0.5}
# a known pace (steps of at least 30 ms), so merges per step are the same on a machine of any speed
learner: {min_step_s: 0.03}
"""


def _run(tmp_path: pathlib.Path, *args: str, extra: str = "", name: str = "run", base: str = TINY) -> dict:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(base + extra)
    out = tmp_path / name
    proc = run_tree([sys.executable, "-m", "ddiloco.core.cli", "run", "--config", str(cfg), "--out", str(out),
                     "--no-progress", *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    summary["_out"] = out
    summary["_printed"] = json.loads(proc.stdout[:proc.stdout.rindex("run folder:")])
    summary["_stderr"] = proc.stderr
    return summary


def _whole_split() -> dict:
    """The final evaluation's set of TINY's data, counted from the corpus: every window of 32
    tokens of the held-out split once, in batches of 8."""
    from ddiloco.training.data import DataConfig, load_corpus

    tokens = len(load_corpus(DataConfig(batch_size=8, context=32, max_bytes=1000000)).eval)
    windows = (tokens - 1) // 32
    return {"split": "all", "batches": -(-windows // 8), "batch_size": 8, "windows": windows, "tokens": windows * 32,
            "split_tokens": tokens}


def _first_loss(out: pathlib.Path) -> float:
    """Training loss at the first step of the learner that uploaded the genesis model (~ln 256)."""
    for p in sorted((out / "learners").glob("*.jsonl")):
        events = load_jsonl(p)
        start = next((e for e in events if e["event"] == "start"), None)
        if start is not None and start.get("genesis", True):
            return next(e["loss"] for e in events if e["event"] == "step")
    raise AssertionError("no genesis learner log")


def test_decoupled_run_with_two_learners(tmp_path):
    s = _run(tmp_path, "--learners", "2", "--steps", "60")
    out = s["_out"]
    for key in ("mode", "learners", "steps", "tokens", "merges", "final_eval_loss", "learner_goodput",
                "global_downtime_s", "max_merge_gap_s", "rejected_contributions", "faults_injected", "wall_s"):
        assert key in s, key
    assert (s["mode"], s["learners"], s["steps"]) == ("decoupled", 2, 120)
    assert s["tokens"] == 120 * 8 * 32
    merges = [e for e in load_jsonl(out / "synchronizer.jsonl") if e["event"] == "merge"]
    assert s["merges"] == len(merges) > 0
    assert {e["fragment"] for e in merges} == {0, 1, 2, 3}, "every fragment's version must advance"
    assert s["final_eval_loss"] < _first_loss(out) - 1.0 and math.isfinite(s["final_eval_loss"])
    assert 0 < s["learner_goodput"] <= 1 and s["rejected_contributions"] == 0
    assert s["contributions"]["totals"]["unaccounted"] == 0
    printed = s["_printed"]  # the head of the summary, and how the rounds went
    assert printed["final_eval_loss"] == s["final_eval_loss"] and printed["merges"] == s["merges"]
    assert printed["rounds"] == {k: s["rounds"][k] for k in ("participation_mean", "stale_share", "max_merge_wait_s")}
    for name in ("loss_vs_tokens.png", "merges_over_time.png", "goodput.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the global model, evaluated outside the learners: the genesis model at 0 tokens, points while
    # they trained, and the final evaluation at every token of the run
    curve = [json.loads(line) for line in (out / "global_eval.jsonl").read_text().splitlines()]
    assert s["global_eval"] == [[e["tokens"], e["loss"]] for e in curve]
    first, last = curve[0], curve[-1]
    assert (first["tokens"], first["min_version"]) == (0, 0) and not first.get("final")
    assert first["loss"] == pytest.approx(math.log(256), abs=0.1), "the untrained model is near uniform"
    assert last["final"] is True and last["tokens"] == s["tokens"] and last["loss"] == s["final_eval_loss"]
    assert last["min_version"] > 0 and all("final" not in e for e in curve[:-1])
    assert s["final_eval"] == _whole_split() and printed["final_eval"]["split"] == "all"
    assert s["train"] == {"lr": 0.003, "lr_from": "config", "warmup_steps": 5, "warmup_steps_from": "config"}
    tokens = [e["tokens"] for e in curve]
    assert tokens == sorted(tokens)
    assert all(math.isfinite(e["loss"]) for e in curve)


def test_a_slow_learner_is_slower_and_still_contributes_with_its_own_step_counts(tmp_path):
    # learner-1 at half speed: its steps take twice as long, and while the others train (6 s at
    # the 30 ms floor) the rounds are asked for at their pace, so it answers more requests per
    # step of its own (each answer carries the steps it made). Its steps per answer are not
    # compared with the fast learners': under the replay policy they count from its last send
    # until a merge including it is applied, so they grow whenever its answers go stale.
    s = _run(tmp_path, "--learners", "3", "--steps", "200", "--learner-speed", "learner-1=0.5")
    out = s["_out"]
    per = s["per_learner"]
    step_s = {lid: per[lid]["compute_s"] / per[lid]["steps"] for lid in per}
    fast = max(step_s["learner-0"], step_s["learner-2"])
    assert step_s["learner-1"] > 1.6 * fast, step_s
    sends: dict[str, list[dict]] = {}
    for lid in per:
        sends[lid] = [e for e in load_jsonl(out / "learners" / f"{lid}.jsonl") if e["event"] == "send"]
    assert all(e["tokens"] == e["steps"] * 8 * 32 for e in sends["learner-1"])  # its own steps, batch 8 x 32
    # The pace setter (the faster of the two others) answers about one request per fragment per H
    # of its steps; the slow learner is asked as often in wall time, so more often per step.
    pacer = min(("learner-0", "learner-2"), key=step_s.__getitem__)
    per_step = {lid: len(sends[lid]) / per[lid]["steps"] for lid in per}
    assert per_step["learner-1"] > 1.2 * per_step[pacer], per_step
    assert s["contributions"]["per_learner"]["learner-1"]["merged"] > 0
    assert s["contributions"]["totals"]["unaccounted"] == 0
    rounds = s["rounds"]
    assert rounds["merges"] == s["merges"] and rounds["participation_mean"] >= 1.0
    assert set(rounds["per_fragment"]) == {"0", "1", "2", "3"}


def test_baseline_run_dir_is_reported_beside_the_run_and_mismatches_are_refused(tmp_path):
    base = _run(tmp_path, "--learners", "2", "--steps", "40", name="base")
    s = _run(tmp_path, "--learners", "2", "--steps", "40", "--baseline", str(base["_out"]), name="again")
    assert s["baseline"]["final_eval_loss"] == base["final_eval_loss"]
    assert s["eval_loss_vs_baseline"] == pytest.approx(s["final_eval_loss"] / base["final_eval_loss"] - 1)
    cfg = tmp_path / "base.yaml"
    for args, message in ((["--steps", "41"], "steps_per_learner 40 (this run: 41)"),
                          (["--steps", "40", "--seed", "3"], "seed 0 (this run: 3)"),
                          (["--steps", "40", "--mode", "diloco"], "mode 'decoupled'")):
        out = tmp_path / "refused"
        proc = run_tree([sys.executable, "-m", "ddiloco.core.cli", "run", "--config", str(cfg), "--out", str(out),
                         "--no-progress", "--learners", "2", *args, "--baseline", str(base["_out"])],
                        capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not out.exists(), "a refused run must not start"
    # a run from before the final evaluation's set was recorded measured another one: no baseline
    older = tmp_path / "older"
    older.mkdir()
    summary = json.loads((base["_out"] / "summary.json").read_text())
    del summary["final_eval"]
    (older / "summary.json").write_text(json.dumps(summary))
    proc = run_tree([sys.executable, "-m", "ddiloco.core.cli", "run", "--config", str(cfg), "--out",
                     str(tmp_path / "refused"), "--no-progress", "--learners", "2", "--steps", "40",
                     "--baseline", str(older)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not comparable" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "run", "--baseline", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot read" in proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {global_eval_every_s: -1}\n")
    proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "run", "--config", str(bad), "--out",
                           str(tmp_path / "bad")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "global_eval_every_s" in proc.stderr and not (tmp_path / "bad").exists()


def test_dp_reference_sees_the_same_tokens(tmp_path):
    """With ``train.lr`` and ``train.warmup_steps`` in its config file (TINY's), dp trains at them."""
    s = _run(tmp_path, "--learners", "2", "--steps", "60", "--mode", "dp")
    assert s["train"] == {"lr": 0.003, "lr_from": "config", "warmup_steps": 5, "warmup_steps_from": "config"}
    assert s["final_eval"] == _whole_split()
    assert s["mode"] == "dp" and s["tokens"] == 120 * 8 * 32 and s["steps"] == 60
    assert s["final_eval_loss"] < _first_loss(s["_out"]) - 1.0
    assert [t for t, _ in s["global_eval"]] == [0, s["tokens"]] and s["global_eval"][-1][1] == s["final_eval_loss"]
    assert 0 < s["learner_goodput"] <= 1 and s["global_downtime_s"] == 0.0
    events = {e["event"] for e in load_jsonl(s["_out"] / "learners" / "dp.jsonl")}
    assert not events & {"send", "result"}, "the reference sends nothing and pretends nothing"


def test_dp_as_shipped_trains_at_its_own_tuned_lr_and_says_so(tmp_path):
    """No ``train.lr`` / ``train.warmup_steps`` in the file: dp trains at its tuned 6e-3 and 60 steps
    (``run_config.DP_TUNED``), not the learners' lr, and says which it used and why."""
    from ddiloco.lab.run_config import DP_TUNED

    shipped = TINY.replace(", lr: 0.003, warmup_steps: 5}", "}")
    assert "lr:" not in shipped
    s = _run(tmp_path, "--learners", "2", "--steps", "60", "--mode", "dp", base=shipped)
    assert s["train"] == {"lr": DP_TUNED.lr, "lr_from": "dp tuned default", "warmup_steps": DP_TUNED.warmup_steps,
                          "warmup_steps_from": "dp tuned default"}
    start = next(e for e in load_jsonl(s["_out"] / "learners" / "dp.jsonl") if e["event"] == "start")
    assert (start["config"]["train"]["lr"], start["config"]["train"]["warmup_steps"]) == (0.006, 60)
    assert "dp trains at lr 0.006 (dp's tuned default" in s["_stderr"] and s["_printed"]["lr"] == 0.006
    assert s["final_eval"] == _whole_split() and s["final_eval_loss"] < _first_loss(s["_out"]) - 0.5


@pytest.mark.parametrize("mode", ["diloco", "streaming"])
def test_blocking_modes_run_and_wait_by_design(tmp_path, mode):
    s = _run(tmp_path, "--learners", "2", "--steps", "40", "--mode", mode)
    assert s["mode"] == mode and s["merges"] > 0
    logs = [load_jsonl(p) for p in (s["_out"] / "learners").glob("*.jsonl")]
    applies = [e for log in logs for e in log if e["event"] == "apply"]
    assert applies, "merged fragments were applied"
    if mode == "diloco":
        assert {e["fragment"] for e in applies} == {0}  # one fragment: the whole model
        assert sum(e["blocked_s"] for log in logs for e in log if e["event"] == "step") > 0
    # the run's learners start their rounds together: one that started first and merged alone
    # ran ahead, and both then waited on rounds the other could not reach until the round timeout
    assert yaml.safe_load((s["_out"] / "config.yaml").read_text())["synchronizer"]["start_learners"] == 2
    for log in logs:
        steps = [e for e in log if e["event"] == "step"]
        assert max(e["blocked_s"] for e in steps) < 60, "a wait as long as the round timeout: out of phase"
        # nothing is waited for after the last step: the other learners may be waiting for the
        # contributions that ending hands over (waiting there deadlocked until wait_timeout_s)
        last = steps[-1]
        assert last["step"] == 40 and last["blocked_s"] == 0.0, last


@pytest.mark.parametrize("policy", ["mix", "replay"])
def test_apply_policies_train(tmp_path, policy):
    s = _run(tmp_path, "--learners", "2", "--steps", "40", extra=f"learner: {{apply_policy: {policy}}}\n")
    logs = [load_jsonl(p) for p in (s["_out"] / "learners").glob("*.jsonl")]
    policies = {e["policy"] for log in logs for e in log if e["event"] == "apply" and not e["resync"]}
    assert policies == {policy}
    assert s["final_eval_loss"] < _first_loss(s["_out"]) - 0.5


def test_late_learner_fetches_state_and_contributes(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(TINY)
    ready = tmp_path / "ready.json"
    env = dict(os.environ, DDILOCO_LOG_JSON="1")
    cli = [sys.executable, "-m", "ddiloco.core.cli"]
    procs = []
    try:
        sync = subprocess.Popen([*cli, "synchronizer", "--listen", "127.0.0.1:0", "--state-dir",
                                 str(tmp_path / "state"), "--config", str(cfg), "--ready-file", str(ready),
                                 "--event-log", str(tmp_path / "synchronizer.jsonl")],
                                stderr=open(tmp_path / "sync.log", "wb"), env=env)  # noqa: SIM115
        procs.append(sync)
        deadline = time.monotonic() + 60
        target = f"127.0.0.1:{wait_ready(sync, ready, timeout_s=60)}"

        def learner(i: int, steps: int) -> subprocess.Popen:
            return subprocess.Popen([*cli, "learner", "--synchronizer", target, "--learner-id", f"learner-{i}",
                                     "--config", str(cfg), "--steps", str(steps), "--threads", "1",
                                     "--event-log", str(tmp_path / f"learner-{i}.jsonl")],
                                    stderr=open(tmp_path / f"learner-{i}.log", "wb"), env=env)

        first = learner(0, 100_000)  # runs until drained below
        procs.append(first)
        while len([e for e in load_jsonl(tmp_path / "synchronizer.jsonl") if e.get("event") == "merge"]) < 12:
            assert first.poll() is None, "first learner ended before the late one joined"
            assert time.monotonic() < deadline + 60
            time.sleep(0.1)
        late = learner(1, 100_000)  # the same run's length: it goes on from the fleet's step
        procs.append(late)

        def late_log() -> list[dict]:
            path = tmp_path / "learner-1.jsonl"
            return load_jsonl(path) if path.exists() else []

        late_deadline = time.monotonic() + 120
        while not any(e["event"] == "result" and e["outcome"] == "merged" for e in late_log()):
            assert late.poll() is None, "late learner ended before a merged contribution"
            assert time.monotonic() < late_deadline, "late learner never contributed"
            time.sleep(0.2)
        late.send_signal(signal.SIGTERM)
        assert late.wait(timeout=60) == 0
        log = late_log()
        start = next(e for e in log if e["event"] == "start")
        assert start["genesis"] is False and max(start["versions"].values()) > 0, "joined from fetched state"
        first_step = next(e["step"] for e in log if e["event"] == "step")
        assert start["start_step"] >= 8 and first_step == start["start_step"] + 1, "starts at the fleet's step"
        first.send_signal(signal.SIGTERM)  # drains: stops after the current step
        assert first.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_sigterm_stops_the_run_and_every_process_it_started(tmp_path):
    cfg, out = tmp_path / "cfg.yaml", tmp_path / "run"
    cfg.write_text(TINY)
    err = tmp_path / "run.err"
    with open(err, "wb") as err_file:  # a file, not a pipe nobody reads while the run goes on
        run = subprocess.Popen([sys.executable, "-m", "ddiloco.core.cli", "run", "--config", str(cfg), "--out",
                                str(out), "--no-progress", "--learners", "2", "--steps", "100000"],
                               stdout=subprocess.DEVNULL, stderr=err_file)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120

        def training() -> bool:
            logs = [out / "learners" / f"learner-{i}.jsonl" for i in range(2)]
            return all(p.exists() and any(e["event"] == "step" for e in load_jsonl(p)) for p in logs)

        while not training():
            assert run.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "the learners never trained"
            time.sleep(0.2)
        children = children_of(run.pid)
        assert len(children) >= 3  # the synchronizer and two learners
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 128 + signal.SIGTERM
        left = [pid for pid in children if not gone(pid, within_s=5)]
        assert not left, f"processes left running after SIGTERM: {left}"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for pid in children:
            if not gone(pid, within_s=0):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
