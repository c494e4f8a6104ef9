"""``ddiloco bench torchft``: ddiloco beside torchft's DiLoCo (torchft 0.2.0, CPU, gloo), two
replicas / learners, the same built-in GPT and the same fragment schedule, measured in one run.

Three measurements, each for both systems:

- ``overhead``: seconds per inner step with fragment syncs and without, same model and loop, same
  process. torchft: two replica processes (one group of one rank each, ``ProcessGroupGloo``, a
  ``Manager`` with a synchronous quorum, ``torchft.local_sgd.DiLoCo`` with one fragment per
  ddiloco fragment, so ``sync_every`` H, ``num_fragments`` P and ``fragment_sync_delay`` tau mean
  what ddiloco's ``protocol`` means) beside a ``torchft_lighthouse``; off and on phases
  alternate in the same processes. ddiloco: two ``ddiloco bench learner`` processes at once (one
  torch thread each, each with its own synchronizer process), whose own off/on measure is used
  as it is.
- ``restart``: SIGKILL one replica / learner once the job is syncing, start it again at once;
  seconds from the kill to its next successful contribution (torchft: its first committed outer
  sync with both replicas in the quorum; ddiloco: the restarted learner's first merged
  contribution), and how long the survivor's inner steps stalled meanwhile (the longest gap
  between two of its steps, less its median step). ddiloco runs as ``ddiloco run`` with a chaos
  plan (``kill`` with ``restart_after_s: 0``).
- ``outage``: SIGKILL the coordinator (torchft's lighthouse; ddiloco's synchronizer), start it
  again on the same address after ``--outage-s``; whether replicas stall (the longest gap between
  two inner steps of each), whether the job dies (a replica exits with an error before the
  end) and how long after the kill, and when syncs succeed again.

Ratios are torchft / ddiloco. torchft is imported only in the replica processes
(``ddiloco.lab.bench.torchft_replica``), never by this module; it is an optional extra
(``pip install 'ddiloco-lab[peers]'``), never a dependency of ddiloco.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import itertools
import json
import os
import pathlib
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ddiloco.core import events as schema
from ddiloco.lab.bench import save_result
from ddiloco.lab.event_logs import load_jsonl
from ddiloco.lab.procs import exit_on_sigterm, free_port, stop_processes

PEERS_HINT = ("torchft is not installed; install the benchmark extra: pip install -e 'lab[peers]' in a checkout "
              "(or pip install torchft==0.2.0)")
TORCHFT_VERSION = "0.2.0"
SCENARIOS = ("overhead", "restart", "outage")
LIGHTHOUSE = "torchft_lighthouse"


class BenchError(RuntimeError):
    """A measurement that could not be made (printed, exit code 1)."""


def require_torchft() -> Any:
    """The ``torchft`` module, or ``BenchError(PEERS_HINT)`` when it cannot be imported."""
    try:
        import torchft
    except ImportError as exc:
        raise BenchError(PEERS_HINT) from exc
    return torchft


def _torchft_version() -> str:
    """The installed torchft's version (warned about when it is not the one measured here)."""
    version = importlib.metadata.version("torchft")
    if version != TORCHFT_VERSION:
        print(f"ddiloco bench torchft: torchft {version} is installed; these measurements were made with "
              f"{TORCHFT_VERSION}", file=sys.stderr)
    return version


def lighthouse_binary() -> str:
    """The ``torchft_lighthouse`` executable beside this interpreter, else on PATH."""
    here = pathlib.Path(sys.executable).parent / LIGHTHOUSE
    found = str(here) if here.exists() else shutil.which(LIGHTHOUSE)
    if not found:
        raise BenchError(f"{LIGHTHOUSE} not found; {PEERS_HINT}")
    return found


# -- results ------------------------------------------------------------------------------------

