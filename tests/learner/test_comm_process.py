"""``learner.comm: process``: the communication in a process of its own, against real synchronizer
processes. The same loop as thread mode (genesis, merges, a heal, a late joiner fetching the global
model); the communication process SIGKILLed in the middle of training and started again with
nothing lost; the training process SIGKILLed and its communication process gone with it; a
communication process killed before the join turned into a clear error."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch import nn

from ddiloco.learner.comm_child import thread_policies
from ddiloco.learner.comm_process import ProcessComm
from ddiloco.learner.sync import DecoupledSync, SyncError
from tests.learner.test_decoupled_sync import PROTOCOL, _events, _mlp, check_hand_overs, fleet
from tests.procs import children_of, synchronizer


def _loss(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> float:
    x = torch.randn(32, 8, generator=gen)
    loss = ((model(x).squeeze(1) - x @ torch.linspace(-1, 1, 8)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.05)  # a step of a real model takes time: the synchronizer paces its rounds on it
    return float(loss.detach())


def _batch_allowed() -> bool:
    """Whether a process started here may put itself under SCHED_BATCH (not where this runs under
    a policy it may not leave, say SCHED_IDLE, or a sandbox refuses it)."""
    script = "import os; os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60).returncode == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_loop_with_its_communication_in_a_process_joins_merges_heals_and_feeds_a_late_joiner(tmp_path):
    with fleet(tmp_path, comm="process") as (target, sync, model, opt, log):
        assert isinstance(sync.comm, ProcessComm)
        gen = torch.Generator().manual_seed(1)
        assert sync.join() == 0
        child = sync.comm.pid
        assert child is not None and child in children_of(os.getpid())
        if _batch_allowed():
            policies = thread_policies(child)
            assert policies and set(policies.values()) == {os.SCHED_BATCH}, \
                f"every thread of the communication process runs under SCHED_BATCH (never preempting training): {policies}"
        losses = []
        for step in range(1, 41):
            value = _loss(model, opt, gen)
            value = float("nan") if step == 20 else value
            losses.append(value)
            sync.step(tokens=32, loss=value)
        assert sync.finish()
        assert not _alive(child), "the communication process ends with the learner"
        events = _events(log)
        kinds = [e["event"] for e in events]
        assert next(e for e in events if e["event"] == "start")["genesis"] is True
        heal = next(e for e in events if e["event"] == "heal")
        assert heal["step"] == 20 and sorted(heal["fragments"]) == [0, 1, 2]
        assert "apply" in kinds and min(sync.versions.values()) >= 1
        assert all(math.isfinite(v) for v in losses[21:]) and losses[-1] < losses[0] / 2
        sends = {e["sequence"] for e in events if e["event"] == "send"}
        answered = {e["sequence"] for e in events if e["event"] in ("result", "dropped")}
        assert sends and sends == answered, "every contribution handed over is answered or dropped, in the log"
        check_hand_overs(events, tmp_path / "synchronizer.jsonl", last_step=40)
        merged = [e for e in events if e["event"] == "result" and e["outcome"] == "merged"]
        assert merged and all(e["learner_id"] == "loop-a" for e in merged)
        connect = next(i for i, e in enumerate(events) if e["event"] == "connect")
        assert kinds.index("start") > connect and kinds.count("flushed") == 1
        assert sync.comm.bytes_sent > 0 and sync.comm.bytes_received > 0
        assert sync.comm.returned["slots"] > 0, "merged fragments come back through shared memory"

        # A late joiner in process mode fetches the global model through its communication process.
        other = _mlp()
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        late = DecoupledSync(other, synchronizer=target, learner_id="loop-b", fragments=3, sync_every=4, steps=40,
                             join_timeout_s=60.0, comm="process")
        try:
            start = late.join()
            assert start is not None and 0 < start <= 40
            assert all(late.versions[f] >= v for f, v in sync.versions.items())
            assert any(p.abs().sum() > 0 for p in other.parameters())
        finally:
            late.close()


def test_the_communication_process_runs_torch_on_codec_threads(tmp_path, capfd):
    """Its torch work on ``codec_threads`` threads (default 1), not one per CPU: a team member that
    waits for the training thread's CPU would hold every large operation up. It says so as it starts."""
    for threads in (None, 2):
        work = tmp_path / str(threads)
        work.mkdir()
        settings = {} if threads is None else {"codec_threads": threads}
        with fleet(work, comm="process", **settings) as (_target, sync, _model, _opt, _log):
            assert sync.join() == 0
            child = sync.comm.pid
            assert sync.finish()
        started = [json.loads(line) for line in capfd.readouterr().err.splitlines()
                   if "communication process started" in line]
        assert len(started) == 1, started
        assert started[0]["pid"] == child and started[0]["torch_threads"] == (threads or 1)
        assert started[0]["sched_batch"] == _batch_allowed() and started[0]["rejoin"] is False
    with pytest.raises(SyncError, match="learner: codec_threads must be >= 1, got 0"):
        DecoupledSync(_mlp(), synchronizer="127.0.0.1:9", learner_id="x", fragments=3, sync_every=4,
                      comm="process", codec_threads=0)


