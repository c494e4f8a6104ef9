"""``ddiloco bench learner``: the learner's own synchronisation overhead, inner steps per second
with ``DecoupledSync`` on and off, same model, same loop, same process, measured in the same run.

The inner step is the built-in learner's (``InnerLoop``: the built-in GPT, AdamW, gradient
clipping) on random token batches. "off" runs it alone; "on" calls ``DecoupledSync.step()`` after
each optimizer step, joined to a real synchronizer process on 127.0.0.1 (started as ``ddiloco
run`` starts it, ``LocalCluster.start_synchronizer``; a single learner, so every contribution
is merged and comes back). Off and on alternate ``--repeats`` times, each on repeat joining
afresh (a learner of its own id) and finishing; join, finish and the first ``--warmup`` steps
of every phase are not timed. ``overhead`` = 1 - median on steps/s / median off steps/s,
against the project's goal of under 2% of step time.

Where the remaining time goes, per fragment (``DecoupledSync.timings``): on the training thread
``gather`` (parameters into one fp32 tensor), ``outer_gradient``, ``handoff`` (queued for the
communication thread) and ``apply`` (a merged fragment written back); on the communication
thread ``encode`` (codec and error feedback) and ``decode`` (a merged fragment), which cost CPU
but do not block a step unless the cores are short. ``sync_step`` is the whole of ``step()``
per inner step. CPU time per inner step of this process and of the synchronizer's, off and on,
shows how much of the overhead is work competing for the same cores rather than time spent in
``step()``: on one machine the synchronizer's merges run on the learner's cores, which a
deployment does not do.

``--comm process`` runs the learner with ``learner.comm: process``: its communication in a process
of its own, whose CPU time is counted as this learner's; its encode and decode are not timed
(they run there).

``--pin`` (Linux) takes that contention out: the training thread (and torch's threads) run on
the first ``--threads`` CPUs, and every thread the synchronizer process and this learner's
communication start (its event loop, gRPC's threads, codec workers) on the rest, read back and
reported. What remains of the overhead is then ``step()`` itself and the training thread's
waits for the Python interpreter lock, which the communication thread shares, and whatever the
machine's CPUs take from each other: before the repeats, ``--pin`` times inner steps with the
other CPUs idle, busy (a Python loop on each), and idle again, and reports the slowdown
(``pinning.neighbour``), which no change to the learner would remove.

``--floor`` adds a third phase to every repeat, between off and on: the step boundary's own
arithmetic on the training thread and nothing else (``LocalBoundary``: the learner's
``LocalFragments`` driven as ``DecoupledSync`` drives them, with no communication, no events and
no synchronizer). Its overhead is the floor of any learner whose boundary runs on the training
thread, whatever carries the fragments: what ``on`` adds beyond it is the communication's.

``--synchronizer-batch`` (Linux) runs every thread of the synchronizer process under
``SCHED_BATCH``, as the learner's communication process runs: on this one machine its wakeups no
longer preempt the training thread, as a synchronizer on another machine could not; it keeps its
fair share of the CPUs. The policies are read back from the kernel and reported
(``synchronizer_policy``).

``--min-step-ms`` gives every inner step a floor, with synchronisation and without it alike (the
step sleeps out the rest, as ``learner.min_step_s`` does): the overhead at a step time this
machine's model does not have (a larger model's, a GPU's), and a pace that does not depend on
the machine, so that the synchronizer's requests reach a short timed phase on any machine.

The learner runs with the environment a learner service runs with (glibc's transparent-huge-page
tunable): where this process was started without it, the benchmark runs again in a child that has
it (``--huge-pages off``: the environment as it is).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import yaml

from ddiloco.core.resources import available_cpus
from ddiloco.lab.bench import (
    add_huge_pages_option,
    memory_environment,
    needs_rerun,
    rerun_as_deployed,
    save_result,
)
from ddiloco.lab.bench.boundary import LocalBoundary
from ddiloco.lab.procs import exit_on_sigterm, stop_processes

GOAL = 0.02
ORDER = ("off", "local", "on")
"""The phases of a repeat, in the order they run (local: ``--floor``)."""
SYNC_PHASES = ("gather", "outer_gradient", "handoff", "apply")
COMM_PHASES = ("encode", "decode")


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)
    return wrapper


@contextlib.contextmanager
def _comm_timing(sync: Any, times: dict[str, list[float]]) -> Iterator[None]:
    """Time the communication thread's encode (``Link._encode`` of each of this learner's links) and decode
    (``decode_fragment`` as the session module calls it), restored on exit."""
    from ddiloco.learner import session

    if not hasattr(sync.comm, "lanes"):  # --comm process: they run in the communication process, untimed
        yield
        return
    for lane in sync.comm.lanes:
        lane.link._encode = _timed(lane.link._encode, times["encode"])
    original = session.decode_fragment
    session.decode_fragment = _timed(original, times["decode"])  # type: ignore[assignment]
    try:
        yield
    finally:
        session.decode_fragment = original  # type: ignore[assignment]


def _pin(tids: set[int], cpus: set[int]) -> None:
    """Run each of ``tids`` only on ``cpus`` (threads that ended meanwhile are skipped)."""
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)


def _policies(pid: int, asked: str) -> dict[str, Any]:
    """How many threads of ``pid`` run under ``SCHED_BATCH``, as the kernel reports it, against what
    was asked."""
    from ddiloco.learner.comm_child import thread_policies

    found = thread_policies(pid)
    batch = sum(policy == getattr(os, "SCHED_BATCH", -1) for policy in found.values())
    return {"asked": asked, "threads": len(found), "batch_threads": batch}


def _affinity(tids: set[int]) -> set[int]:
    """The CPUs any of ``tids`` may run on, read back from the kernel."""
    cpus: set[int] = set()
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            cpus |= os.sched_getaffinity(tid)
    return cpus


_BUSY = """import os, sys
os.sched_setaffinity(0, {int(c) for c in sys.argv[1:]})
parent = os.getppid()
sys.stdout.write("r")
sys.stdout.flush()
while os.getppid() == parent:  # ends by itself if the benchmark is gone
    for _ in range(100_000):
        pass