def overhead(off_s_per_step: float, on_s_per_step: float) -> dict[str, float]:
    """Seconds per step without and with sync, and the overhead (on / off - 1)."""
    if off_s_per_step <= 0 or on_s_per_step <= 0:
        raise ValueError("seconds per step must be > 0")
    return {"off_s_per_step": off_s_per_step, "on_s_per_step": on_s_per_step,
            "sync_s_per_step": on_s_per_step - off_s_per_step, "overhead": on_s_per_step / off_s_per_step - 1.0}


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None where either is missing or ``b`` is not positive (a figure lost in the noise,
    such as an overhead measured below zero, has no meaningful ratio)."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


RATIO_KEYS = {
    "overhead": ("overhead", "sync_s_per_step"),
    "restart": ("kill_to_contribution_s", "ready_to_contribution_s", "survivor_stall_s"),
    "outage": ("max_stall_s",),
}


def ratios(torchft: dict[str, dict[str, Any]], ddiloco: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """torchft / ddiloco for each measured figure both sides have (``scenario.key``)."""
    out: dict[str, float | None] = {}
    for scenario, keys in RATIO_KEYS.items():
        for key in keys:
            a = (torchft.get(scenario) or {}).get(key)
            b = (ddiloco.get(scenario) or {}).get(key)
            if a is not None or b is not None:
                out[f"{scenario}.{key}"] = ratio(a, b)
    return out


def step_gaps(times: Sequence[float], start: float = float("-inf"), end: float = float("inf")) -> dict[str, float]:
    """The longest gap between consecutive step times whose later end lies in [start, end], and
    the median gap over all of them (a step's usual length)."""
    gaps = [(b - a, b) for a, b in itertools.pairwise(times)]
    inside = [g for g, b in gaps if start <= b <= end]
    median = statistics.median(g for g, _ in gaps) if gaps else 0.0
    longest = max(inside, default=0.0)
    return {"max_gap_s": longest, "median_gap_s": median, "stall_s": max(0.0, longest - median)}


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.3g}{unit}"
    return f"{x}{unit}"


def table(result: dict[str, Any]) -> list[str]:
    """Rows: figure, torchft, ddiloco, torchft / ddiloco."""
    t, d, r = result.get("torchft", {}), result.get("ddiloco", {}), result.get("ratios", {})
    rows = [("overhead", "off_s_per_step", "s"), ("overhead", "on_s_per_step", "s"),
            ("overhead", "sync_s_per_step", "s"), ("overhead", "overhead", ""),
            ("restart", "kill_to_contribution_s", "s"), ("restart", "kill_to_ready_s", "s"),
            ("restart", "ready_to_contribution_s", "s"), ("restart", "survivor_stall_s", "s"),
            ("outage", "max_stall_s", "s"), ("outage", "job_died", ""), ("outage", "died_after_s", "s"),
            ("outage", "synced_again_after_restart_s", "s")]
    lines = [f"{'figure':<40} {'torchft':>10} {'ddiloco':>10} {'ratio':>8}"]
    for scenario, key, unit in rows:
        if scenario not in t and scenario not in d:
            continue
        a, b = (t.get(scenario) or {}).get(key), (d.get(scenario) or {}).get(key)
        lines.append(f"{scenario + '.' + key:<40} {_fmt(a, unit):>10} {_fmt(b, unit):>10} "
                     f"{_fmt(r.get(scenario + '.' + key)):>8}")
    return lines


# -- processes ----------------------------------------------------------------------------------

def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s, contextlib.suppress(OSError):
            s.settimeout(0.5)
            s.connect(("127.0.0.1", port))
            return
        time.sleep(0.05)
    raise BenchError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:.0f} s")