def test_a_sigkilled_communication_process_is_started_again_and_nothing_is_lost(tmp_path):
    with fleet(tmp_path, comm="process") as (_, sync, model, opt, log):
        gen = torch.Generator().manual_seed(2)
        assert sync.join() == 0
        first = sync.comm.pid
        assert first is not None
        killed_at = None
        versions_at_kill: dict[int, int] = {}
        deadline = time.monotonic() + 120
        step = 0
        while time.monotonic() < deadline:
            step += 1
            sync.step(tokens=32, loss=_loss(model, opt, gen))
            if killed_at is None and min(sync.versions.values()) >= 2 and sync.comm.pending() > 0:
                os.kill(first, signal.SIGKILL)  # in the middle of training, with contributions in flight
                killed_at, versions_at_kill = step, dict(sync.versions)
            if killed_at is not None and step >= killed_at + 8 and all(
                    sync.versions[f] > v + 1 for f, v in versions_at_kill.items()):
                break
        assert killed_at is not None, "no merge within the deadline"
        assert sync.comm.restarts == 1 and sync.comm.pid not in (None, first)
        assert all(sync.versions[f] > v + 1 for f, v in versions_at_kill.items()), \
            f"merges did not go on after the restart: {versions_at_kill} -> {sync.versions}"
        assert sync.finish()
        events = _events(log)
        restart = [e for e in events if e["event"] == "comm_restart"]
        assert len(restart) == 1 and restart[0]["exit_code"] == -signal.SIGKILL
        assert restart[0]["resent"] >= 1, "the contributions in flight are handed to the new process"
        assert restart[0]["pid"] == sync.comm.pid
        assert sum(e["event"] == "start" for e in events) == 1, "a restart is no new join"
        assert not any(e["event"] == "heal" for e in events), "nothing needed healing"
        sends = {e["sequence"] for e in events if e["event"] == "send"}
        answered = {e["sequence"] for e in events if e["event"] in ("result", "dropped")}
        assert sends <= answered, "every contribution is answered or dropped (finish() waited for them)"
        after = [e for e in events if e["event"] == "result" and e["outcome"] == "merged"
                 and e["t"] > restart[0]["t"]]
        assert after, "contributions sent by the new communication process merge"


