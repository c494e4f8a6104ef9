"""Fault plans and the driver that injects them into a local run.

A ``FaultPlan`` is a list of events, each due at a time (``at_s``: seconds after every learner
has started training) or at a step (``at_step``: once the target learner, or for faults without
a target the most advanced learner, has reached that inner step; steps do not depend on
how fast this machine happens to be):

- ``kill``: SIGKILL a learner; with ``restart_after_s`` it is started again (same id, or a new one
  with ``new_id``) and goes on from the fleet's step to the run's end (``train.resume: fleet``;
  with ``none`` it runs the steps it had left from step 1);
- ``stop``: SIGSTOP a learner for ``duration_s`` then SIGCONT (a straggler / frozen host);
- ``kill_synchronizer``: SIGKILL the synchronizer, restart it after ``restart_after_s`` on the same
  state dir and port (learners reconnect by themselves);
- ``wipe_synchronizer``: the same, with its state dir deleted before the restart (a lost volume):
  the learners that hold its fragments seed it again (docs/sharding.md, "a shard that lost its
  state");
- ``net``: a network fault on one learner's link, through its ``FaultProxy``: ``latency`` (value =
  seconds), ``bandwidth`` (value = bytes/s), ``stall``, ``blackhole`` (both for ``duration_s``),
  ``reset`` (drop every connection);
- ``scale_up``: start an extra learner; ``drain``: SIGTERM a learner (it finishes its step and leaves);
- ``nan``: a learner's parameters turn NaN (SIGUSR1, its fault-injection hook); it must heal.
- ``corrupt``: from then on a learner scales every outer gradient it sends (SIGUSR2); ``inflate``:
  from then on it claims ``inflate_factor`` times the tokens it trained (SIGRTMIN), its outer
  gradients sound; ``overclaim``: from then on it claims ``overclaim_factor`` times the steps and
  tokens it trained and scales its outer gradient to match (SIGRTMIN+1): hostile learners, for the
  norm guard, the weight guard and the claim guard.

Plans come from a YAML/JSON file (``events: [{at_s, kind, target, ...}]``), from a shorthand
``random:mtbf=30s,seed=7[,duration=300s][,kinds=kill+stop+net+sync]`` (exponential gaps with the
given mean, targets and kinds drawn from the seed, at least one synchronizer kill when ``sync`` is
among the kinds), or from the builder: ``FaultPlan().kill("learner-1", at_step=30, restart_after_s=5)``.
"""

from __future__ import annotations

import dataclasses
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pydantic.dataclasses import dataclass as config_dataclass

from ddiloco.core import events as schema
from ddiloco.core.config import STRICT, build, read_file

Kind = Literal["kill", "stop", "kill_synchronizer", "wipe_synchronizer", "net", "scale_up", "drain", "nan", "corrupt",
               "inflate", "overclaim"]
SYNCHRONIZER_KINDS = ("kill_synchronizer", "wipe_synchronizer")
"""Kinds whose target is a synchronizer shard (``synchronizer-s``; empty: every shard), not a learner."""
KINDS: tuple[str, ...] = get_args(Kind)
NET_FAULTS = ("latency", "bandwidth", "stall", "blackhole", "reset")


@config_dataclass(frozen=True, kw_only=True, config=STRICT)
class FaultEvent:
    kind: Kind
    """What to break (see the module docstring)."""
    at_s: float | None = None
    """Due this many seconds after training started (or give ``at_step``)."""
    at_step: int | None = None
    """Due once the target learner (without a target: the most advanced learner) has completed
    this many inner steps, over all its incarnations (or give ``at_s``)."""
    target: str = ""
    """Learner id (kill, stop, net, drain); kill_synchronizer, wipe_synchronizer: one shard
    (``synchronizer-s``) or, empty, every shard; ignored for scale_up."""
    duration_s: float = 0.0
    """stop, stall, blackhole, latency, bandwidth: how long the fault lasts."""
    restart_after_s: float | None = None
    """kill, kill_synchronizer, wipe_synchronizer: restart after this delay (None: stays down; the
    synchronizer is always restarted, after 1 s if not given)."""
    new_id: bool = False
    """kill: restart under a new learner id instead of the same one."""
    net: str = ""
    """net: one of NET_FAULTS."""
    value: float = 0.0
    """net latency: seconds; net bandwidth: bytes per second."""

    def __post_init__(self) -> None:
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError("a fault is due either at_s or at_step (exactly one)")
        if (self.at_s is not None and self.at_s < 0) or (self.at_step is not None and self.at_step < 1):
            raise ValueError("at_s must be >= 0 and at_step >= 1")
        if self.duration_s < 0 or (self.restart_after_s is not None and self.restart_after_s < 0):
            raise ValueError("fault times must be >= 0")
        if self.kind in ("kill", "stop", "drain", "net", "nan", "corrupt", "inflate", "overclaim") and not self.target:
            raise ValueError(f"a {self.kind} fault needs a target learner id")
        if self.kind == "net" and self.net not in NET_FAULTS:
            raise ValueError(f"net fault must be one of {', '.join(NET_FAULTS)}, got {self.net!r}")