class Procs:
    """Processes this benchmark started, by name; every one is stopped by pid in ``stop_all``."""

    def __init__(self, work: pathlib.Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started: dict[str, float] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.work / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env or dict(os.environ),
                                    cwd=self.work)
        self.procs[name], self.started[name] = proc, time.time()
        return proc

    def kill(self, name: str) -> float:
        """SIGKILL ``name`` and reap it; returns when it was killed (wall clock)."""
        proc = self.procs[name]
        t = time.time()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        return t

    def stop_all(self, grace_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``: long enough for a ``ddiloco run`` or ``bench
        learner`` child to stop its own synchronizer and learners (it waits 20 s for them)."""
        stop_processes(self.procs.values(), grace_s)


def replica_events(path: pathlib.Path) -> list[dict[str, Any]]:
    """A replica's events written so far (``load_jsonl``'s rule; none before the replica created
    the file)."""
    return load_jsonl(path, missing_ok=True)


# -- torchft side -------------------------------------------------------------------------------

class TorchftJob:
    """A lighthouse and two replica processes on 127.0.0.1, their events in ``work``."""

    def __init__(self, args: argparse.Namespace, work: pathlib.Path, mode: str) -> None:
        self.args, self.work, self.mode = args, work, mode
        self.procs = Procs(work)
        self.port = free_port()
        self.go = work / "go"
        self.stop_file = work / "stop"
        self.incarnation: dict[int, int] = {}

    def start_lighthouse(self) -> None:
        self.procs.start("lighthouse", [lighthouse_binary(), "--min_replicas", "1",
                                        "--bind", f"127.0.0.1:{self.port}"])
        _wait_port(self.port, 30)

    def events_path(self, replica: int) -> pathlib.Path:
        return self.work / f"replica-{replica}.{self.incarnation.get(replica, 0)}.jsonl"

    def start_replica(self, replica: int) -> None:
        a = self.args
        self.incarnation[replica] = self.incarnation.get(replica, -1) + 1
        env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{self.port}", MASTER_ADDR="127.0.0.1",
                   PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        argv = [sys.executable, "-m", "ddiloco.lab.bench.torchft_replica", "--mode", self.mode,
                "--replica-id", str(replica), "--events", str(self.events_path(replica)), "--go", str(self.go),
                "--stop", str(self.stop_file), "--d-model", str(a.d_model), "--n-layer", str(a.n_layer),
                "--n-head", str(a.n_head), "--context", str(a.context), "--batch-size", str(a.batch_size),
                "--fragments", str(a.fragments), "--sync-every", str(a.sync_every), "--overlap", str(a.overlap),
                "--steps", str(a.steps), "--warmup", str(a.warmup), "--repeats", str(a.repeats),
                "--max-s", str(a.max_s), "--parent", str(os.getpid())]
        self.procs.start(f"replica-{replica}.{self.incarnation[replica]}", argv, env)

    def proc(self, replica: int) -> subprocess.Popen[bytes]:
        return self.procs.procs[f"replica-{replica}.{self.incarnation[replica]}"]

    def wait_for(self, what: str, pred: Any, timeout_s: float) -> None:
        """Poll ``pred()`` every 50 ms until true; BenchError after ``timeout_s``, or at once when
        the lighthouse or a replica has exited (nothing can then come true)."""
        deadline = time.monotonic() + timeout_s
        lighthouse = self.procs.procs.get("lighthouse")
        while not pred():
            if time.monotonic() > deadline:
                raise BenchError(f"torchft: timed out waiting for {what} (logs in {self.work})")
            if lighthouse is not None and lighthouse.poll() is not None:
                raise BenchError(f"torchft: the lighthouse exited (code {lighthouse.returncode}) while waiting "
                                 f"for {what} (logs in {self.work})")
            for r in self.incarnation:
                code = self.proc(r).poll()
                if code is not None:
                    raise BenchError(f"torchft: replica {r} exited (code {code}) while waiting for {what} "
                                     f"(its log: {self.work / f'replica-{r}.{self.incarnation[r]}.log'})")
            time.sleep(0.05)

    def commits(self, replica: int, incarnation: int | None = None, participants: int = 2) -> list[dict[str, Any]]:
        inc = self.incarnation[replica] if incarnation is None else incarnation
        return [e for e in replica_events(self.work / f"replica-{replica}.{inc}.jsonl")
                if e.get("event") == schema.SYNC and e.get("ok") and e.get("participants", 0) >= participants]

    def step_times(self, replica: int, incarnation: int | None = None) -> list[float]:
        inc = self.incarnation[replica] if incarnation is None else incarnation
        return [e["t"] for e in replica_events(self.work / f"replica-{replica}.{inc}.jsonl")
                if e.get("event") == schema.STEP]

    def ready(self, replica: int) -> bool:
        return any(e.get("event") == schema.READY for e in replica_events(self.events_path(replica)))

    def launch(self) -> None:
        self.start_lighthouse()
        for r in (0, 1):
            self.start_replica(r)
        self.wait_for("both replicas ready", lambda: all(self.ready(r) for r in (0, 1)), 180)
        self.go.touch()


def torchft_overhead(args: argparse.Namespace, work: pathlib.Path) -> dict[str, Any]:
    job = TorchftJob(args, work, "overhead")
    try:
        job.launch()
        deadline = time.monotonic() + args.max_s
        while any(job.proc(r).poll() is None for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = {r: job.proc(r).poll() for r in (0, 1)}
        if any(c != 0 for c in codes.values()):
            raise BenchError(f"torchft overhead: replica exit codes {codes} (logs in {work})")
    finally:
        job.procs.stop_all()
    phases = [e for r in (0, 1) for e in replica_events(job.events_path(r)) if e.get("event") == schema.PHASE]
    per_replica = {}
    for r in (0, 1):
        mine = [e for e in phases if e["replica"] == r]
        off = statistics.median(e["seconds"] / e["steps"] for e in mine if e["kind"] == "off")
        on = statistics.median(e["seconds"] / e["steps"] for e in mine if e["kind"] == "on")
        per_replica[r] = {**overhead(off, on), "commits": sum(e.get("commits", 0) for e in mine),
                          "syncs": sum(e.get("syncs", 0) for e in mine),
                          "min_participants": min((e.get("min_participants", 0) for e in mine if e["kind"] == "on"),
                                                  default=0)}
    off = statistics.mean(p["off_s_per_step"] for p in per_replica.values())
    on = statistics.mean(p["on_s_per_step"] for p in per_replica.values())
    return {**overhead(off, on), "per_replica": per_replica, "phases": phases}


def torchft_restart(args: argparse.Namespace, work: pathlib.Path) -> dict[str, Any]:
    job = TorchftJob(args, work, "run")
    try:
        job.launch()
        job.wait_for(f"{args.commits_before} commits with 2 replicas",
                     lambda: len(job.commits(1)) >= args.commits_before, args.max_s)
        old = job.incarnation[1]
        t_kill = job.procs.kill(f"replica-1.{old}")
        job.start_replica(1)
        job.wait_for("the restarted replica's first commit", lambda: len(job.commits(1)) >= 1, args.max_s)
        t_back = job.commits(1)[0]["t"]
        time.sleep(1.0)  # a few more survivor steps after it
        survivor = step_gaps(job.step_times(0), t_kill, t_back + 1.0)
        first_step = min(job.step_times(1), default=None)
        ready = [e["t"] for e in replica_events(job.events_path(1)) if e.get("event") == schema.READY]
    finally:
        job.stop_file.touch()
        job.procs.stop_all()
    return {"kill_to_contribution_s": t_back - t_kill, "kill_to_ready_s": (ready[0] - t_kill) if ready else None,
            "ready_to_contribution_s": (t_back - ready[0]) if ready else None,
            "kill_to_first_step_s": (first_step - t_kill) if first_step else None,
            "survivor_stall_s": survivor["stall_s"], "survivor_max_step_gap_s": survivor["max_gap_s"],
            "survivor_median_step_s": survivor["median_gap_s"],
            "contribution_means": "first committed outer sync (should_commit true) of the restarted replica "
                                  "with 2 participants, after healing from its peer"}


def torchft_outage(args: argparse.Namespace, work: pathlib.Path) -> dict[str, Any]:
    job = TorchftJob(args, work, "run")
    died: dict[int, float | None] = {0: None, 1: None}
    codes: dict[int, int | None] = {0: None, 1: None}
    try:
        job.launch()
        job.wait_for(f"{args.commits_before} commits with 2 replicas",
                     lambda: all(len(job.commits(r)) >= args.commits_before for r in (0, 1)), args.max_s)
        t_kill = job.procs.kill("lighthouse")
        restart_at = t_kill + args.outage_s
        restarted: float | None = None
        end = t_kill + args.observe_s
        while time.time() < end:  # bounded by --observe-s
            now = time.time()
            if restarted is None and now >= restart_at:
                job.start_lighthouse()
                restarted = time.time()
            for r in (0, 1):
                if died[r] is None and job.proc(r).poll() is not None:
                    died[r], codes[r] = now, job.proc(r).returncode
            if all(d is not None for d in died.values()):
                break
            time.sleep(0.1)
        after = {r: [c["t"] for c in job.commits(r, participants=1) if c["t"] > (restarted or end)] for r in (0, 1)}
        # a replica blocked until it died (or until the end) made no step after: that wait counts
        last: dict[int, float] = {}
        for r in (0, 1):
            d = died[r]
            last[r] = d if d is not None else min(end, time.time())
        gaps = {r: step_gaps([*job.step_times(r), last[r]], t_kill, last[r]) for r in (0, 1)}
        last_step = {r: max(job.step_times(r), default=t_kill) - t_kill for r in (0, 1)}
        errors = {r: [e.get("error") for e in replica_events(job.events_path(r))
                      if e.get("event") == schema.ERROR][:1] for r in (0, 1)}
    finally:
        job.stop_file.touch()
        job.procs.stop_all()
    dead = [t - t_kill for t in died.values() if t is not None]
    back = [min(ts) - (restarted or 0.0) for ts in after.values() if ts]
    return {"outage_s": args.outage_s, "observed_s": args.observe_s,
            "max_stall_s": max(g["max_gap_s"] for g in gaps.values()),
            "per_replica": {r: {**gaps[r], "last_step_after_kill_s": last_step[r], "exit_code": codes[r],
                                "error": errors[r]} for r in (0, 1)},
            "job_died": bool(dead), "died_after_s": min(dead) if dead else None,
            "synced_again_after_restart_s": min(back) if back else None}


# -- ddiloco side -------------------------------------------------------------------------------

def _cli() -> list[str]:
    return [sys.executable, "-m", "ddiloco.core.cli"]


def ddiloco_overhead(args: argparse.Namespace, work: pathlib.Path) -> dict[str, Any]:
    """Two ``ddiloco bench learner`` processes at once, one torch thread each (two learners on the
    machine's cores, as the two torchft replicas are)."""
    procs = Procs(work)
    outs = [work / f"learner-{i}.json" for i in (0, 1)]
    try:
        for i, out in enumerate(outs):
            procs.start(f"bench-learner-{i}", [
                *_cli(), "bench", "learner", "--d-model", str(args.d_model), "--n-layer", str(args.n_layer),
                "--n-head", str(args.n_head), "--context", str(args.context), "--batch-size", str(args.batch_size),
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                "--fragments", str(args.fragments), "--sync-every", str(args.sync_every),
                "--overlap", str(args.overlap), "--threads", "1", "--json", "--out", str(out)])
        deadline = time.monotonic() + args.max_s
        for name, proc in procs.procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise BenchError(f"ddiloco overhead: {name} still running after {args.max_s} s") from exc
            if proc.returncode != 0:
                raise BenchError(f"ddiloco overhead: {name} exited {proc.returncode} (log {work / (name + '.log')})")
    finally:
        procs.stop_all()
    per = {}
    for i, out in enumerate(outs):
        r = json.loads(out.read_text())
        per[i] = {**overhead(1.0 / r["steps_per_s_off"], 1.0 / r["steps_per_s_on"]),
                  "sends": r["counts"]["sends"], "applies": r["counts"]["applies"]}
    off = statistics.mean(p["off_s_per_step"] for p in per.values())
    on = statistics.mean(p["on_s_per_step"] for p in per.values())
    return {**overhead(off, on), "per_learner": per}


def _ddiloco_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"protocol": {"num_fragments": args.fragments, "sync_every": args.sync_every, "overlap": args.overlap,
                         "mode": "decoupled"},
            "model": {"d_model": args.d_model, "n_layer": args.n_layer, "n_head": args.n_head,
                      "context": args.context},
            "data": {"batch_size": args.batch_size, "context": args.context},
            "train": {"eval_every": 0}}


