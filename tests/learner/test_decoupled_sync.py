"""``DecoupledSync`` around a loop it does not own: misuse errors, then real synchronizer
processes with in-process and example-script learners (a user-defined GRU and a transformers
Llama from a local config), healing from a non-finite loss, refusal of a learner whose protocol
or model disagrees with the fleet, and a learner made of two torchrun ranks (DDP over gloo)
beside a single-process one."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ddiloco.learner.sync import DecoupledSync, SyncError, parameter_fingerprint
from tests.procs import synchronizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_loop.py"
PROTOCOL = "protocol: {num_fragments: 3, sync_every: 4, mode: decoupled}\n"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _events(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_misuse_is_a_clear_error_before_anything_connects():
    model = _mlp()
    sync = DecoupledSync(model, synchronizer="127.0.0.1:9", fragments=2, sync_every=4)
    with pytest.raises(SyncError, match="call join"):
        sync.step(tokens=10)
    sync.close()
    with pytest.raises(SyncError, match="no parameters"):
        DecoupledSync(nn.ReLU(), synchronizer="127.0.0.1:9")
    with pytest.raises(SyncError, match="unknown key"):
        DecoupledSync(model, synchronizer="127.0.0.1:9", no_such_setting=1)
    with pytest.raises(SyncError, match="fragment"):
        DecoupledSync(model, synchronizer="127.0.0.1:9", fragments=64)
    with pytest.raises(SyncError, match="synchronizer"):
        DecoupledSync(model, synchronizer="not an address")


def test_the_default_fingerprint_follows_names_shapes_and_the_reference():
    a, b = _mlp(), _mlp()
    with torch.no_grad():
        b[0].weight.add_(1.0)  # weights do not count
    assert parameter_fingerprint(a) == parameter_fingerprint(b)
    assert parameter_fingerprint(a, "x:y") != parameter_fingerprint(a)
    assert parameter_fingerprint(nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 1))) != parameter_fingerprint(a)


def _train(sync: DecoupledSync, model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int,
           nan_at: int | None = None) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    target = torch.linspace(-1, 1, 8)
    losses = []
    start = sync.join()
    assert start is not None
    for step in range(start + 1, steps + 1):
        x = torch.randn(32, 8, generator=gen)
        loss = ((model(x).squeeze(1) - x @ target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)  # a step of a real model takes time: the synchronizer paces its rounds on it
        value = float("nan") if step == nan_at else float(loss.detach())
        losses.append(value)
        sync.step(tokens=32, loss=value)
    assert sync.finish()
    return losses


def check_hand_overs(events: list[dict[str, Any]], synchronizer_log: pathlib.Path, *, last_step: int) -> None:
    """The progress since each fragment's last send went out at the end as hand-overs, and the
    synchronizer (quorum 1, this learner alone) merged each round of hand-overs alone without
    momentum and every other round with it. A hand-over that replaced the fragment's previous
    contribution before it was merged (answered superseded, or dropped unsent) holds that one's
    whole period too: its round keeps the momentum."""
    sends = [e for e in events if e["event"] == "send"]
    hand_overs = {e["sequence"] for e in sends if e.get("hand_over")}
    assert hand_overs, "the end of training hands over the progress since each fragment's last send"
    assert all(e["step"] == last_step and e["round"] == 0 for e in sends if e["sequence"] in hand_overs)
    replaced = {e["sequence"] for e in events if (e["event"] == "result" and e["outcome"] == "superseded")
                or (e["event"] == "dropped" and "replaced" in e["reason"])}
    whole = set()  # hand-overs holding a replaced contribution's period
    for h in (e for e in sends if e["sequence"] in hand_overs):
        before = [e for e in sends if e["fragment"] == h["fragment"] and e["sequence"] < h["sequence"]]
        if before and before[-1]["sequence"] in replaced and before[-1]["base_version"] == h["base_version"]:
            whole.add(h["sequence"])
    merges = [e for e in _events(synchronizer_log) if e["event"] == "merge"]
    merged = {c[2] for e in merges for c in e["contributions"]}
    assert hand_overs <= merged, "every hand-over is merged"
    for e in merges:
        sequences = {c[2] for c in e["contributions"]}
        if sequences <= hand_overs - whole:
            assert e["momentum"] == 0.0, e
        else:
            assert e["momentum"] > 0.0, e


@contextlib.contextmanager
def fleet(tmp_path: pathlib.Path, **settings: Any
          ) -> Iterator[tuple[str, DecoupledSync, nn.Module, torch.optim.Optimizer, pathlib.Path]]:
    """A synchronizer (quorum 1) and one learner ``loop-a`` on it (``settings``: more learner settings):
    (the synchronizer's address, the learner, its model, its optimizer, its event log)."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(PROTOCOL)
    with synchronizer(tmp_path, "--config", str(cfg), "--quorum", "1",
                      "--event-log", str(tmp_path / "synchronizer.jsonl")) as target:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        log = tmp_path / "a.jsonl"
        sync = DecoupledSync(model, optimizer=opt, synchronizer=target, learner_id="loop-a", fragments=3, sync_every=4,
                             event_log=str(log), join_timeout_s=60.0, **settings)
        yield target, sync, model, opt, log


def test_an_in_process_loop_joins_merges_heals_and_a_second_loop_gets_the_global_model(tmp_path):
    with fleet(tmp_path) as (target, sync, model, opt, log):
        losses = _train(sync, model, opt, steps=40, seed=1, nan_at=20)
        events = _events(log)
        kinds = [e["event"] for e in events]
        start = next(e for e in events if e["event"] == "start")
        assert start["genesis"] is True and start["start_step"] == 0
        heal = next(e for e in events if e["event"] == "heal")
        assert heal["step"] == 20 and sorted(heal["fragments"]) == [0, 1, 2] and "non-finite loss" in heal["reason"]
        assert "apply" in kinds and min(sync.versions.values()) >= 1
        assert all(math.isfinite(v) for v in losses[21:]) and losses[-1] < losses[0] / 2
        assert sync.tokens == 40 * 32
        check_hand_overs(events, tmp_path / "synchronizer.jsonl", last_step=40)

        # A second loop joins the fleet: it gets the global model, not its own init.
        other = _mlp()
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        late = DecoupledSync(other, synchronizer=target, learner_id="loop-b", fragments=3, sync_every=4, steps=40,
                             join_timeout_s=60.0)
        try:
            # a late learner starts at the fleet's progress: at least min(versions) x sync_every, at
            # most its own 40 steps (loop-a's last sends, merged after its step 40, may make the
            # versions' progress 11 x 4 = 44 on a machine fast enough)
            start = late.join()
            assert start is not None and 0 < min(min(late.versions.values()) * 4, 40) <= start <= 40
            assert any(p.abs().sum() > 0 for p in other.parameters())
            # the global versions: at least what loop-a applied (its last sends merged after it finished)
            assert all(late.versions[f] >= v for f, v in sync.versions.items())
        finally:
            late.close()


def test_a_learner_whose_protocol_or_model_disagrees_is_refused(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(PROTOCOL)
    with synchronizer(tmp_path, "--config", str(cfg), "--quorum", "1") as target:
        first = DecoupledSync(_mlp(), synchronizer=target, learner_id="a", fragments=3, sync_every=4)
        assert first.join() == 0
        first.close()
        for name, model, settings in [("b", _mlp(), {"fragments": 2}),
                                      ("c", nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 1)), {})]:
            sync = DecoupledSync(model, synchronizer=target, learner_id=name, join_timeout_s=30.0,
                                 **{"fragments": 3, "sync_every": 4, **settings})
            with pytest.raises(SyncError, match="refused"):
                sync.join()