@dataclass
class FaultPlan:
    events: list[FaultEvent] = field(default_factory=list)

    # -- builder --------------------------------------------------------------------------

    def kill(self, target: str, *, at_s: float | None = None, at_step: int | None = None,
             restart_after_s: float | None = 2.0, new_id: bool = False) -> FaultPlan:
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="kill", target=target,
                                      restart_after_s=restart_after_s, new_id=new_id))
        return self

    def stop(self, target: str, *, at_s: float | None = None, at_step: int | None = None,
             duration_s: float) -> FaultPlan:
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="stop", target=target, duration_s=duration_s))
        return self

    def kill_synchronizer(self, *, at_s: float | None = None, at_step: int | None = None,
                          restart_after_s: float = 1.0, shard: int | None = None) -> FaultPlan:
        """Kill the synchronizer (every shard), or only shard ``shard`` of a sharded one."""
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="kill_synchronizer",
                                      restart_after_s=restart_after_s,
                                      target="" if shard is None else f"synchronizer-{shard}"))
        return self

    def wipe_synchronizer(self, *, at_s: float | None = None, at_step: int | None = None,
                          restart_after_s: float = 1.0, shard: int | None = None) -> FaultPlan:
        """Kill the synchronizer (every shard, or shard ``shard``) and delete its state dir before
        the restart."""
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="wipe_synchronizer",
                                      restart_after_s=restart_after_s,
                                      target="" if shard is None else f"synchronizer-{shard}"))
        return self

    def net(self, target: str, fault: str, *, at_s: float | None = None, at_step: int | None = None,
            duration_s: float = 0.0, value: float = 0.0) -> FaultPlan:
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="net", target=target, net=fault,
                                      duration_s=duration_s, value=value))
        return self

    def scale_up(self, *, at_s: float | None = None, at_step: int | None = None) -> FaultPlan:
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="scale_up"))
        return self

    def nan(self, target: str, *, at_s: float | None = None, at_step: int | None = None) -> FaultPlan:
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="nan", target=target))
        return self

    def corrupt(self, target: str, *, at_s: float | None = None, at_step: int | None = None) -> FaultPlan:
        """From then on the target sends every outer gradient scaled by its ``corrupt_factor``."""
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="corrupt", target=target))
        return self

    def inflate(self, target: str, *, at_s: float | None = None, at_step: int | None = None) -> FaultPlan:
        """From then on the target claims its ``inflate_factor`` times the tokens it trained."""
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="inflate", target=target))
        return self

    def overclaim(self, target: str, *, at_s: float | None = None, at_step: int | None = None) -> FaultPlan:
        """From then on the target claims its ``overclaim_factor`` times the steps and tokens it
        trained, with its outer gradient scaled to match."""
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="overclaim", target=target))
        return self

    def drain(self, target: str, *, at_s: float | None = None, at_step: int | None = None) -> FaultPlan:
        self.events.append(FaultEvent(at_s=at_s, at_step=at_step, kind="drain", target=target))
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"events": [dataclasses.asdict(e) for e in self.events]}

    # -- parsing --------------------------------------------------------------------------

    @classmethod
    def parse(cls, spec: str, *, learners: list[str], duration_s: float) -> FaultPlan:
        """A plan from a file path or a ``random:`` shorthand."""
        if spec.startswith("random"):
            return cls.random_plan(spec, learners=learners, duration_s=duration_s)
        data = read_file(spec)
        events = data.get("events")
        if not isinstance(events, list) or set(data) != {"events"}:
            raise ValueError(f"fault plan {spec} must hold exactly a list 'events'")
        return cls([build(FaultEvent, e, f"fault plan {spec}: events[{i}]") for i, e in enumerate(events)])

    @classmethod
    def random_plan(cls, spec: str, *, learners: list[str], duration_s: float) -> FaultPlan:
        opts = dict(kv.split("=", 1) for kv in spec.partition(":")[2].split(",") if "=" in kv)
        unknown = sorted(set(opts) - {"mtbf", "seed", "duration", "kinds"})
        if unknown:
            raise ValueError(f"unknown random plan option(s) {unknown}; known: mtbf, seed, duration, kinds")
        mtbf = parse_seconds(opts.get("mtbf", "30s"))
        horizon = parse_seconds(opts["duration"]) if "duration" in opts else duration_s
        kinds = opts.get("kinds", "kill+stop+net+sync").split("+")
        bad = sorted(set(kinds) - {"kill", "stop", "net", "sync"})
        if bad or mtbf <= 0:
            raise ValueError(f"random plan: mtbf must be > 0 and kinds from kill, stop, net, sync (got {bad})")
        rng = random.Random(int(opts.get("seed", "0")))
        plan = cls()
        t = rng.expovariate(1 / mtbf)
        while t < horizon * 0.8:
            kind = rng.choice(kinds)
            target = rng.choice(learners)
            if kind == "kill":
                plan.kill(target, at_s=t, restart_after_s=rng.uniform(2, 8))
            elif kind == "stop":
                plan.stop(target, at_s=t, duration_s=rng.uniform(2, 10))
            elif kind == "net":
                fault = rng.choice(NET_FAULTS)
                plan.net(target, fault, at_s=t, duration_s=rng.uniform(2, 10),
                         value={"latency": 0.05, "bandwidth": 2e6}.get(fault, 0.0))
            else:
                plan.kill_synchronizer(at_s=t, restart_after_s=rng.uniform(1, 4))
            t += rng.expovariate(1 / mtbf)
        if "sync" in kinds and not any(e.kind == "kill_synchronizer" for e in plan.events):
            plan.kill_synchronizer(at_s=horizon * rng.uniform(0.3, 0.6), restart_after_s=2.0)
        plan.events.sort(key=lambda e: e.at_s or 0.0)  # random plans give every event a time
        return plan


