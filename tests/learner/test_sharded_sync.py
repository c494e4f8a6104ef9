"""A synchronizer in shards: real ``ddiloco synchronizer --shard s/S`` processes on loopback and
``DecoupledSync`` learners holding one stream per shard. Each shard merges only the fragments it
owns (p mod S == s), a learner joining later fetches the model from every shard, the export puts
the shards' state dirs together (and refuses a set with a shard missing), addresses given in the
wrong order are refused at the handshake, and one shard killed and restarted stalls only its own
fragments: training and the other shard's merges go on. The same with the learner's communication
in a process of its own."""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from torch import nn

from ddiloco.lab.procs import free_port
from ddiloco.learner.sync import DecoupledSync, SyncError
from tests.learner.test_eval_cmd import _eval_in_process
from tests.procs import synchronizer

PROTOCOL = "protocol: {num_fragments: 4, sync_every: 4, mode: decoupled, global_codec: fp32}\n"
OWNED = {0: {0, 2}, 1: {1, 3}}
MAX_STEPS = 600


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _events(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> float:
    target = torch.linspace(-1, 1, 8)
    x = torch.randn(32, 8, generator=gen)
    loss = ((model(x).squeeze(1) - x @ target) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.05)  # a step of a real model takes time: the synchronizers pace their rounds on it
    return float(loss.detach())


def _shard(tmp_path: pathlib.Path, s: int, config: pathlib.Path, *extra: str,
           started: list[subprocess.Popen[bytes]] | None = None) -> contextlib.AbstractContextManager[str]:
    return synchronizer(tmp_path, "--config", str(config), "--quorum", "1", "--shard", f"{s}/2",
                        "--state-dir", str(tmp_path / f"state-{s}"), "--event-log", str(tmp_path / f"sync-{s}.jsonl"),
                        *extra, started=started)


def _learner(first: str, second: str, log: pathlib.Path, **settings: Any
             ) -> tuple[nn.Module, torch.optim.Optimizer, DecoupledSync]:
    """Learner ``a`` on both shards (``settings``: more learner settings): its model, optimizer and sync."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = DecoupledSync(model, optimizer=opt, synchronizer=f"{first},{second}", learner_id="a", fragments=4,
                         sync_every=4, event_log=str(log), join_timeout_s=60.0, **settings)
    return model, opt, sync


def _export(*state_dirs: pathlib.Path, out: pathlib.Path) -> subprocess.CompletedProcess[str]:
    args = [a for d in state_dirs for a in ("--state-dir", str(d))]
    return subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "export", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


def test_two_shards_merge_their_own_fragments_and_the_model_is_put_together_from_both(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(PROTOCOL)
    with _shard(tmp_path, 0, config) as first, _shard(tmp_path, 1, config) as second:
        model, opt, sync = _learner(first, second, log := tmp_path / "a.jsonl", steps=40)
        assert sync.comm.shards == 2
        gen = torch.Generator().manual_seed(1)
        assert sync.join() == 0
        deadline = time.monotonic() + 30
        while len(sync.metrics.streams_up) != 2 and time.monotonic() < deadline:  # one stream per shard
            time.sleep(0.05)
        assert len(sync.metrics.streams_up) == 2
        losses = []
        for _ in range(40):
            losses.append(_step(model, opt, gen))
            sync.step(tokens=32, loss=losses[-1])
        assert sync.finish()
        assert losses[-1] < losses[0] / 2
        start = next(e for e in _events(log) if e["event"] == "start")
        assert start["genesis"] is True
        connects = sorted(e["synchronizer_shard"] for e in _events(log) if e["event"] == "connect")
        assert connects == ["0/2", "1/2"]
        assert min(sync.versions.values()) >= 1, f"a fragment never merged: {sync.versions}"
        for s in (0, 1):
            merged = {e["fragment"] for e in _events(tmp_path / f"sync-{s}.jsonl") if e["event"] == "merge"}
            assert merged == OWNED[s], f"shard {s} merged fragments {merged}, it owns {OWNED[s]}"

        # A learner joining later gets the global model from both shards, not its own init.
        other = _mlp()
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        late = DecoupledSync(other, synchronizer=f"{first},{second}", learner_id="b", fragments=4, sync_every=4,
                             steps=40, join_timeout_s=60.0)
        try:
            assert late.join() is not None
            assert all(late.versions[f] >= v for f, v in sync.versions.items())
            assert all(p.abs().sum() > 0 for p in other.parameters())
            live = {name: p.detach().clone() for name, p in other.named_parameters()}
        finally:
            late.close()

    # The export assembles both shards' state dirs; the weights are the live global model's.
    exported = tmp_path / "model.safetensors"
    proc = _export(tmp_path / "state-0", tmp_path / "state-1", out=exported)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    weights = load_file(str(exported))
    for name, value in live.items():
        assert torch.equal(weights[name], value), name
    missing = _export(tmp_path / "state-0", out=tmp_path / "half.safetensors")
    assert missing.returncode != 0 and "shards [1] of 2 are missing" in missing.stderr
    assert not (tmp_path / "half.safetensors").exists()


def test_two_shards_with_the_communication_in_a_process(tmp_path):
    """``learner.comm: process`` against two shards: the communication process runs one lane (a
    thread) per shard, and both deliver merged fragments into the same return slots. A heal of
    every fragment has both shards' fragments come back at once: each is applied whole (a slot
    given to two lanes would hand training another fragment's values, or one not filled), and
    both shards go on merging their own fragments after it."""
    config = tmp_path / "config.yaml"
    config.write_text(PROTOCOL)
    with _shard(tmp_path, 0, config) as first, _shard(tmp_path, 1, config) as second:
        model, opt, sync = _learner(first, second, log := tmp_path / "a.jsonl", steps=MAX_STEPS, comm="process")
        assert sync.comm.shards == 2
        gen = torch.Generator().manual_seed(1)
        assert sync.join() == 0
        healed_at = 0
        at_heal: dict[int, int] = {}
        losses = []
        step = 0
        while step < MAX_STEPS:  # a deadline in steps: a slower machine is slower per step and per merge alike
            step += 1
            losses.append(_step(model, opt, gen))
            sync.step(tokens=32, loss=losses[-1])
            if not healed_at and min(sync.versions.values()) >= 1:
                sync.heal(None, "a test's heal")
                healed_at, at_heal = step, dict(sync.versions)
            if healed_at and step >= healed_at + 8 and all(sync.versions[p] > at_heal[p] for p in range(4)):
                break
        assert healed_at, f"a fragment never merged: {sync.versions}"
        assert all(sync.versions[p] > at_heal[p] for p in range(4)), f"merges stopped: {at_heal} -> {sync.versions}"
        assert sync.comm.returned["slots"] > 0, "merged fragments come back through shared memory"
        assert sync.finish()
    events = _events(log)
    after = [e for e in events if e["event"] == "apply" and e["step"] > healed_at]
    # the heal's fetch of each fragment is applied, unless a newer merge of it arrived first and replaced it
    assert {e["fragment"] for e in after} == {0, 1, 2, 3} and any(e["resync"] for e in after), after
    assert sorted(e["synchronizer_shard"] for e in events if e["event"] == "connect") == ["0/2", "1/2"]
    for s in (0, 1):
        merged = {e["fragment"] for e in _events(tmp_path / f"sync-{s}.jsonl") if e["event"] == "merge"}
        assert merged == OWNED[s], f"shard {s} merged fragments {merged}, it owns {OWNED[s]}"
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_shard_addresses_in_the_wrong_order_are_refused_at_the_handshake(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(PROTOCOL)
    with _shard(tmp_path, 0, config) as first, _shard(tmp_path, 1, config) as second:
        sync = DecoupledSync(_mlp(), synchronizer=f"{second},{first}", learner_id="a", fragments=4, sync_every=4,
                             join_timeout_s=30.0)
        t0 = time.monotonic()
        with pytest.raises(SyncError, match=r"serves shard 1/2, this learner expects shard 0/2"):
            sync.join()
        assert time.monotonic() - t0 < 25, "a wrong address is a refusal, not a wait for the join timeout"
        unsharded = DecoupledSync(_mlp(), synchronizer=first, learner_id="b", fragments=4, sync_every=4,
                                  join_timeout_s=30.0)
        with pytest.raises(SyncError, match=r"serves shard 0/2, this learner expects shard 0/1"):
            unsharded.join()


def test_bad_shard_settings_are_clear_errors(tmp_path):
    with pytest.raises(SyncError, match="2 synchronizer address"):
        DecoupledSync(_mlp(), synchronizer="127.0.0.1:7000,127.0.0.1:7001", synchronizer_shards=3, fragments=4)
    with pytest.raises(SyncError, match="given for two shards"):
        DecoupledSync(_mlp(), synchronizer="127.0.0.1:7000,127.0.0.1:7000", fragments=4)
    with pytest.raises(SyncError, match="would own none"):
        DecoupledSync(_mlp(), synchronizer="127.0.0.{shard}:7000", synchronizer_shards=5, fragments=4)
    config = tmp_path / "config.yaml"
    config.write_text(PROTOCOL)
    for shard, why in [("2/2", "outside 0..1"), ("1", "s/S"), ("0/5", "would own none")]:
        proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "synchronizer", "--config", str(config),
                               "--state-dir", str(tmp_path / "never"), "--shard", shard, "--listen", "127.0.0.1:0"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and why in proc.stderr, (shard, proc.stderr[-2000:])
    assert not (tmp_path / "never").exists() or not any((tmp_path / "never").iterdir())


def test_one_shard_down_stalls_only_its_own_fragments(tmp_path):
    """Shard 1 is killed (SIGKILL) part way and restarted from its state dir on the same port:
    training never waits, shard 0's fragments keep merging while shard 1 is down, and shard 1's
    fragments merge again after its restart."""
    config = tmp_path / "config.yaml"
    config.write_text(PROTOCOL)
    port = free_port()
    started: list[subprocess.Popen[bytes]] = []
    log = tmp_path / "a.jsonl"
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(_shard(tmp_path, 0, config))
        second = stack.enter_context(_shard(tmp_path, 1, config, "--listen", f"127.0.0.1:{port}", started=started))
        model, opt, sync = _learner(first, second, log, steps=MAX_STEPS)
        gen = torch.Generator().manual_seed(1)
        assert sync.join() == 0
        down_at = up_at = 0
        restarted = None
        at_restart: dict[int, int] = {}
        step = 0
        # Steps go on until shard 1 merged both its fragments again after its restart (a deadline in
        # steps, not in seconds: a slower machine takes longer per step and per reconnect alike).
        while step < MAX_STEPS:
            step += 1
            sync.step(tokens=32, loss=_step(model, opt, gen))
            if step == 20:
                started[0].kill()
                started[0].wait()
                down_at = step
            if step == 50:
                restarted = stack.enter_context(
                    _shard(tmp_path, 1, config, "--listen", f"127.0.0.1:{port}", started=started))
                up_at, at_restart = step, dict(sync.versions)
            if up_at and step >= 70 and all(sync.versions[p] > at_restart[p] for p in OWNED[1]):
                break
        assert restarted == second
        # the learner's last contributions to the restarted shard are answered before it leaves
        assert sync.finish(flush_timeout_s=60.0)
    events = _events(log)
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == step and max(e["blocked_s"] for e in steps) == 0.0
    applies = [e for e in events if e["event"] == "apply" and not e["resync"]]
    # while shard 1 was down: shard 0's fragments went on merging (allow two periods for a
    # merge in flight to land and for the learner's stream to notice the shard is gone)
    quiet_from, quiet_to = down_at + 8, up_at
    during = {e["fragment"] for e in applies if quiet_from < e["step"] <= quiet_to}
    assert during & OWNED[0] == OWNED[0], f"shard 0 stopped merging while shard 1 was down: {during}"
    assert not during & OWNED[1], f"fragments of the dead shard were applied: {during}"
    after = {e["fragment"] for e in applies if e["step"] > up_at}
    assert after & OWNED[1] == OWNED[1], f"shard 1 did not merge again after its restart: {after}"
    assert math.isfinite(steps[-1]["loss"])
    merged = [e for e in _events(tmp_path / "sync-1.jsonl") if e["event"] == "merge"]
    assert {e["fragment"] for e in merged} == OWNED[1]


def test_eval_reads_the_live_model_from_every_shard(tmp_path, capsys):
    from ddiloco.learner.config import load_learner_config
    from ddiloco.training.data import eval_batches, load_corpus
    from ddiloco.training.inner_loop import evaluate
    from ddiloco.training.model import build_model

    config = tmp_path / "config.yaml"
    config.write_text("protocol: {num_fragments: 3, sync_every: 4, mode: decoupled, global_codec: fp32}\n"
                      "model: {d_model: 32, n_layer: 1, n_head: 2, context: 32}\n"
                      "data: {batch_size: 4, context: 32, max_bytes: 200000}\n"
                      "train: {eval_batches: 2}\n")
    cfg = load_learner_config(str(config))
    model = build_model(cfg.model, 7)
    with _shard(tmp_path, 0, config) as first, _shard(tmp_path, 1, config) as second:
        sync = DecoupledSync(model, synchronizer=f"{first},{second}", learner_id="a", config=cfg,
                             join_timeout_s=60.0)
        try:
            assert sync.join() == 0  # the genesis upload: shard 0 holds fragments 0 and 2, shard 1 fragment 1
        finally:
            sync.close()
        capsys.readouterr()
        assert _eval_in_process("--synchronizer", f"{first},{second}", "--config", str(config), "--json") == 0
        live = json.loads(capsys.readouterr().out)["loss"]
        assert _eval_in_process("--synchronizer", first, "--config", str(config)) == 2
        assert "fragments [1] are missing" in capsys.readouterr().err
    corpus = load_corpus(cfg.data)
    local = evaluate(model, eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.context, 2), torch.device("cpu"))
    assert live == pytest.approx(local, abs=1e-6)