def _eval(*args: str, cwd: pathlib.Path) -> float:
    proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "eval", "--json", "--threads", "1", *args],
                          capture_output=True, text=True, timeout=180, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLE.parent), str(ROOT)])))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(json.loads(proc.stdout)["loss"])


@pytest.mark.parametrize("hf", [False, True], ids=["own-gru", "transformers-llama"])
def test_the_example_trains_two_learners_that_merge_and_its_export_evaluates_like_the_live_model(tmp_path, hf):
    """The acceptance path of a user's own loop: two learners of the example (a model defined in
    the example, or a transformers Llama from a local config) train and merge through
    DecoupledSync; the synchronizer's global model is exported, reloaded, and its eval loss equals
    the live global model's (fp32 broadcast, so the two are the same numbers)."""
    config = tmp_path / "own_loop.yaml"
    config.write_text("protocol: {num_fragments: 4, sync_every: 5, mode: decoupled, global_codec: fp32}\n")
    extra: list[str] = []
    model = "model: {kind: ref, ref: \"own_loop:make_model\", context: 64}\n"
    if hf:
        hf_config = tmp_path / "llama.json"
        hf_config.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
                                         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "max_position_embeddings": 64}))
        extra = ["--hf-config", str(hf_config)]
        model = f"model: {{kind: hf, ref: {hf_config}, context: 64}}\n"
    eval_config = tmp_path / "eval.yaml"
    eval_config.write_text(config.read_text() + model + "data: {context: 64, batch_size: 4, max_bytes: 300000}\n"
                           "train: {eval_batches: 4}\n")
    with synchronizer(tmp_path, "--config", str(config), "--quorum", "1") as target:
        procs = [subprocess.Popen([sys.executable, str(EXAMPLE), "--synchronizer", target, "--learner-id", f"learner-{i}",
                                   "--config", str(config), "--steps", "30", "--shard", str(i), "--no-resume",
                                   "--min-step-s", "0.05",
                                   "--event-log", str(tmp_path / f"{i}.jsonl"),
                                   "--summary-file", str(tmp_path / f"{i}.json"), *extra],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
        try:
            errs = [p.communicate(timeout=240)[1] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for i, p in enumerate(procs):
            assert p.returncode == 0, errs[i][-3000:]
        exported = tmp_path / "model.safetensors"
        proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "export", "--state-dir", str(tmp_path / "state"),
                               "--out", str(exported)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        live = _eval("--synchronizer", target, "--config", str(eval_config), cwd=tmp_path)
    for i in range(2):
        summary = json.loads((tmp_path / f"{i}.json").read_text())
        # --no-resume: the learner that starts second runs every step too, however late it joins
        assert summary["start_step"] == 0 and summary["steps"] == 30 and summary["all_answered"]
        assert math.isfinite(summary["loss"]) and summary["loss"] < math.log(256)
        applied = [e for e in _events(tmp_path / f"{i}.jsonl") if e["event"] == "apply"]
        assert applied, f"learner-{i} applied no merged fragment"
    genesis = [next(e for e in _events(tmp_path / f"{i}.jsonl") if e["event"] == "start")["genesis"] for i in range(2)]
    assert sorted(genesis) == [False, True]  # one uploaded the genesis model, the other fetched it

    from_file = _eval("--model-file", str(exported), "--config", str(eval_config), cwd=tmp_path)
    assert from_file == pytest.approx(live, abs=1e-9)
    assert from_file < math.log(256) - 0.5  # trained, well below a uniform guess

    # reloaded in Python into the user's own class, with one call
    from safetensors.torch import load_file

    from ddiloco.training.export_io import load_exported

    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import own_loop

        fresh = own_loop.hf_model(str(hf_config)) if hf else own_loop.make_model()
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    meta = load_exported(fresh, exported)
    assert meta["model"] == ("hf:" + str(hf_config) if hf else "own_loop:make_model")
    weights = load_file(str(exported))
    assert all(torch.equal(p.detach(), weights[name]) for name, p in fresh.named_parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("comm", ["thread", "process"])
def test_a_two_rank_torchrun_learner_streams_once_and_keeps_its_ranks_identical(tmp_path, comm):
    config = tmp_path / "own_loop.yaml"
    config.write_text("protocol: {num_fragments: 4, sync_every: 5, mode: decoupled}\n")
    common = ["--config", str(config), "--steps", "30", "--no-resume", "--min-step-s", "0.05", "--comm", comm]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with synchronizer(tmp_path, "--config", str(config), "--quorum", "1") as target:
        single = subprocess.Popen([sys.executable, str(EXAMPLE), "--synchronizer", target, "--learner-id", "learner-1",
                                   "--shard", "1", "--event-log", str(tmp_path / "single.jsonl"),
                                   "--summary-file", str(tmp_path / "single.json"), *common],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        ranks = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                  "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(EXAMPLE),
                                  "--synchronizer", target, "--learner-id", "learner-0", "--shard", "0",
                                  "--event-log", str(tmp_path / "ranks.jsonl"),
                                  "--summary-file", str(tmp_path / "ranks.json"), *common],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        try:
            errs = {name: p.communicate(timeout=300)[1] for name, p in (("single", single), ("ranks", ranks))}
        finally:
            for p in (single, ranks):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert single.returncode == 0, errs["single"][-3000:]
    assert ranks.returncode == 0, errs["ranks"][-3000:]
    r0, r1 = (json.loads((tmp_path / f"ranks.json.rank{r}").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert r0["params_sha256"] == r1["params_sha256"], "the ranks' parameters diverged"
    assert r0["versions"] == r1["versions"] and min(r0["versions"].values()) >= 1
    assert r0["tokens"] == r1["tokens"] == 2 * 30 * 8 * 64  # both ranks' tokens count for the learner
    events = _events(tmp_path / "ranks.jsonl")  # rank 0's only: the other ranks never connect
    kinds = [e["event"] for e in events]
    assert kinds.count("start") == 1 and kinds.count("connect") == 1
    assert next(e for e in events if e["event"] == "start")["config"]["comm"] == comm
    sends = [e for e in events if e["event"] == "send"]
    assert len({(e["fragment"], e["sequence"]) for e in sends}) == len(sends) > 0
    assert all(e["tokens"] % (2 * 8 * 64) == 0 for e in sends)  # each contribution carries both ranks' tokens
    assert "apply" in kinds
    merged = [e for e in events if e["event"] == "result" and e.get("outcome") == "merged"]
    assert merged, "no contribution of the two-rank learner was merged"
    single_events = _events(tmp_path / "single.jsonl")
    assert any(e["event"] == "apply" for e in single_events)


def test_a_second_drain_ends_the_wait_for_results(tmp_path):
    """A stopped synchronizer answers nothing: ``finish()`` would wait its 30 s for the results of
    what was sent. A second ``drain()`` (the service's second SIGTERM) ends the wait at once, and
    what is unanswered is recorded as dropped."""
    import signal
    import threading

    cfg = tmp_path / "config.yaml"
    cfg.write_text(PROTOCOL)
    started: list[subprocess.Popen[bytes]] = []
    with synchronizer(tmp_path, "--config", str(cfg), "--quorum", "1", started=started) as target:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        log = tmp_path / "events.jsonl"
        sync = DecoupledSync(model, optimizer=opt, synchronizer=target, learner_id="a", fragments=3, sync_every=4,
                             event_log=str(log), join_timeout_s=60.0)
        assert sync.join() == 0
        started[0].send_signal(signal.SIGSTOP)
        try:
            x = torch.randn(16, 8)
            for _ in range(8):  # two rounds of sends, none of them answered
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sync.step(tokens=16, loss=float(loss.detach()))
            sync.drain()
            assert sync.draining
            result: list[bool] = []
            finisher = threading.Thread(target=lambda: result.append(sync.finish()))
            finisher.start()
            finisher.join(timeout=2.0)
            assert finisher.is_alive(), "finish() should be waiting for the results"
            assert sync.comm.pending() > 0
            asked = time.monotonic()
            sync.drain()
            finisher.join(timeout=20.0)
            assert not finisher.is_alive() and time.monotonic() - asked < 10
            assert result == [False]
        finally:
            started[0].send_signal(signal.SIGCONT)
    events = _events(log)
    flushed = next(e for e in events if e["event"] == "flushed")
    assert flushed["all_answered"] is False and flushed["pending_s"] < 15
    dropped = [e for e in events if e["event"] == "dropped"]
    assert dropped and all("answered" in e["reason"] for e in dropped)
