"""``ddiloco bench scale`` runs real ``ddiloco run`` fleets of several sizes and one learner alone,
reports tokens per second against alone and the synchronizer's CPU per merge; bad options are
refused before any run starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from ddiloco.lab.bench import scale as scale_bench
from ddiloco.lab.event_logs import load_jsonl
from tests.procs import run_tree

TINY = """
protocol: {num_fragments: 4, sync_every: 8, overlap: 2}
model: {d_model: 32, n_layer: 2, n_head: 2, context: 32}
data: {batch_size: 8, context: 32, max_bytes: 1000000}
train: {eval_every: 0, eval_batches: 2, lr: 0.003, warmup_steps: 5}
run: {global_eval_every_s: 5.0}
synchronizer: {policy: {quorum: 1, grace_gamma: 0.5, max_grace_s: 1.0}, heartbeat_interval_s: 0.5}
"""


def _bench(tmp_path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``ddiloco bench scale`` on the tiny config, its runs under ``tmp_path/work``, its JSON in
    ``tmp_path/scale.json``."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    return run_tree([sys.executable, "-m", "ddiloco.core.cli", "bench", "scale", "--config", str(cfg),
                     "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "scale.json"), *args],
                    capture_output=True, text=True, timeout=timeout)


def test_fleets_and_alone_run_and_are_measured_in_one_run(tmp_path):
    work, out = tmp_path / "work", tmp_path / "scale.json"
    proc = _bench(tmp_path, "--learners", "2,1", "--steps", "24", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r == json.loads(out.read_text())
    assert r["benchmark"] == "scale" and r["mode"] == "decoupled" and r["steps"] == 24
    batch_tokens = 8 * 32
    alone = r["alone"]
    assert alone["mode"] == "dp" and alone["tokens"] == 24 * batch_tokens and alone["tokens_per_s"] > 0
    assert alone["merges"] == 0 and alone["sync_cpu_ms_per_merge"] is None  # nothing to synchronise
    one_thread = r["alone_1_thread"]
    assert one_thread["tokens"] == alone["tokens"] and one_thread["tokens_per_s"] > 0
    if r["machine"]["cpus"] > 1:
        assert "threads: 1" in (work / "bench-1-thread.yaml").read_text()
        assert yaml.safe_load((work / "alone-1-thread" / "config.yaml").read_text())["train"]["threads"] == 1
    assert [f["learners"] for f in r["fleets"]] == [1, 2]  # sorted, each once
    cpus = r["machine"]["cpus"]
    for f in r["fleets"]:
        n = f["learners"]
        assert f["tokens"] == n * 24 * batch_tokens
        assert f["tokens_per_s"] == pytest.approx(f["tokens"] / f["window_s"])
        assert f["ratio"] == pytest.approx(f["tokens_per_s"] / alone["tokens_per_s"])
        one = r["alone_1_thread"]["tokens_per_s"]
        assert f["ideal_tokens_per_s"] == pytest.approx(max(alone["tokens_per_s"], min(n, cpus) * one))
        assert f["efficiency"] == pytest.approx(f["tokens_per_s"] / f["ideal_tokens_per_s"])
        assert f["merges"] > 1 and f["sync_cpu_ms_per_merge"] > 0 and f["sync_cores"] > 0
        assert 1 <= f["mean_quorum"] <= n
        assert f["step_ms"] > 0 and 0 <= f["blocked_share"] < 1
        # the figures come from the run's own logs: the merge events carry the synchronizer's CPU
        merges = [e for e in load_jsonl(work / f"learners-{n}" / "synchronizer.jsonl") if e["event"] == "merge"]
        cpu = [e["cpu_s"] for e in merges]
        assert len(merges) == f["merges"] and cpu == sorted(cpu)
        assert f["sync_cpu_ms_per_merge"] == pytest.approx(1e3 * (cpu[-1] - cpu[0]) / (len(cpu) - 1))
    # no evaluation of the global model competed with the fleet for the cores
    assert "global_eval_every_s: 0" in (work / "bench.yaml").read_text()


def test_bad_options_are_refused_before_any_run_starts(tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "scale.json"
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("model: {d_model: 30, n_head: 4}\n")
    tiny_cfg = tmp_path / "tiny.yaml"
    tiny_cfg.write_text(TINY)
    cases = [(["--learners", "0"], "learner counts must be >= 1"),
             (["--learners", "1,x"], "comma-separated list"),
             (["--steps", "0"], "--steps >= 1"),
             (["--timeout", "0"], "--timeout > 0"),
             (["--mode", "dp"], "invalid choice"),
             (["--shards", "0"], "shard counts must be >= 1"),
             (["--shards", "2,y"], "comma-separated list of shard counts"),
             (["--config", str(tiny_cfg), "--shards", "8"], "shards"),  # more shards than fragments
             (["--config", str(tmp_path / "missing.yaml")], "missing.yaml"),
             (["--config", str(bad_cfg)], "d_model")]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            scale_bench.main([*args, "--workdir", str(work), "--out", str(out)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "ddiloco bench scale: error:" in err and message in err, (args, err)
        assert not work.exists() and not out.exists(), args  # no run, no results


def test_sharded_points_report_each_shards_merges_cpu_and_bytes(tmp_path):
    work, out = tmp_path / "work", tmp_path / "scale.json"
    proc = _bench(tmp_path, "--learners", "2", "--shards", "2,1", "--steps", "24", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "per shard:" in proc.stdout  # the table has a row per shard
    r = json.loads(out.read_text())
    assert r["shards"] == [1, 2]
    assert [(f["learners"], f["shards"]) for f in r["fleets"]] == [(2, 1), (2, 2)]
    assert r["alone"]["bytes_per_s"] is None and "per_shard" not in r["alone"]
    for f in r["fleets"]:
        folder = work / ("learners-2" if f["shards"] == 1 else "learners-2-shards-2")
        logs = ([folder / "synchronizer.jsonl"] if f["shards"] == 1
                else [folder / f"synchronizer-{s}.jsonl" for s in range(2)])
        assert [s["shard"] for s in f["per_shard"]] == list(range(f["shards"]))
        assert sum(s["merges"] for s in f["per_shard"]) == f["merges"]
        for s, log in zip(f["per_shard"], logs, strict=True):
            events = load_jsonl(log)
            merges = [e for e in events if e["event"] == "merge"]
            started = [e for e in events if e["event"] == "sync_start"]
            assert len(started) == 1 and started[0]["t"] <= merges[0]["t"]
            assert len(merges) == s["merges"] > 1
            # every shard merged only its own fragments: p mod S == s
            assert {e["fragment"] % f["shards"] for e in merges} == {s["shard"]}
            rx, tx = [e["rx_bytes"] for e in merges], [e["tx_bytes"] for e in merges]
            # running totals: they never go back. Whether any bytes came in between a shard's first and
            # last merge depends on the machine's speed (a fast one can have all of a short run's
            # contributions in before its first merge), so only that there were bytes is asserted.
            assert rx == sorted(rx) and tx == sorted(tx) and rx[-1] > 0 and tx[-1] > 0
            span = merges[-1]["t"] - started[0]["t"]  # the shard's whole run: its totals count from its start
            assert s["rx_bytes_per_s"] == pytest.approx(rx[-1] / span) and s["rx_bytes_per_s"] > 0
            assert s["tx_bytes_per_s"] == pytest.approx(tx[-1] / span) and s["tx_bytes_per_s"] > 0
            assert s["bytes_per_merge"] == pytest.approx((rx[-1] + tx[-1]) / len(merges))
            assert s["merges_per_s"] == pytest.approx(s["merges"] / f["window_s"])
            assert s["sync_cpu_ms_per_merge"] > 0
        assert f["bytes_per_s"] == pytest.approx(sum(s["rx_bytes_per_s"] + s["tx_bytes_per_s"]
                                                     for s in f["per_shard"]))
        merges_between = sum(s["merges"] - 1 for s in f["per_shard"])
        assert f["sync_cpu_ms_per_merge"] == pytest.approx(
            sum(s["sync_cpu_ms_per_merge"] * (s["merges"] - 1) for s in f["per_shard"]) / merges_between)


def test_a_shards_bytes_count_from_its_last_start_to_its_last_merge():
    def merge(t, rx, tx):
        return {"event": "merge", "t": t, "cpu_s": t, "rx_bytes": rx, "tx_bytes": tx}
    # every contribution in before the first merge: nothing grows between merges, the rate is not 0
    early = [{"event": "sync_start", "t": 10.0}, merge(12.0, 5000, 100), merge(13.0, 5000, 300), merge(14.0, 5000, 500)]
    row = scale_bench._shard_row(0, early, window_s=4.0)
    assert row["merges"] == 3 and row["merges_per_s"] == pytest.approx(0.75)
    assert row["rx_bytes_per_s"] == pytest.approx(5000 / 4.0) and row["tx_bytes_per_s"] == pytest.approx(500 / 4.0)
    assert row["bytes_per_merge"] == pytest.approx(5500 / 3)
    assert row["sync_cpu_ms_per_merge"] == pytest.approx(1e3 * 2.0 / 2)
    # a restart: the totals start again from 0, and so do the span and the merges they cover
    restarted = [*early, {"event": "sync_start", "t": 20.0}, merge(21.0, 800, 40), merge(22.0, 900, 60)]
    row = scale_bench._shard_row(0, restarted, window_s=12.0)
    assert row["merges"] == 5
    assert row["rx_bytes_per_s"] == pytest.approx(900 / 2.0) and row["bytes_per_merge"] == pytest.approx(960 / 2)
    # no start logged, or no merge since it: no rate (not a zero)
    for events in ([merge(1.0, 10, 10), merge(2.0, 20, 20)], early[:1], [*early, {"event": "sync_start", "t": 30.0}]):
        row = scale_bench._shard_row(0, events, window_s=1.0)
        assert row["rx_bytes_per_s"] is None and row["tx_bytes_per_s"] is None and row["bytes_per_merge"] is None


def test_a_run_without_steps_is_an_error_not_a_zero(tmp_path):
    (tmp_path / "learners").mkdir()
    (tmp_path / "summary.json").write_text(json.dumps({"final_eval_loss": 3.0}))
    with pytest.raises(RuntimeError, match="logged no training steps"):
        scale_bench.measure(tmp_path)


def test_a_point_past_its_timeout_is_stopped_and_reported(tmp_path):
    work, out = tmp_path / "work", tmp_path / "scale.json"
    proc = _bench(tmp_path, "--learners", "1", "--steps", "100000", "--timeout", "2", timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "alone timed out after 2 s" in proc.stderr and str(work) in proc.stderr
    assert not out.exists()  # no results from a run that did not finish
