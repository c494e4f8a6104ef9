"""A local cluster: one synchronizer and N learner processes on loopback, and the faults on them.

``ddiloco run`` and the chaos tests drive this class. Processes are started with the same
commands a deployment uses and stopped by pid. With chaos on, the synchronizer listens on a fixed
port (so a restart on the same state dir is found again by the learners) and every learner talks
to it through its own ``FaultProxy``, so the network of one learner can be broken alone.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import yaml

from ddiloco.core import events as schema
from ddiloco.core.resources import available_cpus, with_huge_pages
from ddiloco.lab.chaos import ChaosDriver, FaultEvent, FaultPlan
from ddiloco.lab.event_logs import Tail
from ddiloco.lab.procs import free_port, stop_processes


def _cli() -> list[str]:
    return [sys.executable, "-m", "ddiloco.core.cli"]


def wait_ready_info(proc: subprocess.Popen[Any], ready: pathlib.Path, timeout_s: float) -> dict[str, Any]:
    """What a synchronizer started with ``--ready-file READY`` writes there once it serves (its
    ``port``, ``metrics_port``...; it writes the file atomically). Raises ``RuntimeError`` if
    ``proc`` exits first or ``timeout_s`` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"synchronizer exited with code {proc.returncode} before serving")
        if time.monotonic() > deadline:
            raise RuntimeError(f"synchronizer did not start serving within {timeout_s:g}s")
        time.sleep(0.05)
    info: dict[str, Any] = json.loads(ready.read_text())
    return info


def wait_ready(proc: subprocess.Popen[Any], ready: pathlib.Path, timeout_s: float) -> int:
    """The port of a synchronizer started with ``--ready-file READY``, once it serves
    (``wait_ready_info``)."""
    return int(wait_ready_info(proc, ready, timeout_s)["port"])