def test_the_communication_process_writes_its_events_to_the_log_as_they_happen(tmp_path):
    """The child appends its own events (a contribution's result) to the learner's event log when
    they happen, not when training next reads the channel: a training process that is not at a
    step boundary (here: it never calls the learner again until the result is in the file) still
    has them on disk. Training counts them once it reads them, without writing them twice."""
    with fleet(tmp_path, comm="process") as (_, sync, model, opt, log):
        gen = torch.Generator().manual_seed(3)
        assert sync.join() == 0
        sends: list[dict] = []
        deadline = time.monotonic() + 60
        while not sends and time.monotonic() < deadline:
            sync.step(tokens=32, loss=_loss(model, opt, gen))
            sends = [e for e in _events(log) if e["event"] == "send"]
        assert sends, "nothing was sent within the deadline"
        last = max(e["sequence"] for e in sends)
        counted = sync.events.counts.get("result", 0)
        # no call into the learner from here: the child alone can write the result
        deadline = time.monotonic() + 30
        while not any(e["event"] == "result" and e["sequence"] == last for e in _events(log)):
            assert time.monotonic() < deadline, "the result of the last contribution never reached the log"
            time.sleep(0.05)
        assert sync.events.counts.get("result", 0) == counted, "training has not read it yet"
        assert sync.finish()
        events = _events(log)  # every line whole: the two processes' lines never interleave
        results = [e["sequence"] for e in events if e["event"] == "result"]
        assert len(results) == len(set(results)), "each result written once"
        assert sync.events.counts["result"] == len(results), "and counted once by training"
        assert {e["learner_id"] for e in events} == {"loop-a"}


def test_merged_fragments_come_back_on_the_channel_when_every_return_slot_is_filled(tmp_path, monkeypatch):
    """One return slot, and training not reading while a heal's three fragments come back: the first
    fills the slot, the others follow their messages on the channel; all three are applied whole."""
    from ddiloco.learner import comm_process

    monkeypatch.setattr(comm_process, "RETURN_SLOTS", 1)
    with fleet(tmp_path, comm="process") as (_, sync, model, opt, log):
        gen = torch.Generator().manual_seed(3)
        assert sync.join() == 0
        deadline = time.monotonic() + 120
        while min(sync.versions.values()) < 1 and time.monotonic() < deadline:
            sync.step(tokens=32, loss=_loss(model, opt, gen))
        assert min(sync.versions.values()) >= 1, "no merge within the deadline"
        comm = sync.comm
        assert isinstance(comm, ProcessComm) and comm._returns is not None
        for _ in range(5):  # each try: a heal, then no read until its first fragment fills the slot
            before = dict(comm.returned)
            sync.heal(None, "a test's heal")
            deadline = time.monotonic() + 60
            while comm._returns.filled == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(1.0)  # the other two were delivered with it (no slot free): time for the child to write them
            sync.step(tokens=32, loss=_loss(model, opt, gen))
            applied = [e for e in _events(log) if e["event"] == "apply" and e["resync"] and e["step"] == sync.step_count + 1]
            for e in applied:  # a resync overwrites: the parameters are exactly what came back
                p = e["fragment"]
                assert torch.equal(sync.local.bound[p].gather(), sync.local[p].base)
                assert torch.isfinite(sync.local[p].base).all() and sync.local[p].base.abs().sum() > 0
            if comm.returned["channel"] > before["channel"]:
                assert comm.returned["slots"] > before["slots"] and applied
                break
        assert comm.returned["channel"] > 0, f"every fragment came back through a slot: {comm.returned}"
        versions = dict(sync.versions)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(sync.versions[f] > v for f, v in versions.items()):
            sync.step(tokens=32, loss=_loss(model, opt, gen))
        assert all(sync.versions[f] > v for f, v in versions.items()), "merges go on after"
        assert sync.finish()


_PARENT = textwrap.dedent("""
    import sys, time, torch
    from torch import nn
    from ddiloco.learner.sync import DecoupledSync
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    sync = DecoupledSync(model, synchronizer=sys.argv[1], learner_id="doomed", fragments=3, sync_every=4,
                         join_timeout_s=60.0, comm="process")
    assert sync.join() == 0
    print(sync.comm.pid, flush=True)
    while True:
        time.sleep(0.05)
        sync.step(tokens=32, loss=1.0)
""")