def _ddiloco_run(args: argparse.Namespace, work: pathlib.Path, events: list[dict[str, Any]]) -> pathlib.Path:
    """``ddiloco run`` of 2 learners with the fault plan ``events``; returns its run folder."""
    import yaml

    work.mkdir(parents=True, exist_ok=True)
    (work / "config.yaml").write_text(yaml.safe_dump(_ddiloco_config(args)))
    (work / "chaos.yaml").write_text(yaml.safe_dump({"events": events}))
    out = work / "run"
    procs = Procs(work)
    try:
        proc = procs.start("ddiloco-run", [*_cli(), "run", "--learners", "2", "--steps", str(args.run_steps),
                                           "--config", str(work / "config.yaml"), "--chaos", str(work / "chaos.yaml"),
                                           "--out", str(out), "--no-progress"])
        try:
            proc.wait(timeout=args.max_s * 3)
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"ddiloco run still running after {args.max_s * 3} s (log {work})") from exc
    finally:
        procs.stop_all()
    if not (out / "summary.json").exists():
        raise BenchError(f"ddiloco run left no summary (exit {proc.returncode}; log {work / 'ddiloco-run.log'})")
    return out


def _learner_logs(out: pathlib.Path) -> dict[str, list[dict[str, Any]]]:
    # load_jsonl recovers the records of a restarted learner that appended to a half-written line
    return {p.stem: load_jsonl(p) for p in sorted((out / "learners").glob("*.jsonl"))}