class LocalCluster:
    def __init__(self, out: pathlib.Path, cfg_path: pathlib.Path, *, learners: int, steps: int,
                 plan: FaultPlan | None = None, speeds: dict[str, float] | None = None, shards: int = 1,
                 synchronizer_args: tuple[str, ...] = ()) -> None:
        self.out, self.cfg_path = out, cfg_path
        self.n, self.steps = learners, steps
        self.shards = shards
        """Synchronizer processes: shard s owns the fragments p with p mod shards == s."""
        self.ports = [0] * shards
        self.synchronizer_args = synchronizer_args
        """Passed to every synchronizer process as well (``bench memory`` runs one shard of several)."""
        self.plan = plan
        self.speeds = speeds or {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.index: dict[str, int] = {}
        self.proxies: dict[str, Any] = {}
        self.threads = max(1, available_cpus() // learners)
        self.pending_restarts = 0
        self.lock = threading.Lock()
        self.driver: ChaosDriver | None = None
        self._tail_lock = threading.Lock()
        self._tails: dict[str, Tail] = {}
        self._step_span: dict[str, dict[int, tuple[int, int]]] = {}
        """Per learner, per incarnation: (first step, last step) it ran (steps are the fleet's,
        so a learner that joined late starts past 1)."""
        doc = yaml.safe_load(cfg_path.read_text()) or {}
        self.resume_from_fleet = ((doc.get("train") or {}).get("resume", "fleet") == "fleet")
        """A learner started late goes on from the fleet's step to ``steps`` (train.resume)."""
        (out / "learners").mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)

    # -- processes ------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        env = with_huge_pages(dict(os.environ, DDILOCO_LOG_JSON="1", PYTHONUNBUFFERED="1"))
        with open(self.out / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)
        self.procs[name] = proc
        return proc

    def synchronizer_name(self, shard: int) -> str:
        """The process name of ``shard`` (``synchronizer`` when there is one)."""
        return "synchronizer" if self.shards == 1 else f"synchronizer-{shard}"

    def synchronizer_names(self) -> list[str]:
        return [self.synchronizer_name(s) for s in range(self.shards)]

    def merge_logs(self) -> list[pathlib.Path]:
        """Every shard's merge log (``synchronizer.jsonl``, or ``synchronizer-s.jsonl`` per shard)."""
        return [self.out / f"{name}.jsonl" for name in self.synchronizer_names()]

    def state_dirs(self) -> list[pathlib.Path]:
        return [self.out / ("state" if self.shards == 1 else f"state-{s}") for s in range(self.shards)]

    def start_synchronizer(self, shard: int | None = None) -> None:
        """Start every shard (``shard`` None) or one; a restarted shard listens on its old port."""
        for s in range(self.shards) if shard is None else [shard]:
            name = self.synchronizer_name(s)
            ready = self.out / f"{name}.ready.json"
            ready.unlink(missing_ok=True)
            if (self.plan is not None or self.shards > 1) and not self.ports[s]:
                self.ports[s] = free_port()
            sharding = ["--shard", f"{s}/{self.shards}"] if self.shards > 1 else []
            proc = self._spawn(name, [
                *_cli(), "synchronizer", "--listen", f"127.0.0.1:{self.ports[s]}", "--state-dir", str(self.state_dirs()[s]),
                "--config", str(self.cfg_path), "--event-log", str(self.merge_logs()[s]), "--ready-file", str(ready),
                *sharding, *self.synchronizer_args])
            self.ports[s] = wait_ready(proc, ready, timeout_s=120)

    @property
    def target(self) -> str:
        """The synchronizer's address; with shards, every shard's, comma-separated in shard order."""
        return ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def learner_target(self, lid: str) -> str:
        if self.plan is None:
            return self.target
        from ddiloco.lab.fault_proxy import FaultProxy

        ports = []
        for s, port in enumerate(self.ports):
            key = lid if s == 0 else f"{lid}@{s}"
            proxy = self.proxies.get(key)
            if proxy is None:
                proxy = self.proxies[key] = FaultProxy("127.0.0.1", port)
                proxy.start()
            ports.append(proxy.port)
        return ",".join(f"127.0.0.1:{port}" for port in ports)

    def start_learner(self, lid: str, steps: int | None = None, *, initial: bool = False) -> None:
        """``initial``: one of the run's first learners, started together: each runs every step
        from 1 (the run is compared with others at equal tokens), however late its process joins."""
        i = self.index.setdefault(lid, len(self.index))
        shards = max(self.n, len(self.index))
        self._spawn(lid, [*_cli(), "learner", "--synchronizer", self.learner_target(lid), "--learner-id", lid,
                          "--config", str(self.cfg_path), "--shard", str(i % shards), "--num-shards", str(shards),
                          "--threads", str(self.threads), "--steps", str(steps or self.steps),
                          *(["--resume", "none"] if initial else []),
                          "--event-log", str(self.out / "learners" / f"{lid}.jsonl"),
                          *(["--speed", str(self.speeds[lid])] if lid in self.speeds else [])])

    def learners(self) -> list[str]:
        return [name for name in self.procs if not name.startswith("synchronizer")]

    def alive_learners(self) -> list[str]:
        return [lid for lid in self.learners() if self.procs[lid].poll() is None]

    def _spans(self, lid: str) -> dict[int, tuple[int, int]]:
        with self._tail_lock:
            tail = self._tails.setdefault(lid, Tail(self.out / "learners" / f"{lid}.jsonl"))
            spans = self._step_span.setdefault(lid, {})
            for e in tail.read():
                if e.get("event") == schema.STEP:
                    first, _ = spans.get(e["incarnation"], (e["step"], e["step"]))
                    spans[e["incarnation"]] = (first, e["step"])
            return dict(spans)

    def steps_done(self, lid: str) -> int:
        """Steps ``lid`` completed over all its incarnations (read on from its event log)."""
        return sum(last - first + 1 for first, last in self._spans(lid).values())

    def _progress(self, lid: str) -> int:
        """The step ``lid`` reached (a learner that joined late counts from the fleet's step it
        started at); "" : the most advanced learner's."""
        if lid:
            return max((last for _, last in self._spans(lid).values()), default=0)
        return max((self._progress(other) for other in self.learners()), default=0)

    def finished(self) -> bool:
        with self.lock:
            return not self.alive_learners() and self.pending_restarts == 0

    def stop_all(self, timeout_s: float = 20.0) -> None:
        if self.driver is not None:
            self.driver.stop()
        stop_processes(self.procs.values(), timeout_s)
        for proxy in self.proxies.values():
            proxy.stop()

    # -- faults ---------------------------------------------------------------------------

    def start_chaos(self) -> None:
        assert self.plan is not None
        log_path = self.out / "faults.jsonl"

        def log(record: dict[str, Any]) -> None:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

        self.driver = ChaosDriver(self.plan, {
            "kill": self._kill, "stop": self._stop, "kill_synchronizer": self._kill_synchronizer,
            "wipe_synchronizer": self._wipe_synchronizer,
            "net": self._net, "scale_up": self._scale_up, "drain": self._drain, "nan": self._nan,
            "corrupt": self._corrupt, "inflate": self._inflate,
            "overclaim": self._overclaim}, log, progress=self._progress)
        self.driver.start()

    def _proc(self, lid: str) -> subprocess.Popen[bytes]:
        proc = self.procs.get(lid)
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{lid} is not running")
        return proc

    def _restart_later(self, delay_s: float, fn: Any) -> None:
        assert self.driver is not None
        with self.lock:
            self.pending_restarts += 1

        def run() -> None:
            try:
                fn()
            finally:
                with self.lock:
                    self.pending_restarts -= 1

        self.driver.later(delay_s, run)

    def _kill(self, e: FaultEvent) -> None:
        proc = self._proc(e.target)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if e.restart_after_s is None:
            return
        remaining = self.steps - self.steps_done(e.target)
        if remaining <= 0:
            return
        new = f"learner-{len(self.index)}" if e.new_id else e.target
        # resuming from the fleet, it goes on from the fleet's step to the run's end; else it runs
        # the steps it had left from step 1
        steps = self.steps if self.resume_from_fleet else remaining
        self._restart_later(e.restart_after_s, lambda: self.start_learner(new, steps))

    def _stop(self, e: FaultEvent) -> None:
        proc = self._proc(e.target)
        proc.send_signal(signal.SIGSTOP)
        assert self.driver is not None

        def resume() -> None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)

        self.driver.later(e.duration_s, resume)

    def _wipe_synchronizer(self, e: FaultEvent) -> None:
        """``_kill_synchronizer`` with the state dir deleted before the restart."""
        self._kill_synchronizer(e, wipe=True)

    def _kill_synchronizer(self, e: FaultEvent, *, wipe: bool = False) -> None:
        """Every shard (no target), or the one named (``synchronizer-s``); ``wipe``: its state dir is
        deleted once it is dead, so it restarts without state."""
        names = self.synchronizer_names()
        if e.target and e.target not in names:
            raise RuntimeError(f"{e.kind} target {e.target!r} is none of this run's {', '.join(names)}")
        for s, name in enumerate(names):
            if e.target and e.target != name:
                continue
            proc = self._proc(name)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            if wipe:
                shutil.rmtree(self.state_dirs()[s], ignore_errors=True)
            with open(self.merge_logs()[s], "a") as f:
                # no leading newline: a line the killed process left half-written is recovered by the reader
                f.write(json.dumps(schema.record(schema.SYNCHRONIZER_LOG, schema.SYNC_STOP, {}, t=time.time())) + "\n")
            self._restart_later(e.restart_after_s if e.restart_after_s is not None else 1.0,
                                lambda s=s: self.start_synchronizer(s))

    def _net(self, e: FaultEvent) -> None:
        proxies = [p for key, p in self.proxies.items() if key == e.target or key.startswith(f"{e.target}@")]
        for proxy in proxies:  # every shard's link of the learner
            self._net_one(proxy, e)

    def _net_one(self, proxy: Any, e: FaultEvent) -> None:
        if e.net == "reset":
            proxy.reset()
            return
        if e.net == "latency":
            proxy.set_latency(e.value)
        elif e.net == "bandwidth":
            proxy.set_bandwidth(e.value)
        elif e.net == "stall":
            proxy.stall(e.duration_s)
            return
        elif e.net == "blackhole":
            proxy.blackhole(True)
            assert self.driver is not None

            def heal() -> None:
                # Bytes dropped in the hole leave those connections unusable; once the hole closes,
                # cut them so both ends notice now rather than at the next keepalive timeout.
                proxy.clear()
                proxy.reset()

            self.driver.later(e.duration_s, heal)
            return
        assert self.driver is not None
        self.driver.later(e.duration_s, proxy.clear)

    def _scale_up(self, e: FaultEvent) -> None:
        self.start_learner(f"learner-{len(self.index)}")

    def _nan(self, e: FaultEvent) -> None:
        self._proc(e.target).send_signal(signal.SIGUSR1)  # the learner's parameters turn NaN

    def _corrupt(self, e: FaultEvent) -> None:
        self._proc(e.target).send_signal(signal.SIGUSR2)  # its outer gradients turn hostile

    def _inflate(self, e: FaultEvent) -> None:
        self._proc(e.target).send_signal(signal.SIGRTMIN)  # its answers claim more tokens than it trained

    def _overclaim(self, e: FaultEvent) -> None:
        self._proc(e.target).send_signal(signal.SIGRTMIN + 1)  # it claims far more work, with a larger update

    def _drain(self, e: FaultEvent) -> None:
        self._proc(e.target).send_signal(signal.SIGTERM)
