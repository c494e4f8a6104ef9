"""``ddiloco bench learner`` runs end to end (a real synchronizer process on loopback, a tiny
built-in GPT trained with DecoupledSync off and on), reports its overhead against the 2% goal
and where the time per fragment goes; bad options are refused before anything starts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from ddiloco.core.resources import available_cpus, with_huge_pages
from ddiloco.lab.bench import learner as learner_bench
from ddiloco.lab.bench.boundary import LocalBoundary
from ddiloco.training.model import ModelConfig, build_model
from tests.procs import children_of, cmdline, run_tree


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_tree([sys.executable, "-m", "ddiloco.core.cli", "bench", "learner", *args],
                    capture_output=True, text=True, timeout=timeout)


def test_tiny_run_reports_overhead_and_phases(tmp_path):
    out, work = tmp_path / "learner.json", tmp_path / "work"
    # A floor of 25 ms a step: the timed phase lasts 0.4 s however fast this machine's tiny steps are
    # (about 3 ms here; 16 of them once left a loaded synchronizer's requests no time to arrive).
    proc = _bench("--json", "--out", str(out), "--workdir", str(work), "--d-model", "32", "--n-layer", "2",
                  "--context", "32", "--batch-size", "4", "--steps", "16", "--warmup", "4", "--repeats", "1",
                  "--fragments", "4", "--sync-every", "4", "--overlap", "1", "--threads", "1", "--min-step-ms", "25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    assert printed["steps_per_s_off"] > 0 and printed["steps_per_s_on"] > 0
    assert printed["step_ms"] > 0 and math.isfinite(printed["overhead"])
    assert printed["overhead"] == 1 - printed["steps_per_s_on"] / printed["steps_per_s_off"]
    assert printed["goal"] == 0.02 and printed["meets_goal"] == (printed["overhead"] < 0.02)
    assert printed["protocol"] == {"num_fragments": 4, "sync_every": 4, "overlap": 1}
    assert printed["model"]["d_model"] == 32 and printed["steps"] == 16 and printed["threads"] == 1
    assert printed["min_step_ms"] == 25 and printed["step_ms"] >= 25 and printed["step_ms_on"] >= 25
    phases = printed["per_fragment_ms"]
    assert set(phases) == {"gather", "outer_gradient", "handoff", "apply", "encode", "decode"}
    assert all(ms >= 0 for ms in phases.values())
    counts = printed["counts"]
    assert counts["sends"] > 0 and counts["timed_sends"] > 0 and counts["encodes"] > 0
    assert counts["arrivals_in_slots"] == counts["arrivals_on_channel"] == 0, "thread mode has no slots"
    assert phases["gather"] > 0 and phases["encode"] > 0
    assert [(r["sync"], r["steps"]) for r in printed["results"]] == [("off", 16), ("on", 16)]
    assert (work / "logs" / "synchronizer.log").exists()  # the synchronizer ran, and was stopped
    policy = printed["synchronizer_policy"]  # its threads as the kernel reports them: the normal policy
    assert policy["asked"] == "normal" and policy["threads"] > 0 and policy["batch_threads"] == 0
    # measured as the services run: with huge pages (re-run in a child where this environment lacks them)
    assert printed["huge_pages"] == "on"
    assert printed["glibc_tunables"] == with_huge_pages(os.environ)["GLIBC_TUNABLES"]
    assert printed["huge_pages_in_effect"] == (printed["transparent_hugepage"] in {"always", "madvise"})


def test_floor_phase_runs_between_off_and_on(tmp_path):
    """--floor: every repeat runs off, local (the boundary's own arithmetic alone), on; the floor's
    overhead and its time per step are reported against the same run's off phases."""
    out = tmp_path / "learner.json"
    proc = _bench("--json", "--out", str(out), "--floor", "--d-model", "32", "--n-layer", "2", "--context", "32",
                  "--batch-size", "4", "--steps", "12", "--warmup", "2", "--repeats", "2", "--fragments", "4",
                  "--sync-every", "4", "--overlap", "1", "--threads", "1", "--min-step-ms", "25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    rows = printed["results"]
    assert [(r["sync"], r["repeat"]) for r in rows] == [("off", 0), ("local", 0), ("on", 0),
                                                         ("off", 1), ("local", 1), ("on", 1)]
    floor = printed["floor"]
    local = sorted(r["steps_per_s"] for r in rows if r["sync"] == "local")
    assert floor["steps_per_s"] == pytest.approx(sum(local) / 2)  # the median of two
    assert floor["overhead"] == pytest.approx(1 - floor["steps_per_s"] / printed["steps_per_s_off"])
    assert floor["pair_overheads"] == pytest.approx([1 - rows[i + 1]["steps_per_s"] / rows[i]["steps_per_s"]
                                                     for i in (0, 3)])
    assert printed["pair_overheads"] == pytest.approx([1 - rows[i + 2]["steps_per_s"] / rows[i]["steps_per_s"]
                                                       for i in (0, 3)])  # on against off, as without --floor
    assert floor["boundary_ms"] > 0 and all(r["boundary_ms_per_step"] > 0 for r in rows if r["sync"] == "local")
    assert "boundary_ms_per_step" not in rows[0] and "boundary_ms_per_step" not in rows[2]
    assert floor["boundary_fraction"] == pytest.approx(floor["boundary_ms"] * printed["steps_per_s_off"] / 1e3)
    assert printed["step_ms"] >= 25 and floor["step_ms"] >= 25


def test_local_boundary_computes_a_boundary_and_leaves_training_as_it_was():
    """The floor's boundary: one outer gradient per due fragment, one apply per merge due (the
    next boundary, where merges apply on arrival), and the parameters where training put them."""
    model = build_model(ModelConfig(d_model=32, n_layer=2, n_head=4, context=32), seed=0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    boundary = LocalBoundary(model, {"num_fragments": 4, "sync_every": 4, "overlap": 1})
    for _ in range(12):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)  # an inner step's update
        boundary.step(100)
    timings = boundary.local.timings
    assert timings["outer_gradient"][0] == 12  # fragment step % 4 at every step
    assert timings["apply"][0] == 11  # each send's merge at the next boundary; the last one's is not due yet
    assert boundary.seconds > 0
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), start[name] + 0.12, rtol=0, atol=1e-5)
    versions = boundary.local.versions
    assert sum(versions.values()) == 11 and set(versions) == {0, 1, 2, 3}