def ddiloco_restart(args: argparse.Namespace, work: pathlib.Path) -> dict[str, Any]:
    out = _ddiloco_run(args, work, [{"kind": "kill", "target": "learner-1", "at_step": args.fault_step,
                                     "restart_after_s": 0.0}])
    faults = [e for e in load_jsonl(out / "faults.jsonl", missing_ok=True) if e.get("kind") == "kill"]
    if not faults:
        raise BenchError(f"ddiloco restart: no kill was injected ({out})")
    t_kill = faults[0]["t"]
    logs = _learner_logs(out)
    later = [e for e in logs.get("learner-1", []) if e.get("t", 0) > t_kill]
    merged = [e["t"] for e in later if e.get("event") == schema.RESULT and e.get("outcome") == "merged"]
    start = [e["t"] for e in later if e.get("event") == schema.START]
    steps = [e["t"] for e in later if e.get("event") == schema.STEP]
    t_back = merged[0] if merged else None
    survivor = step_gaps([e["t"] for e in logs["learner-0"] if e.get("event") == schema.STEP], t_kill,
                         (t_back or t_kill) + 1.0)
    return {"kill_to_contribution_s": (t_back - t_kill) if t_back else None,
            "kill_to_ready_s": (start[0] - t_kill) if start else None,
            "ready_to_contribution_s": (t_back - start[0]) if start and t_back else None,
            "kill_to_first_step_s": (steps[0] - t_kill) if steps else None,
            "survivor_stall_s": survivor["stall_s"], "survivor_max_step_gap_s": survivor["max_gap_s"],
            "survivor_median_step_s": survivor["median_gap_s"], "run": str(out),
            "contribution_means": "first contribution of the restarted learner the synchronizer merged"}