"""


class NeighbourCheckError(RuntimeError):
    """The neighbour check could not put a busy loop on one of the other CPUs."""


def neighbour_slowdown(step: Callable[[], object], steps: int, cpus: set[int]) -> dict[str, Any]:
    """Inner-step time with ``cpus`` idle, with a busy Python loop on each of them, and idle again:
    how much work on the other CPUs slows this thread by itself (shared caches and memory, or two
    virtual CPUs on one physical core), which no change to the learner would take away."""
    import subprocess
    import sys

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) / steps

    for _ in range(3):  # warm-up, untimed
        step()
    idle_before = timed()
    busy: list[subprocess.Popen[bytes]] = []
    try:
        for c in sorted(cpus):
            busy.append(subprocess.Popen([sys.executable, "-c", _BUSY, str(c)], stdout=subprocess.PIPE))
        for proc in busy:  # each loop has moved to its CPU and runs
            assert proc.stdout is not None
            if proc.stdout.read(1) != b"r":
                raise NeighbourCheckError(f"the neighbour check's busy loop (pid {proc.pid}) did not start on its CPU "
                                          f"(its error, if any, is above)")
        loaded = timed()
    finally:
        stop_processes(busy, grace_s=5.0)
        for proc in busy:
            if proc.stdout is not None:
                proc.stdout.close()
    idle_after = timed()
    idle = (idle_before + idle_after) / 2
    return {"steps": steps, "idle_step_ms": 1e3 * idle, "busy_step_ms": 1e3 * loaded, "slowdown": loaded / idle - 1,
            "idle_step_ms_before_after": [1e3 * idle_before, 1e3 * idle_after], "pids": [p.pid for p in busy]}


@contextlib.contextmanager
def _started_on(cpus: set[int] | None) -> Iterator[None]:
    """Run this thread on ``cpus`` meanwhile (None: leave it), so that the threads and processes it
    starts inherit them, then put it back where it was."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class Phase:
    """One timed phase: ``steps`` inner steps after ``warmup`` untimed ones, with the CPU time
    this process and the synchronizer's used meanwhile."""

    def __init__(self, kind: str, repeat: int, steps: int, sync_pid: int, comm_pid: int | None = None) -> None:
        self.kind, self.repeat, self.steps, self.sync_pid, self.comm_pid = kind, repeat, steps, sync_pid, comm_pid
        self.seconds = self.cpu_s = self.sync_cpu_s = 0.0
        self.boundary_s = 0.0
        """A local phase (``--floor``): the seconds spent in ``LocalBoundary.step``."""

    def _cpu(self) -> float:
        """This process's CPU seconds, and its communication process's (``--comm process``)."""
        return time.process_time() + (_proc_cpu_s(self.comm_pid) if self.comm_pid else 0.0)

    def __enter__(self) -> Phase:
        self._t = (time.perf_counter(), self._cpu(), _proc_cpu_s(self.sync_pid))
        return self

    def __exit__(self, *exc: object) -> None:
        t, cpu, sync_cpu = self._t
        self.seconds = time.perf_counter() - t
        self.cpu_s = self._cpu() - cpu
        self.sync_cpu_s = _proc_cpu_s(self.sync_pid) - sync_cpu

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    def row(self) -> dict[str, Any]:
        return {"sync": self.kind, "repeat": self.repeat, "steps": self.steps, "seconds": self.seconds,
                "steps_per_s": self.steps_per_s, "step_ms": 1e3 * self.seconds / self.steps,
                "learner_cpu_ms_per_step": 1e3 * self.cpu_s / self.steps,
                "synchronizer_cpu_ms_per_step": 1e3 * self.sync_cpu_s / self.steps,
                **({"boundary_ms_per_step": 1e3 * self.boundary_s / self.steps} if self.kind == "local" else {})}