def parse_seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (e.g. 30s, 2m, 500ms)")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


class ChaosDriver:
    """Runs a plan against a live run on its own thread; records what it did, when."""

    POLL_S = 0.05
    """How often step-keyed events are checked against the learners' progress."""

    def __init__(self, plan: FaultPlan, actions: dict[str, Callable[[FaultEvent], None]],
                 log: Callable[[dict[str, Any]], None], progress: Callable[[str], int] | None = None) -> None:
        """``progress(learner_id)``: inner steps that learner completed ("" : the most advanced one)."""
        if progress is None and any(e.at_step is not None for e in plan.events):
            raise ValueError("a plan with step-keyed events needs the learners' progress")
        self.plan = plan
        self.actions = actions
        self.log = log
        self.progress = progress
        self.injected: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="chaos", daemon=True)
        self._timers: list[threading.Timer] = []

    def start(self) -> None:
        self.started = time.time()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        for timer in self._timers:
            timer.cancel()
        self._thread.join(timeout=5)

    def later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` after ``delay_s`` unless the driver stopped (recoveries)."""
        timer = threading.Timer(delay_s, lambda: None if self._stop.is_set() else fn())
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _due(self, event: FaultEvent) -> bool:
        if event.at_s is not None:
            return time.time() >= self.started + event.at_s
        assert self.progress is not None and event.at_step is not None
        learner = "" if event.kind in SYNCHRONIZER_KINDS else event.target  # its target is a shard, not a learner
        return self.progress(learner) >= event.at_step

    def _main(self) -> None:
        pending = list(self.plan.events)
        while pending:
            due = [e for e in pending if self._due(e)]
            if not due:
                if self._stop.wait(self.POLL_S):
                    return
                continue
            for event in due:
                pending.remove(event)
                self._inject(event)

    def _inject(self, event: FaultEvent) -> None:
        record: dict[str, Any] = {"event": schema.FAULT, "t": time.time(), **dataclasses.asdict(event)}
        try:
            self.actions[event.kind](event)
            record["ok"] = True
        except Exception as exc:  # a fault that cannot be injected is recorded, not fatal
            record["ok"] = False
            record["error"] = str(exc)
        schema.validate(schema.FAULTS_LOG, schema.FAULT, record.keys() - {"event", "t"})
        self.injected.append(record)
        self.log(record)