def ddiloco_outage(args: argparse.Namespace, work: pathlib.Path) -> dict[str, Any]:
    out = _ddiloco_run(args, work, [{"kind": "kill_synchronizer", "at_step": args.fault_step,
                                     "restart_after_s": args.outage_s}])
    summary = json.loads((out / "summary.json").read_text())
    faults = [e for e in load_jsonl(out / "faults.jsonl", missing_ok=True) if e.get("kind") == "kill_synchronizer"]
    if not faults:
        raise BenchError(f"ddiloco outage: no synchronizer kill was injected ({out})")
    t_kill = faults[0]["t"]
    logs = _learner_logs(out)
    gaps = {lid: step_gaps([e["t"] for e in ev if e.get("event") == schema.STEP], t_kill) for lid, ev in logs.items()}
    failed = summary.get("failed_learners") or {}
    ends = {lid: any(e.get("event") == schema.END for e in ev) for lid, ev in logs.items()}
    # a learner that failed or never finished: the last thing it logged is when it died
    dead = [max(e["t"] for e in ev) - t_kill for lid, ev in logs.items() if ev and (lid in failed or not ends[lid])]
    back = summary.get("restart_to_first_merge_s") or []
    return {"outage_s": args.outage_s, "max_stall_s": max(g["max_gap_s"] for g in gaps.values()),
            "per_learner": {lid: {**gaps[lid], "finished": ends[lid]} for lid in logs},
            "job_died": bool(failed) or not all(ends.values()), "died_after_s": min(dead) if dead else None,
            "synced_again_after_restart_s": back[0] if back else None,
            "steps_during_outage": {lid: sum(1 for e in ev if e.get("event") == schema.STEP
                                             and t_kill < e["t"] < t_kill + args.outage_s)
                                    for lid, ev in logs.items()},
            "final_eval_loss": summary.get("final_eval_loss"), "run": str(out)}


