"""A shard that lost its state, in a real sharded fleet: ``ddiloco synchronizer --shard s/2``
processes on loopback and ``DecoupledSync`` learners with one stream per shard.

Shard 1's state dir is wiped and the shard restarted while learner ``a`` trains on; a newcomer
``b`` (another seed) joins. The newcomer must not seed shard 1 with its initialization (which
every learner would then be told to resync to, silently): shard 1 says why it waits, ``a`` (which
holds shard 1's fragments) seeds it again from its globals at their versions, the newcomer joins
the trained model and the run goes on. With no trained learner left, the shard waits until the
operator re-seeds it (``--reseed``). The chaos kind ``wipe_synchronizer`` does the same to a
``ddiloco run``. Every wait has a deadline or a bound in steps; every process is stopped by its pid.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import torch
from torch import nn

from ddiloco.lab.chaos import FaultPlan
from ddiloco.lab.fault_proxy import FaultProxy
from ddiloco.lab.procs import free_port
from ddiloco.learner.sync import DecoupledSync
from ddiloco.synchronizer.recovery import read_fleet
from tests.learner.test_sharded_sync import _step
from tests.procs import stop, synchronizer

PROTOCOL = "protocol: {num_fragments: 4, sync_every: 4, mode: decoupled, global_codec: fp32}\n"
OWNED = {0: {0, 2}, 1: {1, 3}}
MAX_STEPS = 600
WAIT = "waiting for a re-seed: this learner cannot seed the lost state"


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _lines(path: pathlib.Path) -> list[dict]:
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        with contextlib.suppress(json.JSONDecodeError):
            doc = json.loads(line)
            if isinstance(doc, dict):
                out.append(doc)
    return out


def _two_shards(tmp_path: pathlib.Path, stack: contextlib.ExitStack, started: list[subprocess.Popen[bytes]]
                ) -> tuple[pathlib.Path, list[int], tuple[str, str]]:
    """Shards 0 and 1 of a fleet, as processes (stopped when ``stack`` closes): the config file,
    their ports and their addresses."""
    config = tmp_path / "config.yaml"
    config.write_text(PROTOCOL)
    ports = [free_port(), free_port()]
    addresses = tuple(stack.enter_context(_shard(tmp_path, s, config, ports[s], tmp_path / f"shard-{s}.log",
                                                 started=started)) for s in (0, 1))
    return config, ports, (addresses[0], addresses[1])


def _told_to_wait(log: pathlib.Path, learner_id: str) -> bool:
    return any(e.get("event") == WAIT and e.get("learner_id") == learner_id for e in _lines(log))


class _Learner:
    """A learner on both shards: its model, optimizer and sync; ``train`` steps it."""

    def __init__(self, learner_id: str, seed: int, targets: str, log: pathlib.Path, **settings: Any) -> None:
        self.model = _mlp(seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.sync = DecoupledSync(self.model, optimizer=self.opt, synchronizer=targets, learner_id=learner_id,
                                  fragments=4, sync_every=4, event_log=str(log), steps=MAX_STEPS * 4,
                                  join_timeout_s=180.0, **settings)
        self.log = log
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        self.sync.step(tokens=32, loss=_step(self.model, self.opt, self.gen))

    def fragment(self, p: int) -> torch.Tensor:
        return self.sync.local.bound[p].gather()


class _Joining(threading.Thread):
    """``sync.join()`` on a thread of its own, so the test can go on while the learner waits."""

    def __init__(self, learner: _Learner) -> None:
        super().__init__(name="joining", daemon=True)
        self.learner, self.result, self.error = learner, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.learner.sync.join()
        except Exception as exc:  # reported by the test
            self.error = exc


def _shard(tmp_path: pathlib.Path, s: int, config: pathlib.Path, port: int, log: pathlib.Path, *extra: str,
           started: list[subprocess.Popen[bytes]]) -> contextlib.AbstractContextManager[str]:
    return synchronizer(tmp_path, "--config", str(config), "--quorum", "1", "--shard", f"{s}/2",
                        "--state-dir", str(tmp_path / f"state-{s}"), "--listen", f"127.0.0.1:{port}",
                        "--event-log", str(tmp_path / f"sync-{s}.jsonl"), *extra, log=log, started=started)


def test_a_wiped_shard_is_reseeded_by_the_trained_learner_not_by_a_newcomer(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(PROTOCOL)
    ports = [free_port(), free_port()]
    started: list[subprocess.Popen[bytes]] = []
    # Learner a reaches shard 1 through a proxy: pointed at a closed port, it keeps a away from the
    # restarted shard until the test lets it through, so the newcomer deterministically comes first.
    proxy = FaultProxy("127.0.0.1", ports[1])
    proxy.start()
    with contextlib.ExitStack() as stack:
        stack.callback(proxy.stop)
        first = stack.enter_context(_shard(tmp_path, 0, config, ports[0], tmp_path / "shard-0.log", started=started))
        stack.enter_context(_shard(tmp_path, 1, config, ports[1], tmp_path / "shard-1.log", started=started))
        a = _Learner("a", 0, f"{first},127.0.0.1:{proxy.port}", tmp_path / "a.jsonl")
        stack.callback(a.sync.close, "failed", flush_timeout_s=5.0)
        assert a.sync.join() == 0
        while a.steps < MAX_STEPS and min(a.sync.versions[p] for p in OWNED[1]) < 2:
            a.step()
        trained = {p: a.sync.versions[p] for p in range(4)}
        assert min(trained[p] for p in OWNED[1]) >= 2, f"shard 1 never merged twice: {trained}"
        fleet_id = read_fleet(tmp_path / "state-0")["fleet_id"]
        assert read_fleet(tmp_path / "state-1")["fleet_id"] == fleet_id

        # Shard 1 loses its state dir and is restarted on it, empty, at another port.
        stop(started[1])
        shutil.rmtree(tmp_path / "state-1")
        wiped_at = a.steps
        proxy.set_target("127.0.0.1", free_port())  # nothing listens there: a cannot reach shard 1
        port = free_port()
        restarted_log = tmp_path / "shard-1-restarted.log"
        second = stack.enter_context(_shard(tmp_path, 1, config, port, restarted_log, started=started))

        # The newcomer, with another initialization, joins while a trains on.
        b = _Learner("b", 1, f"{first},{second}", tmp_path / "b.jsonl")
        stack.callback(b.sync.close, "failed", flush_timeout_s=5.0)
        own = {p: b.fragment(p) for p in OWNED[1]}
        joining = _Joining(b)
        while a.steps < wiped_at + MAX_STEPS and not _told_to_wait(restarted_log, "b") and joining.is_alive():
            a.step()
        assert joining.is_alive(), f"the newcomer joined a shard that lost its state: {joining.result, joining.error}"
        assert _told_to_wait(restarted_log, "b"), "shard 1 says why the newcomer waits"
        wait = next(e for e in _lines(restarted_log) if e.get("event") == WAIT)
        assert wait["fleet_id"] == fleet_id and "--reseed" in wait["detail"], wait
        assert not (tmp_path / "state-1" / "meta.json").exists()

        # Now a reaches the empty shard: it holds its fragments, so it seeds them again.
        proxy.set_target("127.0.0.1", port)
        reseeded: dict[int, int] = {}
        while a.steps < wiped_at + 2 * MAX_STEPS:
            a.step()
            fleet = read_fleet(tmp_path / "state-1") if (tmp_path / "state-1" / "meta.json").exists() else None
            if fleet is not None:
                reseeded = {int(p): v for p, v in fleet["versions"].items()}
            if (reseeded and not joining.is_alive()
                    and all(a.sync.versions[p] > reseeded[p] for p in OWNED[1])):
                break
        joining.join(timeout=60)
        assert not joining.is_alive() and joining.error is None and joining.result is not None, joining.error
        fleet = read_fleet(tmp_path / "state-1")
        assert (fleet["fleet_id"], fleet["how"], fleet["seeded_by"]) == (fleet_id, "reseed", "a"), fleet
        assert all(reseeded[p] >= trained[p] for p in OWNED[1]), f"versions went back: {trained} -> {reseeded}"
        assert all(a.sync.versions[p] > reseeded[p] for p in OWNED[1]), "shard 1 merges again: the run goes on"
        # The trained fragments were never replaced: a applied no version older than it held.
        applied = [e for e in _lines(a.log) if e.get("event") == "apply" and e["fragment"] in OWNED[1]
                   and e["step"] > wiped_at]
        assert all(e["version"] >= trained[e["fragment"]] for e in applied), [
            e for e in applied if e["version"] < trained[e["fragment"]]]
        # The newcomer holds the fleet's trained fragments, not its own initialization.
        for p in OWNED[1]:
            assert b.sync.versions[p] >= trained[p]
            assert not torch.allclose(b.fragment(p), own[p]), f"fragment {p} is the newcomer's initialization"
        assert b.sync.close()
        assert a.sync.finish(flush_timeout_s=60.0)


def test_a_wiped_shard_with_no_trained_learner_left_waits_for_the_operators_reseed(tmp_path):
    started: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        config, ports, (first, second) = _two_shards(tmp_path, stack, started)
        a = _Learner("a", 0, f"{first},{second}", tmp_path / "a.jsonl")
        assert a.sync.join() == 0
        while a.steps < MAX_STEPS and min(a.sync.versions.values()) < 1:
            a.step()
        trained = dict(a.sync.versions)
        assert min(trained.values()) >= 1, trained
        assert a.sync.finish(flush_timeout_s=60.0)  # the fleet's only trained learner is gone
        fleet_id = read_fleet(tmp_path / "state-0")["fleet_id"]

        stop(started[1])
        shutil.rmtree(tmp_path / "state-1")
        stack.enter_context(_shard(tmp_path, 1, config, ports[1], tmp_path / "shard-1-wiped.log", started=started))
        b = _Learner("b", 1, f"{first},{second}", tmp_path / "b.jsonl")
        stack.callback(b.sync.close, "failed", flush_timeout_s=5.0)
        joining = _Joining(b)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not _told_to_wait(tmp_path / "shard-1-wiped.log", "b"):
            time.sleep(0.1)
        assert _told_to_wait(tmp_path / "shard-1-wiped.log", "b")
        assert joining.is_alive() and not (tmp_path / "state-1" / "meta.json").exists()

        # The operator re-seeds it: restarted with --reseed, the next learner seeds it.
        stop(started[2])
        stack.enter_context(_shard(tmp_path, 1, config, ports[1], tmp_path / "shard-1-reseed.log", "--reseed",
                                   started=started))
        joining.join(timeout=120)
        assert not joining.is_alive() and joining.error is None and joining.result is not None, joining.error
        deadline = time.monotonic() + 30  # the upload is sent; its commit follows
        while time.monotonic() < deadline and not (tmp_path / "state-1" / "meta.json").exists():
            time.sleep(0.05)
        fleet = read_fleet(tmp_path / "state-1")
        assert fleet is not None, "the operator's re-seed was not committed"
        assert (fleet["fleet_id"], fleet["how"], fleet["seeded_by"]) == (fleet_id, "operator", "b"), fleet
        events = [e.get("event") for e in _lines(tmp_path / "shard-1-reseed.log")]
        assert any(str(e).startswith("operator re-seed allowed") for e in events), events
        assert "lost state re-seeded" in events
        assert {p: b.sync.versions[p] for p in OWNED[1]} == {1: 0, 3: 0}, "the operator's re-seed starts over"
        assert all(b.sync.versions[p] >= trained[p] for p in OWNED[0]), "shard 0's trained fragments are kept"
        while b.steps < MAX_STEPS and min(b.sync.versions[p] for p in OWNED[1]) < 1:
            b.step()
        assert min(b.sync.versions[p] for p in OWNED[1]) >= 1, "shard 1 merges again after the re-seed"
        assert b.sync.finish(flush_timeout_s=60.0)


def test_a_learner_with_its_communication_in_a_process_reseeds_from_its_parameters(tmp_path):
    """``learner.comm: process`` keeps no globals: a learner that joined by fetching (so its
    communication process never read the genesis values) re-seeds the wiped shard from its current
    parameters at the versions it holds."""
    started: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        config, ports, (first, second) = _two_shards(tmp_path, stack, started)
        seed = _Learner("seed", 0, f"{first},{second}", tmp_path / "seed.jsonl")
        assert seed.sync.join() == 0
        assert seed.sync.close()  # seeded the fleet and left
        c = _Learner("c", 2, f"{first},{second}", tmp_path / "c.jsonl", comm="process")
        stack.callback(c.sync.close, "failed", flush_timeout_s=5.0)
        assert c.sync.join() is not None
        while c.steps < MAX_STEPS and min(c.sync.versions[p] for p in OWNED[1]) < 1:
            c.step()
        assert min(c.sync.versions[p] for p in OWNED[1]) >= 1, c.sync.versions
        fleet_id = read_fleet(tmp_path / "state-0")["fleet_id"]

        stop(started[1])
        shutil.rmtree(tmp_path / "state-1")
        wiped_at, held = c.steps, {p: c.sync.versions[p] for p in OWNED[1]}
        stack.enter_context(_shard(tmp_path, 1, config, ports[1], tmp_path / "shard-1-wiped.log", started=started))
        while c.steps < wiped_at + MAX_STEPS and not (
                (tmp_path / "state-1" / "meta.json").exists()
                and all(c.sync.versions[p] > held[p] for p in OWNED[1])):
            c.step()
        fleet = read_fleet(tmp_path / "state-1")
        assert (fleet["fleet_id"], fleet["how"], fleet["seeded_by"]) == (fleet_id, "reseed", "c"), fleet
        assert all(fleet["versions"][str(p)] >= held[p] for p in OWNED[1]), (fleet, held)
        assert all(c.sync.versions[p] > held[p] for p in OWNED[1]), "shard 1 merges again: the run goes on"
        assert c.sync.finish(flush_timeout_s=60.0)


def test_the_wipe_synchronizer_chaos_kind(tmp_path):
    """``ddiloco run --shards 2`` with shard 1 killed and its state dir deleted (chaos kind
    ``wipe_synchronizer``): the learners holding its fragments re-seed it, its versions go on, and
    it merges again; training never stops and no contribution is lost track of. A version the
    killed shard committed that no learner had received yet is lost with its state dir, so the
    re-seeded shard may commit that number again: the merge log's versions are monotonic except
    for the wiped shard's fragments, and there by at most a version or two."""
    from tests.lab.test_chaos import STEP_S, TINY
    from tests.procs import run_tree

    down_s = 3.0
    steps = 100 + int((down_s + 15.0) / STEP_S)
    plan = FaultPlan().wipe_synchronizer(at_step=100, restart_after_s=down_s, shard=1)
    (tmp_path / "cfg.yaml").write_text(TINY)
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))
    run = tmp_path / "run"
    proc = run_tree([sys.executable, "-m", "ddiloco.core.cli", "run", "--config", str(tmp_path / "cfg.yaml"),
                     "--out", str(run), "--no-progress", "--learners", "2", "--steps", str(steps),
                     "--chaos", str(tmp_path / "plan.json"), "--shards", "2"],
                    capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert [f["ok"] for f in s["faults_injected"]] == [True], s["faults_injected"]
    inv = s["invariants"]
    assert inv["unaccounted_contributions"] == 0, s["contributions"]["totals"]
    assert inv["zero_global_downtime"], inv["global_downtime_s"]
    for problem in inv["version_problems"]:  # "fragment P: version V after W"
        fragment, version, after = (int(x) for x in re.findall(r"\d+", problem))
        assert fragment in OWNED[1] and after - version <= 2, inv["version_problems"]
    assert s["merges"] > 0 and s["final_eval_loss"] < 4.0
    fleet = read_fleet(run / "state-1")
    assert fleet["how"] == "reseed" and fleet["fleet_id"] == read_fleet(run / "state-0")["fleet_id"], fleet
    assert min(fleet["versions"].values()) >= 1, "re-seeded at the versions the learners held, not from 0"
    (again,) = s["shards"][1]["restart_to_first_merge_s"]
    assert again is not None and again < 60, s["shards"]