def test_bad_options_are_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)  # refused here, before any re-run child
    work, out = tmp_path / "work", tmp_path / "learner.json"
    for args in (["--steps", "0"], ["--repeats", "0"], ["--warmup", "-1"], ["--d-model", "30", "--n-head", "4"],
                 ["--overlap", "30", "--sync-every", "4"], ["--fragments", "500"], ["--comm", "socket"],
                 ["--min-step-ms", "-1"], ["--min-step-ms", "nan"]):
        with pytest.raises(SystemExit) as exit_info:
            learner_bench.main([*args, "--workdir", str(work), "--out", str(out)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "ddiloco bench learner: error:" in err, (args, err)
        assert not work.exists() and not out.exists(), args  # no synchronizer, no results
        if args == ["--steps", "0"]:
            assert "--steps >= 1" in err


def test_pinned_run_keeps_training_and_communication_apart(tmp_path):
    """--pin: the training thread on the first CPU, the synchronizer's and the communication's
    threads on the others, as read back from the kernel; the other CPUs' effect on a step measured
    (and the busy loops stopped); an overhead per repeat pair reported."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--pin needs 2 CPUs; this process may use 1")
    out = tmp_path / "learner.json"
    proc = _bench("--json", "--out", str(out), "--pin", "--d-model", "32", "--n-layer", "2", "--context", "32",
                  "--batch-size", "4", "--steps", "8", "--warmup", "2", "--repeats", "2", "--fragments", "4",
                  "--sync-every", "4", "--overlap", "1", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    cpus = sorted(os.sched_getaffinity(0))
    pinning = printed["pinning"]
    assert pinning["training_cpus"] == cpus[:1] and pinning["other_cpus"] == cpus[1:]
    seen = pinning["observed"]
    assert seen["training"] == cpus[:1]
    assert seen["communication"] and set(seen["communication"]) <= set(cpus[1:])
    assert seen["synchronizer"] and set(seen["synchronizer"]) <= set(cpus[1:])
    assert printed["cpus"] == available_cpus()
    neighbour = pinning["neighbour"]  # timed with the other CPUs idle, busy, and idle again
    assert neighbour["steps"] == 8 and neighbour["idle_step_ms"] > 0 and neighbour["busy_step_ms"] > 0
    assert neighbour["idle_step_ms"] == pytest.approx(sum(neighbour["idle_step_ms_before_after"]) / 2)
    assert neighbour["slowdown"] == pytest.approx(neighbour["busy_step_ms"] / neighbour["idle_step_ms"] - 1)
    assert len(neighbour["pids"]) == len(cpus) - 1  # a busy loop on each other CPU ...
    assert not any(os.path.exists(f"/proc/{pid}") for pid in neighbour["pids"])  # ... stopped and reaped
    rows = printed["results"]
    assert printed["pair_overheads"] == [1 - rows[i + 1]["steps_per_s"] / rows[i]["steps_per_s"] for i in (0, 2)]


def test_a_synchronizer_under_sched_batch(tmp_path):
    """--synchronizer-batch: every thread of the synchronizer process runs under SCHED_BATCH, as the
    kernel reports it after the timed phases, and the run measures as any other."""
    out = tmp_path / "learner.json"
    proc = _bench("--out", str(out), "--synchronizer-batch", "--d-model", "32", "--n-layer", "2", "--context", "32",
                  "--batch-size", "4", "--steps", "16", "--warmup", "4", "--repeats", "1", "--fragments", "4",
                  "--sync-every", "4", "--overlap", "1", "--threads", "1", "--min-step-ms", "25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(out.read_text())
    policy = printed["synchronizer_policy"]
    assert policy["asked"] == "batch" and policy["threads"] > 1 and policy["batch_threads"] == policy["threads"]
    assert f"synchronizer under SCHED_BATCH: {policy['threads']} of its {policy['threads']} threads" in proc.stdout
    assert printed["steps_per_s_on"] > 0 and printed["counts"]["sends"] > 0


def test_synchronizer_batch_is_refused_where_the_policy_does_not_exist(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)  # refused here, before any re-run child
    monkeypatch.delattr(os, "SCHED_BATCH")
    work, out = tmp_path / "work", tmp_path / "learner.json"
    with pytest.raises(SystemExit) as exit_info:
        learner_bench.main(["--synchronizer-batch", "--workdir", str(work), "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--synchronizer-batch needs Linux" in err
    assert not work.exists() and not out.exists()


def test_pin_is_refused_without_a_cpu_to_spare(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)  # refused here, before any re-run child
    work, out = tmp_path / "work", tmp_path / "learner.json"
    cpus = len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit) as exit_info:
        learner_bench.main(["--pin", "--threads", str(cpus), "--workdir", str(work), "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--pin needs a CPU left over" in err
    assert not work.exists() and not out.exists()


def _busy_children() -> list[int]:
    """Live child processes of this one running the neighbour check's busy loop."""
    return [pid for pid in children_of(os.getpid()) if b"getppid" in cmdline(pid)]


def test_neighbour_check_stops_its_busy_loops_when_a_step_fails():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("the neighbour check needs 2 CPUs; this process may use 1")
    calls = []

    def step() -> None:
        calls.append(1)
        if len(calls) == 3 + 4 + 2:  # warm-up, the idle timing, then inside the busy timing
            assert _busy_children(), "the busy loops run while the busy timing runs"
            raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        learner_bench.neighbour_slowdown(step, 4, set(cpus[1:]))
    assert _busy_children() == []
    result = learner_bench.neighbour_slowdown(lambda: None, 2, set(cpus[1:]))
    assert result["steps"] == 2 and len(result["pids"]) == len(cpus) - 1 and _busy_children() == []


def test_neighbour_check_refuses_a_busy_loop_that_cannot_start_and_leaves_none(capfd):
    """A busy loop that cannot move to its CPU (one this machine lacks) is reported as such, and the
    loops already started are stopped."""
    cpus = sorted(os.sched_getaffinity(0))
    with pytest.raises(learner_bench.NeighbourCheckError, match="did not start on its CPU"):
        learner_bench.neighbour_slowdown(lambda: None, 1, {cpus[0], 1 << 20})
    assert _busy_children() == []
    assert "Invalid argument" in capfd.readouterr().err  # the loop's own error, shown to the user


def test_a_failed_neighbour_check_ends_the_benchmark_with_a_message(tmp_path):
    """Through main, in a process of its own (--pin moves that process's threads): the busy loop's
    script exits at once, the benchmark says so in one line and exits 1, having started nothing."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--pin needs 2 CPUs; this process may use 1")
    work, out = tmp_path / "work", tmp_path / "learner.json"
    script = ("import sys; from ddiloco.lab.bench import learner as b; b._BUSY = 'raise SystemExit(3)'; "
              "sys.exit(b.main(sys.argv[1:]))")
    proc = run_tree([sys.executable, "-c", script, "--pin", "--threads", "1", "--huge-pages", "off",
                     "--d-model", "32", "--n-layer", "2", "--context", "32", "--batch-size", "4",
                     "--steps", "4", "--warmup", "1", "--repeats", "1", "--workdir", str(work),
                     "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("ddiloco bench learner: the neighbour check's busy loop")
    assert "Traceback" not in proc.stderr and not out.exists()
    assert not (work / "logs" / "synchronizer.log").exists()  # no synchronizer was started


def test_a_run_with_the_communication_in_a_process(tmp_path):
    out = tmp_path / "learner.json"
    proc = _bench("--json", "--out", str(out), "--d-model", "32", "--n-layer", "2", "--context", "32",
                  "--batch-size", "4", "--steps", "16", "--warmup", "4", "--repeats", "1", "--fragments", "4",
                  "--sync-every", "4", "--overlap", "1", "--threads", "1", "--comm", "process", "--min-step-ms", "25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    assert printed["comm"] == "process" and math.isfinite(printed["overhead"])
    counts = printed["counts"]
    assert counts["sends"] > 0 and counts["timed_sends"] > 0 and counts["applies"] > 0
    assert counts["encodes"] == counts["decodes"] == 0, "they run in the communication process, untimed"
    assert counts["arrivals_in_slots"] > 0, "merged fragments come back through shared memory"