def test_a_sigkilled_training_process_takes_its_communication_process_with_it(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(PROTOCOL)
    with synchronizer(tmp_path, "--config", str(cfg), "--quorum", "1") as target:
        parent = subprocess.Popen([sys.executable, "-c", _PARENT, target], stdout=subprocess.PIPE)
        try:
            assert parent.stdout is not None
            child = int(parent.stdout.readline())
            assert _alive(child)
            parent.kill()
            parent.wait(30)
            deadline = time.monotonic() + 30
            while _alive(child) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(child), "the communication process outlived its learner"
        finally:
            if parent.poll() is None:
                parent.kill()
                parent.wait()


def test_a_communication_process_that_dies_before_the_join_is_a_clear_error() -> None:
    sync = DecoupledSync(_mlp(), synchronizer="127.0.0.1:9", learner_id="early", fragments=3, sync_every=4,
                         join_timeout_s=60.0, comm="process")
    killed: list[int] = []

    def kill_once_started() -> None:
        deadline = time.monotonic() + 30
        while sync.comm.pid is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # joining: nothing listens at port 9, so it retries
        if sync.comm.pid is not None:
            killed.append(sync.comm.pid)
            os.kill(sync.comm.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_started)
    killer.start()
    try:
        with pytest.raises(SyncError, match=f"communication process exited with code {-signal.SIGKILL} before joining"):
            sync.join(timeout_s=30.0)
    finally:
        killer.join()
    assert killed and not _alive(killed[0])


def test_a_stopped_training_process_holds_the_communications_event_loop_until_it_runs_again(tmp_path):
    """What the communication process does on each lane's event loop when it sees its training
    process stopped (SIGSTOP): the loop (heartbeats, sends, receipts) waits until it runs again."""
    import asyncio

    from ddiloco.learner.comm_child import hold_while_stopped, stopped

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ticks: list[float] = []
    loop = asyncio.new_event_loop()

    done = threading.Event()

    async def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    runner = threading.Thread(target=loop.run_until_complete, args=(tick(),), daemon=True)
    runner.start()
    try:
        assert not stopped(other.pid)
        other.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not stopped(other.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopped(other.pid)
        loop.call_soon_threadsafe(hold_while_stopped, other.pid)
        time.sleep(0.2)
        held_from = len(ticks)
        time.sleep(0.5)
        assert len(ticks) == held_from, "the loop ran while the process was stopped"
        other.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while len(ticks) < held_from + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(ticks) >= held_from + 5, "the loop did not run again once the process did"
    finally:
        other.kill()
        other.wait()
        done.set()
        runner.join(10)
        loop.close()


def test_the_pace_and_held_versions_are_shared_as_they_change_at_most_every_share_every_s(monkeypatch):
    from types import SimpleNamespace

    from ddiloco.fragments.partition import partition_tensors
    from ddiloco.learner import comm_process
    from ddiloco.learner.events import EventLog
    from ddiloco.learner.settings import sync_config
    from ddiloco.learner.slots import SharedValues

    model = _mlp()
    cfg = sync_config(None, synchronizer="127.0.0.1:1", learner_id="a", fragments=3, comm="process")
    layout = partition_tensors(list(model.named_parameters()), 3)
    held = {0: 3, 2: 1}
    comm = ProcessComm(cfg, layout=layout, model_fingerprint="f", incarnation=1,
                       events=EventLog(None, learner_id="a", incarnation=1), held=lambda: dict(held),
                       genesis_values=dict)
    comm._shared = SharedValues.create(comm_process.STATS + 3)  # what start() makes, with no child
    clock = [100.0]
    monkeypatch.setattr(comm_process, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    def shared() -> tuple[int, list[int]]:
        values = comm._shared.read()
        return int(values[0]), [int(v) for v in values[comm_process.STATS:]]

    try:
        comm.stats.step = 1
        comm._share_state()
        assert shared() == (1, [3, -1, 1])
        comm.stats.step, held[1] = 2, 5
        clock[0] += comm_process.SHARE_EVERY_S / 2
        comm._share_state()
        assert shared() == (1, [3, -1, 1]), "written less often than SHARE_EVERY_S"
        clock[0] = 100.0 + comm_process.SHARE_EVERY_S
        comm._share_state()
        assert shared() == (2, [3, 5, 1])
        comm.stats.step, held[0] = 3, 4
        comm._share_state(force=True)  # a restart, a heartbeat asked for, the end of training
        assert shared() == (3, [4, 5, 1])
    finally:
        comm._shared.close()