# -- command ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddiloco bench torchft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--systems", default="torchft,ddiloco", help="comma-separated, of torchft, ddiloco")
    p.add_argument("--d-model", type=int, default=64, help="width of the built-in GPT")
    p.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--context", type=int, default=64, help="sequence length")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per inner step")
    p.add_argument("--fragments", type=int, default=4, help="P: fragments (torchft: model fragments)")
    p.add_argument("--sync-every", type=int, default=16, help="H: inner steps between two syncs of a fragment")
    p.add_argument("--overlap", type=int, default=1, help="tau (torchft: fragment_sync_delay)")
    p.add_argument("--steps", type=int, default=200, help="overhead: timed inner steps per phase")
    p.add_argument("--warmup", type=int, default=20, help="overhead: untimed inner steps before each phase")
    p.add_argument("--repeats", type=int, default=2, help="overhead: off/on pairs")
    p.add_argument("--commits-before", type=int, default=4, help="restart/outage: syncs before the fault (torchft)")
    p.add_argument("--fault-step", type=int, default=100, help="restart/outage: inner step of the fault (ddiloco)")
    p.add_argument("--run-steps", type=int, default=600, help="restart/outage: inner steps of each ddiloco run")
    p.add_argument("--outage-s", type=float, default=10.0, help="outage: seconds the coordinator stays down")
    p.add_argument("--observe-s", type=float, default=90.0, help="outage: seconds watched from the kill (torchft)")
    p.add_argument("--max-s", type=float, default=300.0, help="bound on each wait for a process")
    p.add_argument("--workdir", help="folder for logs and event files (default: a temporary one, removed)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", default="bench-results/torchft.json", help="JSON results file")
    return p


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(scenarios, systems), or a usage error (exit 2) before anything is started."""
    scenarios = [s for s in args.scenarios.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    if not scenarios or any(s not in SCENARIOS for s in scenarios):
        parser.error(f"--scenarios: each of {', '.join(SCENARIOS)}, got {args.scenarios!r}")
    if not systems or any(s not in ("torchft", "ddiloco") for s in systems):
        parser.error(f"--systems: each of torchft, ddiloco, got {args.systems!r}")
    if min(args.d_model, args.n_layer, args.n_head, args.context, args.batch_size, args.fragments,
           args.sync_every, args.steps, args.repeats, args.commits_before, args.fault_step, args.run_steps) < 1:
        parser.error("model sizes, --batch-size, --fragments, --sync-every, --steps, --repeats, --commits-before, "
                     "--fault-step and --run-steps must be >= 1")
    if args.warmup < 0 or args.outage_s < 0 or args.max_s <= 0 or args.observe_s <= args.outage_s:
        parser.error("need --warmup >= 0, --outage-s >= 0, --max-s > 0 and --observe-s > --outage-s")
    if args.sync_every % args.fragments:
        parser.error(f"--sync-every {args.sync_every} must be a multiple of --fragments {args.fragments} "
                     "(torchft syncs one fragment every H/P steps)")
    if not 0 <= args.overlap < args.sync_every // args.fragments:
        parser.error(f"--overlap must be in [0, H/P) = [0, {args.sync_every // args.fragments}) (torchft's "
                     "fragment_sync_delay)")
    if args.d_model % args.n_head:
        parser.error("--d-model must be a multiple of --n-head")
    if args.fault_step >= args.run_steps:
        parser.error("--fault-step must be below --run-steps")
    return scenarios, systems


MEASURE = {("torchft", "overhead"): torchft_overhead, ("torchft", "restart"): torchft_restart,
           ("torchft", "outage"): torchft_outage, ("ddiloco", "overhead"): ddiloco_overhead,
           ("ddiloco", "restart"): ddiloco_restart, ("ddiloco", "outage"): ddiloco_outage}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    scenarios, systems = check_args(args, parser)
    try:
        if "torchft" in systems:
            require_torchft()
            lighthouse_binary()
    except BenchError as exc:
        print(f"ddiloco bench torchft: {exc}", file=sys.stderr)
        return 1
    exit_on_sigterm()  # SIGTERM unwinds, so the processes this one started are stopped
    with _workdir(args.workdir) as work:
        result: dict[str, Any] = {
            "benchmark": "torchft", "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average_start": os.getloadavg()[0],
            "torchft_version": _torchft_version() if "torchft" in systems else None,
            "settings": {k: getattr(args, k) for k in (
                "d_model", "n_layer", "n_head", "context", "batch_size", "fragments", "sync_every", "overlap",
                "steps", "warmup", "repeats", "commits_before", "fault_step", "run_steps", "outage_s", "observe_s")},
            "torchft": {}, "ddiloco": {}, "errors": {}}
        for scenario in scenarios:
            for system in systems:
                if not args.json:
                    print(f"{system} {scenario} ...", flush=True)
                sub = work / system / scenario
                sub.mkdir(parents=True, exist_ok=True)
                t0 = time.monotonic()
                try:
                    result[system][scenario] = MEASURE[(system, scenario)](args, sub)
                    result[system][scenario]["wall_s"] = time.monotonic() - t0
                except (BenchError, OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
                    result["errors"][f"{system}.{scenario}"] = f"{type(exc).__name__}: {exc}"
                    if not args.json:
                        print(f"  failed: {exc}", flush=True)
        result["ratios"] = ratios(result["torchft"], result["ddiloco"])
        result["load_average_end"] = os.getloadavg()[0]  # other work on the machine skews every figure
    out = save_result(result, args.out)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("\n".join(table(result)))
        print(f"wrote {out}")
    return 1 if result["errors"] else 0


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[pathlib.Path]:
    if path:
        p = pathlib.Path(path).resolve()
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    with tempfile.TemporaryDirectory(prefix="ddiloco-bench-torchft-") as tmp:
        yield pathlib.Path(tmp)


if __name__ == "__main__":
    sys.exit(main())