def _torch_threads(args: argparse.Namespace) -> int:
    """Torch threads for training: ``--threads``, else the CPUs this process may use (with
    ``--pin``, all but one)."""
    return args.threads or max(1, available_cpus() - 1 if args.pin else available_cpus())


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Validated (ModelConfig, the model, TrainConfig, protocol section) or a usage error (exit 2),
    before anything is started."""
    from ddiloco.protocol.config import ProtocolConfig
    from ddiloco.training.config import TrainConfig
    from ddiloco.training.model import ModelConfig

    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.batch_size < 1 or args.threads < 0:
        parser.error("need --steps >= 1, --warmup >= 0, --repeats >= 1, --batch-size >= 1, --threads >= 0")
    if not (math.isfinite(args.min_step_ms) and 0 <= args.min_step_ms <= 60_000):
        parser.error(f"--min-step-ms must be in [0, 60000], got {args.min_step_ms}")
    if args.pin:
        if not (hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")):
            parser.error("--pin needs Linux (per-thread CPU affinity)")
        cpus = len(os.sched_getaffinity(0))
        if cpus < 2 or _torch_threads(args) >= cpus:
            parser.error(f"--pin needs a CPU left over for communication and the synchronizer: this process "
                         f"may use {cpus} CPU(s), --threads is {_torch_threads(args)}")
    if args.synchronizer_batch and not (hasattr(os, "SCHED_BATCH") and os.path.isdir("/proc/self/task")):
        parser.error("--synchronizer-batch needs Linux (the SCHED_BATCH policy)")
    protocol = {k: v for k, v in (("num_fragments", args.fragments), ("sync_every", args.sync_every),
                                  ("overlap", args.overlap), ("mode", args.mode)) if v is not None}
    try:
        model_cfg = ModelConfig(d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head,
                                context=args.context)
        ProtocolConfig(**protocol)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    from ddiloco.fragments.partition import partition_tensors
    from ddiloco.training.model import build_model

    model = build_model(model_cfg, seed=0)
    fragments = ProtocolConfig(**protocol).num_fragments
    try:
        partition_tensors(list(model.named_parameters()), fragments)
    except ValueError as exc:
        parser.error(f"--fragments {fragments}: {exc}")
    train_cfg = TrainConfig(steps=(args.steps + args.warmup) * args.repeats * 2, warmup_steps=0, device="cpu")
    return model_cfg, model, train_cfg, protocol


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco bench learner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=64, help="width of the built-in GPT")
    parser.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads")
    parser.add_argument("--context", type=int, default=64, help="sequence length")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per inner step")
    parser.add_argument("--steps", type=int, default=200, help="timed inner steps per phase")
    parser.add_argument("--warmup", type=int, default=20, help="untimed inner steps at the start of each phase")
    parser.add_argument("--repeats", type=int, default=2, help="off/on pairs, interleaved")
    parser.add_argument("--fragments", type=int, help="protocol.num_fragments (default: the protocol's)")
    parser.add_argument("--sync-every", type=int, help="protocol.sync_every (default: the protocol's)")
    parser.add_argument("--overlap", type=int, help="protocol.overlap (default: the protocol's)")
    parser.add_argument("--mode", help="protocol.mode (default: the protocol's)")
    parser.add_argument("--codec", default=None, help="learner codec (default: the learner's)")
    parser.add_argument("--comm", choices=("thread", "process"), default="thread",
                        help="learner.comm: the communication in a thread of this process, or in a process of its "
                        "own (its CPU is counted as this learner's)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the CPUs this process may use)")
    parser.add_argument("--floor", action="store_true",
                        help="a third phase per repeat: the step boundary's own arithmetic on the training thread "
                        "alone (no communication, no synchronizer), the floor of the overhead")
    parser.add_argument("--min-step-ms", type=float, default=0.0,
                        help="every inner step, with synchronisation and without, takes at least this long (it "
                        "sleeps out the rest): the overhead at a longer step time, a pace independent of the "
                        "machine (default 0: no floor)")
    parser.add_argument("--pin", action="store_true", help="training on the first --threads CPUs (default: "
                        "all but one), the synchronizer and the communication threads on the rest (Linux)")
    parser.add_argument("--synchronizer-batch", action="store_true",
                        help="every thread of the synchronizer under SCHED_BATCH (Linux): its wakeups do not preempt "
                        "training, as a synchronizer on another machine's cannot")
    parser.add_argument("--workdir", help="folder for the synchronizer's config, state and log (default: a "
                        "temporary one, removed at the end)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--out", default="bench-results/learner.json", help="JSON results file")
    add_huge_pages_option(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    model_cfg, model, train_cfg, protocol = _check(args, parser)
    if args.huge_pages == "on" and needs_rerun():
        del model  # the child builds its own
        return int(rerun_as_deployed("learner", argv) or 0)
    threads = _torch_threads(args)
    torch.set_num_threads(threads)
    exit_on_sigterm()  # SIGTERM unwinds, so the processes this one started are stopped
    try:
        if args.workdir:
            pathlib.Path(args.workdir).mkdir(parents=True, exist_ok=True)
            return _run(args, model_cfg, model, train_cfg, protocol, threads, pathlib.Path(args.workdir))
        with tempfile.TemporaryDirectory(prefix="ddiloco-bench-learner-") as tmp:
            return _run(args, model_cfg, model, train_cfg, protocol, threads, pathlib.Path(tmp))
    except NeighbourCheckError as exc:
        print(f"ddiloco bench learner: {exc}; nothing was measured", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, model_cfg: Any, model: Any, train_cfg: Any, protocol: dict[str, Any],
         threads: int, work: pathlib.Path) -> int:
    from ddiloco.lab.cluster import LocalCluster
    from ddiloco.learner.comm_child import batch_policy, thread_ids
    from ddiloco.learner.sync import DecoupledSync, SyncError
    from ddiloco.training.inner_loop import InnerLoop
    from ddiloco.training.model import model_fingerprint, num_params

    cpus_allowed = available_cpus()  # before --pin narrows this thread's own
    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump({"protocol": protocol, "synchronizer": {}}))
    loop = InnerLoop(model, train_cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    tokens = args.batch_size * model_cfg.context

    floor_s = args.min_step_ms / 1e3

    def inner_step() -> float:
        began = time.perf_counter()
        window = torch.randint(0, model_cfg.vocab_size, (args.batch_size, model_cfg.context + 1), generator=gen)
        loss, _ = loop.step(window[:, :-1], window[:, 1:])
        if floor_s:  # as the learner service's min_step_s: the step lasts at least the floor
            time.sleep(max(0.0, began + floor_s - time.perf_counter()))
        return loss

    phases: list[Phase] = []
    floors: list[Phase] = []
    """--floor: each repeat's phase of the boundary's own arithmetic alone (``LocalBoundary``)."""
    timings: dict[str, list[float]] = {}
    comm_times: dict[str, list[float]] = {"encode": [], "decode": []}
    sends = applies = 0
    returned = {"slots": 0, "channel": 0}
    cluster = LocalCluster(work, cfg_path, learners=1, steps=train_cfg.steps)
    quiet = args.json
    pinning: dict[str, Any] | None = None
    training_tids: set[int] = set()
    other_cpus: set[int] | None = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        training_cpus, other_cpus = set(cpus[:threads]), set(cpus[threads:])
        torch.ones(1 << 22).mul_(2).sum()  # torch's parallel team exists from here on, and stays with training
        inner_step()  # untimed
        training_tids = thread_ids(os.getpid())
        _pin(training_tids, training_cpus)
        pinning = {"training_cpus": sorted(training_cpus), "other_cpus": sorted(other_cpus),
                   "observed": {"training": set(), "communication": set(), "synchronizer": set()},
                   "neighbour": neighbour_slowdown(inner_step, max(1, min(args.steps, 50)), other_cpus)}
        if not quiet:
            nb = pinning["neighbour"]
            print(f"neighbour check: {nb['idle_step_ms']:.1f} ms/step with CPUs {sorted(other_cpus)} idle, "
                  f"{nb['busy_step_ms']:.1f} ms with a busy loop on them ({nb['slowdown'] * 100:+.1f}%)", flush=True)
    try:
        with _started_on(other_cpus):  # the synchronizer and all its threads inherit them
            cluster.start_synchronizer()
        sync_pid = cluster.procs["synchronizer"].pid
        if args.synchronizer_batch and not batch_policy(sync_pid):
            raise RuntimeError("SCHED_BATCH was refused for the synchronizer's threads")
        if not quiet:
            print(f"learner: built-in GPT d_model {model_cfg.d_model} n_layer {model_cfg.n_layer} context "
                  f"{model_cfg.context} batch {args.batch_size} ({num_params(model) / 1e6:.2f}M params), "
                  f"{threads} torch threads; protocol {protocol or 'defaults'}; synchronizer {cluster.target}",
                  flush=True)
        # The learner lays each fragment's parameters out in one buffer when it is made (LocalFragments):
        # done here first, so that every phase, the first off phase included, trains on that layout
        LocalBoundary(model, protocol)
        for repeat in range(args.repeats):
            for _ in range(args.warmup):
                inner_step()
            with Phase("off", repeat, args.steps, sync_pid) as off_phase:
                for _ in range(args.steps):
                    inner_step()
            phases.append(off_phase)
            if not quiet:
                print(f"  repeat {repeat} off: {phases[-1].steps_per_s:.2f} steps/s", flush=True)
            if args.floor:
                boundary = LocalBoundary(model, protocol)
                for _ in range(args.warmup):
                    inner_step()
                    boundary.step(tokens)
                spent = boundary.seconds
                with Phase("local", repeat, args.steps, sync_pid) as local_phase:
                    for _ in range(args.steps):
                        inner_step()
                        boundary.step(tokens)
                local_phase.boundary_s = boundary.seconds - spent
                floors.append(local_phase)
                if not quiet:
                    print(f"  repeat {repeat} local: {local_phase.steps_per_s:.2f} steps/s", flush=True)

            sync = DecoupledSync(model, optimizer=loop.optimizer, config={"protocol": protocol},
                                 synchronizer=cluster.target, learner_id=f"bench-{repeat}",
                                 steps=args.warmup + args.steps, join_timeout_s=120.0,
                                 model_ref=json.dumps({"bench": "learner", "model": model_fingerprint(model, model_cfg)}),
                                 comm=args.comm, **({"codec": args.codec} if args.codec else {}))
            with _comm_timing(sync, comm_times):
                with _started_on(other_cpus):  # the communication thread starts here, and all it starts inherits them
                    joined = sync.join(resume=False)
                if joined is None:
                    raise SyncError("told to drain before joining")
                try:
                    for _ in range(args.warmup):
                        sync.step(tokens=tokens, loss=inner_step())
                    before = {k: list(v) for k, v in sync.timings.items()}
                    comm_pid = getattr(sync.comm, "pid", None)
                    with Phase("on", repeat, args.steps, sync_pid, comm_pid) as on_phase:
                        for _ in range(args.steps):
                            sync.step(tokens=tokens, loss=inner_step())
                    phases.append(on_phase)
                    if pinning is not None:
                        seen = pinning["observed"]
                        seen["training"] |= _affinity(training_tids)
                        seen["communication"] |= _affinity(thread_ids(os.getpid()) - training_tids)
                        if comm_pid:
                            seen["communication"] |= _affinity(thread_ids(comm_pid))
                        seen["synchronizer"] |= _affinity(thread_ids(sync_pid))
                    for phase, (calls, seconds) in sync.timings.items():
                        b = before.get(phase, [0, 0.0])
                        entry = timings.setdefault(phase, [0, 0.0])
                        entry[0] += calls - b[0]
                        entry[1] += seconds - b[1]
                finally:
                    sync.finish()
            for way, n in getattr(sync.comm, "returned", {}).items():  # --comm process
                returned[way] += n
            sends += int(sync.timings.get("handoff", [0, 0.0])[0])
            applies += int(sync.timings.get("apply", [0, 0.0])[0])
            if not quiet:
                print(f"  repeat {repeat} on:  {phases[-1].steps_per_s:.2f} steps/s", flush=True)
        policy = _policies(sync_pid, "batch" if args.synchronizer_batch else "normal")
    except (SyncError, RuntimeError) as exc:
        print(f"ddiloco bench learner: {exc} (synchronizer log: {work / 'logs' / 'synchronizer.log'})")
        return 1
    finally:
        cluster.stop_all()

    off = statistics.median(p.steps_per_s for p in phases if p.kind == "off")
    on = statistics.median(p.steps_per_s for p in phases if p.kind == "on")
    overhead = 1.0 - on / off
    per_fragment = {k: 1e3 * timings[k][1] / timings[k][0] if timings.get(k, [0])[0] else 0.0
                    for k in SYNC_PHASES}
    per_fragment.update({k: 1e3 * statistics.mean(v) if v else 0.0 for k, v in comm_times.items()})
    timed_steps = sum(p.steps for p in phases if p.kind == "on")

    def cpu_ms(kind: str, attr: str) -> float:
        return statistics.median(1e3 * getattr(p, attr) / p.steps for p in phases if p.kind == kind)
    sync_step_ms = 1e3 * timings.get("step", [0, 0.0])[1] / max(1, timed_steps)
    ordered = sorted(phases + floors, key=lambda p: (p.repeat, ORDER.index(p.kind)))
    floor: dict[str, Any] | None = None
    if floors:
        local = statistics.median(p.steps_per_s for p in floors)
        boundary_ms = 1e3 * sum(p.boundary_s for p in floors) / sum(p.steps for p in floors)
        floor = {"steps_per_s": local, "step_ms": 1e3 / local, "overhead": 1.0 - local / off,
                 "pair_overheads": [1.0 - f.steps_per_s / o.steps_per_s
                                    for o, f in zip(phases[0::2], floors, strict=True)],
                 "boundary_ms": boundary_ms, "boundary_fraction": boundary_ms * off / 1e3,
                 "means": "the local phases (--floor): the step boundary's own arithmetic on the training "
                          "thread alone; overhead = 1 - median local steps/s / median off steps/s, pair "
                          "overheads against each repeat's off phase, boundary_ms the time in it per step"}
    result = {
        "benchmark": "learner", "machine": platform.machine(), "torch": torch.__version__, "threads": threads,
        "model": {"d_model": model_cfg.d_model, "n_layer": model_cfg.n_layer, "n_head": model_cfg.n_head,
                  "context": model_cfg.context, "params": num_params(model)},
        "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "min_step_ms": args.min_step_ms,
        "protocol": protocol, "codec": args.codec, "comm": args.comm,
        "steps_per_s_off": off, "steps_per_s_on": on, "step_ms": 1e3 / off, "step_ms_on": 1e3 / on,
        "overhead": overhead, "goal": GOAL, "meets_goal": overhead < GOAL,
        "overhead_means": "1 - median steps/s with DecoupledSync / median steps/s without, same model and "
                          "loop, same process, measured in this run",
        "learner_cpu_ms_per_step": {"off": cpu_ms("off", "cpu_s"), "on": cpu_ms("on", "cpu_s")},
        "synchronizer_cpu_ms_per_step": {"off": cpu_ms("off", "sync_cpu_s"), "on": cpu_ms("on", "sync_cpu_s")},
        "cpus": cpus_allowed,
        "sync_step_ms": sync_step_ms, "sync_step_fraction": sync_step_ms * off / 1e3,
        "per_fragment_ms": per_fragment,
        "per_fragment_thread": {**{k: "training" for k in SYNC_PHASES}, **{k: "communication" for k in COMM_PHASES}},
        "counts": {"sends": sends, "applies": applies, "encodes": len(comm_times["encode"]),
                   "decodes": len(comm_times["decode"]), "timed_sends": int(timings.get("handoff", [0])[0]),
                   "timed_applies": int(timings.get("apply", [0])[0]),
                   "arrivals_in_slots": returned["slots"], "arrivals_on_channel": returned["channel"]},
        "pair_overheads": [1.0 - on_p.steps_per_s / off_p.steps_per_s
                           for off_p, on_p in zip(phases[0::2], phases[1::2], strict=True)],
        "pair_overheads_mean": "1 - on steps/s / off steps/s of each repeat's adjacent off and on phases "
                               "(slow drifts of the machine cancel within a pair)",
        "huge_pages": args.huge_pages, **memory_environment(),
        "synchronizer_policy": policy,
        "pinning": pinning and {**pinning, "observed": {k: sorted(v) for k, v in pinning["observed"].items()}},
        "floor": floor,
        "results": [p.row() for p in ordered],
    }
    out = save_result(result, args.out)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'sync':>5} {'repeat':>6} {'steps/s':>9} {'ms/step':>8}")
    for p in ordered:
        print(f"{p.kind:>5} {p.repeat:>6} {p.steps_per_s:>9.2f} {1e3 * p.seconds / p.steps:>8.2f}")
    print(f"median: off {off:.2f} steps/s ({1e3 / off:.2f} ms), on {on:.2f} steps/s ({1e3 / on:.2f} ms); "
          f"overhead {overhead * 100:+.2f}% (goal < {GOAL * 100:.0f}%: {'met' if overhead < GOAL else 'MISSED'})")
    print("per repeat (adjacent off and on): " + ", ".join(f"{o * 100:+.2f}%" for o in result["pair_overheads"]))
    if floor is not None:
        print(f"floor (the boundary's arithmetic alone): {floor['steps_per_s']:.2f} steps/s, overhead "
              f"{floor['overhead'] * 100:+.2f}% (per repeat " + ", ".join(f"{o * 100:+.2f}%" for o in floor["pair_overheads"])
              + f"); {floor['boundary_ms']:.3f} ms per step ({floor['boundary_fraction'] * 100:.2f}% of an off step)")
    if pinning is not None:
        seen = result["pinning"]["observed"]
        print(f"pinned: training on CPUs {seen['training']}, communication on {seen['communication']}, "
              f"synchronizer on {seen['synchronizer']} (read back)")
    if args.synchronizer_batch:
        print(f"synchronizer under SCHED_BATCH: {policy['batch_threads']} of its {policy['threads']} threads "
              "(read back)")
    lc, sc = result["learner_cpu_ms_per_step"], result["synchronizer_cpu_ms_per_step"]
    print(f"CPU ms per inner step: this process off {lc['off']:.1f}, on {lc['on']:.1f}; synchronizer process "
          f"off {sc['off']:.1f}, on {sc['on']:.1f} ({result['cpus']} CPUs)")
    print(f"DecoupledSync.step(): {sync_step_ms:.3f} ms per inner step "
          f"({result['sync_step_fraction'] * 100:.2f}% of an off step)")
    print(f"per fragment ({sends} sent, {applies} applied; encodes {len(comm_times['encode'])}, "
          f"decodes {len(comm_times['decode'])}):")
    for phase, ms in per_fragment.items():
        print(f"  {phase:>15} {ms:>8.3f} ms  ({result['per_fragment_thread'][phase]} thread)")
    if args.comm == "process":
        print(f"merged fragments back: {returned['slots']} through shared memory, {returned['channel']} on the channel")
    print(f"wrote {out}")
    return 0


__all__ = ["main"]
