"""``DecoupledSync``: decoupled DiLoCo around any PyTorch training loop.

The user keeps their model, optimizer, data and loop; one object joins the fleet and, after each
optimizer step, does the rest::

    sync = DecoupledSync(model, synchronizer="sync:7000", learner_id="learner-0", optimizer=opt)
    start = sync.join()                      # genesis upload or fetch of the fleet's global model
    for step in range(start + 1, steps + 1):
        loss = train_step(model, opt, batch)  # forward, backward, optimizer.step()
        sync.step(tokens=batch_tokens, loss=loss)
        if sync.draining:                    # SIGTERM (sync.drain()) or told by the synchronizer
            break
    sync.finish()                            # hand over the progress since each last send

It owns what is protocol: the fragment layout of the model's parameters, the communication
thread (``Comm``: one gRPC stream, reconnects, heartbeats, codecs), the per-fragment base and
version, the counters (tokens, steps) that each contribution carries, answering the
synchronizer's requests at step boundaries, applying merged fragments ``tau`` steps after this
learner sent them (``apply_policy``), healing non-finite or repeatedly refused fragments, the
event log and the Prometheus metrics. The built-in learner service (``ddiloco.learner.service``)
is a training loop written on top of it, so both go through one code path.

Contract with the caller:

- ``step()`` is called once per inner step, after ``optimizer.step()``, from the thread that
  trains. Merged fragments are written into the model's parameters inside ``step()`` (and
  ``join()``), never concurrently with the caller's forward/backward.
- Parameters may live on any device and in any dtype; fragments travel as fp32 on the CPU
  (``gather``/``scatter``). The parameter names must be the same on every learner (pass the
  bare module, not a ``DistributedDataParallel`` wrapper whose names gain a ``module.`` prefix).
- The optimizer is optional; when given, healing a fragment also drops its parameters' moments.
- A learner may be several processes (``torchrun``, DDP): pass ``process_group`` (default: the
  default group when ``torch.distributed`` is initialised). Rank 0 of the group is the learner
  to the synchronizer — one stream, one contribution per fragment and round, whatever the
  number of ranks. Every rank calls ``join()``, ``step()`` and ``finish()`` at the same points;
  ``step()`` sums the ranks' tokens (and heals when any rank's loss is non-finite), and the
  fragments that rank 0 applied or healed at a boundary are broadcast to the other ranks, whose
  parameters therefore stay identical to rank 0's. ``draining`` is agreed on by all ranks at
  each step, so they leave the loop together.
- ``fingerprint`` identifies the architecture to the synchronizer; by default it is derived from
  the parameter names, shapes and dtypes plus ``model_ref``, so learners whose models line up
  tensor by tensor agree, and any other model is refused at the handshake.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddiloco.core.config import to_dict
from ddiloco.core.logs import get_logger
from ddiloco.core.modes import preset
from ddiloco.fragments.outer_gradient import all_finite, gather, outer_gradient, scatter
from ddiloco.fragments.partition import partition_tensors
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner.apply import apply_global, counters_after_apply
from ddiloco.learner.comm import Comm
from ddiloco.learner.config import LearnerConfig, learner_config
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import HEAL_AFTER, Arrival, Outgoing
from ddiloco.learner.metrics import LearnerMetrics

_PROTOCOL_SHORTHANDS = {"fragments": "num_fragments", "sync_every": "sync_every", "overlap": "overlap",
                        "mode": "mode"}


_JOINED, _DRAINED, _FAILED = 1, 2, 3


class _Ranks:
    """The processes that make up one learner (``torch.distributed``); one when it is not used."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        active = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if active else 1
        self.rank = dist.get_rank(group) if active else 0
        self.leader = self.rank == 0
        self.src = dist.get_global_rank(group, 0) if active and group is not None else 0
        nccl = active and dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to(self.device)
        self.dist.broadcast(moved, src=self.src, group=self.group)
        return moved.cpu()

    def broadcast_ints(self, values: list[int]) -> list[int]:
        return [int(v) for v in self.broadcast_tensor(torch.tensor(values, dtype=torch.int64)).tolist()]

    def sum_ints(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, group=self.group)
        return [int(v) for v in t.cpu().tolist()]


class SyncError(RuntimeError):
    """Decoupled training cannot go on: refused by the synchronizer, could not join, bad settings."""


def fleet_progress(fleet_step: int, versions: dict[int, int], sync_every: int, steps: int) -> int:
    """The step a learner joining a fleet that is already training starts after: the further of
    the synchronizer's fleet step (its clock; it starts again from 0 when the synchronizer
    restarts) and the durable progress in the fragments' versions (each version is one round of
    ``sync_every`` steps; the least advanced fragment counts), at most ``steps``."""
    durable = min(versions.values(), default=0) * sync_every
    return max(0, min(steps, max(int(fleet_step), durable)))


def parameter_fingerprint(model: nn.Module, model_ref: str = "") -> str:
    """Identity of a model's parameters: every (name, shape, dtype) in order, plus ``model_ref``."""
    h = hashlib.sha256(model_ref.encode())
    for name, param in model.named_parameters():
        h.update(f"\n{name}|{tuple(param.shape)}|{param.dtype}".encode())
    return "params-" + h.hexdigest()[:24]


@dataclass
class SentState:
    step: int
    counters: tuple[int, int]
    base_version: int
    values: torch.Tensor | None


class StepPace:
    """Recent wall time per inner step (an EMA), what the learner reports to pace the fleet's
    clock. One long step (a stop, a pause) counts at most ``clip`` times the average, so a
    learner's pace recovers within a few steps of resuming."""

    def __init__(self, alpha: float = 0.1, clip: float = 4.0) -> None:
        self.alpha, self.clip, self.value = alpha, clip, 0.0

    def update(self, sample: float) -> float:
        if self.value == 0.0:
            self.value = sample
        else:
            self.value += self.alpha * (min(sample, self.clip * self.value) - self.value)
        return self.value


def sync_config(config: LearnerConfig | dict[str, Any] | None = None, **settings: Any) -> LearnerConfig:
    """A ``LearnerConfig`` from a config object or document plus keyword settings: any learner
    field (``synchronizer``, ``learner_id``, ``codec``, ``token``, ``event_log``...), or a
    protocol field by its short name (``fragments``, ``sync_every``, ``overlap``, ``mode``)."""
    shared = ("protocol", "model", "data", "train")
    if isinstance(config, LearnerConfig):
        if all(v is None for v in settings.values()):
            return config  # validated already: nothing to apply
        full = to_dict(config)
        document: dict[str, Any] = {"learner": {k: v for k, v in full.items() if k not in shared},
                                    **{k: full[k] for k in shared}}
    else:
        document = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (config or {}).items()}
    protocol = dict(document.get("protocol") or {})
    learner = dict(document.get("learner") or {})
    for key, value in settings.items():
        if value is None:
            continue
        if key in _PROTOCOL_SHORTHANDS:
            protocol[_PROTOCOL_SHORTHANDS[key]] = value
        else:
            learner[key] = value
    document["protocol"], document["learner"] = protocol, learner
    try:
        return learner_config(document)
    except ValueError as exc:
        raise SyncError(str(exc)) from exc


class DecoupledSync:
    """Joins one learner to a synchronizer and keeps its model in decoupled DiLoCo with the fleet.

    ``config``: a ``LearnerConfig`` or a config document (sections ``learner``, ``protocol``...);
    ``settings`` override its fields (see ``sync_config``). ``steps``: the run's total inner
    steps: it places a learner that joins late (``start_step``), and in the modes where learners
    wait for merges (streaming, diloco) nothing is waited for after the last one. ``model_ref``: a string
    naming the model (a ``package.module:factory`` reference or the JSON of a built-in config);
    it is sent at the handshake, so the synchronizer's state records which model it holds, and
    it enters the default fingerprint.
    """

    def __init__(self, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
                 config: LearnerConfig | dict[str, Any] | None = None, steps: int | None = None,
                 fingerprint: str | None = None, model_ref: str | None = None, process_group: Any = None,
                 **settings: Any) -> None:
        cfg = sync_config(config, **settings)
        self.ranks = _Ranks(process_group)
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.steps = cfg.train.steps if steps is None else int(steps)
        self.model_ref = model_ref
        self.learner_id = cfg.resolved_id
        self.incarnation = random.SystemRandom().getrandbits(62) + 1
        self.log = get_logger("ddiloco.learner", learner_id=self.learner_id)
        self.params = dict(model.named_parameters())
        if not self.params:
            raise SyncError("the model has no parameters to synchronise")
        p = cfg.protocol
        try:
            self.layout = partition_tensors(list(self.params.items()), p.num_fragments)
        except ValueError as exc:
            raise SyncError(str(exc)) from exc
        self.fingerprint = fingerprint or parameter_fingerprint(model, model_ref or "")
        self.schedule = FragmentSchedule(num_fragments=p.num_fragments, sync_every=p.sync_every, overlap=p.overlap)
        self.learners_wait = preset(p.mode).learners_wait
        """Modes where learners wait for merges send at their own due steps (ddiloco.core.modes)."""
        self.events = EventLog(cfg.event_log if self.ranks.leader else None, learner_id=self.learner_id,
                               incarnation=self.incarnation)
        self.base: dict[int, torch.Tensor] = {}
        self.version: dict[int, int] = {}
        self.counters: dict[int, list[int]] = {f.index: [0, 0] for f in self.layout}
        self.window_start: dict[int, int] = {f.index: 1 for f in self.layout}
        self.sent: dict[int, SentState] = {}
        self.pending: dict[int, Arrival] = {}
        self.sequence = itertools.count(1)
        self.start_step = 0
        """The step this learner joined the fleet at (its first step is the next one)."""
        self.step_count = 0
        """The last inner step done (absolute: it starts at ``start_step``)."""
        self.tokens = 0
        self.blocked_s = 0.0
        self.joined = False
        self.corrupted = threading.Event()
        self.inflated = threading.Event()
        """Set by a chaos hook (SIGRTMIN): every answer claims inflate_factor times its tokens."""
        """Set by a chaos hook (SIGUSR2): every outer gradient sent is scaled by corrupt_factor."""
        self._pace = StepPace()
        self._last_end = 0.0
        self._ended = False
        self._closed = False
        self._drain_requested = False
        self._touched: dict[int, bool] = {}
        """Fragments whose parameters this step's boundary overwrote: fragment -> healed."""
        self._agreed_drain = False
        self.timings: dict[str, list[float]] = {}
        """Where the training thread's time in this object goes: phase -> [calls, seconds], summed
        with ``time.perf_counter()``. ``step`` (all of ``step()``), and per fragment: ``gather``
        (its parameters into one fp32 tensor), ``outer_gradient`` (base - current, finiteness
        check), ``handoff`` (queueing it for the communication thread), ``apply`` (a merged
        fragment into the parameters). Read by ``ddiloco bench learner``; costs a few clock reads
        per step and per fragment, changes nothing."""
        self.metrics = LearnerMetrics()
        self.metrics_port: int | None = None
        if cfg.metrics_port is not None and self.ranks.leader:
            self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.metrics_host)
        self.events.observers.append(self._observe)
        labels = {"model": model_ref} if model_ref else {}
        self.comm = Comm(cfg, layout=self.layout, model_fingerprint=self.fingerprint, incarnation=self.incarnation,
                         events=self.events, held=lambda: dict(self.version), genesis_values=self._genesis_values,
                         labels=labels)

    # -- state ----------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """True once the learner should stop: ``drain()`` was called (SIGTERM) or the
        synchronizer asked it to leave. Finish the current step, then call ``finish()``. With
        several ranks, the value all ranks agreed on at the last step."""
        if self.ranks.world > 1:
            return self._agreed_drain
        return self.comm.draining.is_set()

    def drain(self) -> None:
        """Ask the training loop to stop at its next step boundary. Called again (an operator's
        second SIGTERM), it also ends ``finish()``'s wait: contributions not yet sent or not yet
        answered are dropped (logged, and recorded in the event log). Safe from a signal handler."""
        if self._drain_requested:
            self.comm.hurry.set()
        self._drain_requested = True
        self.comm.draining.set()

    @property
    def versions(self) -> dict[int, int]:
        """Fragment -> the global version last applied to the model."""
        return dict(self.version)

    def _observe(self, event: str, fields: dict) -> None:
        m = self.metrics
        if event == "result":
            m.contributions.labels(fields.get("outcome", "")).inc()
        elif event == "dropped":
            m.contributions.labels("dropped").inc()
        elif event == "send":
            m.contributions.labels("sent").inc()
        elif event == "apply":
            m.applies.inc()
        elif event in ("connect", "disconnect"):
            m.connected.set(1 if event == "connect" else 0)

    # -- joining --------------------------------------------------------------------------

    def _genesis_values(self) -> dict[int, torch.Tensor]:
        return {f.index: gather(f, self.params) for f in self.layout}

    def join(self, *, resume: bool | None = None, timeout_s: float | None = None,
             **start_fields: Any) -> int | None:
        """Join the fleet: upload this model as the genesis global model, or fetch the fleet's
        global fragments into it. Returns the step training starts after (0, or the fleet's
        progress for a learner joining late when ``resume``, default ``train.resume == "fleet"``),
        or None when told to drain before it got in. ``start_fields`` go into the start event.
        With several ranks, rank 0 joins and the others receive its outcome and its parameters."""
        if self.ranks.world == 1:
            return self._join(resume, timeout_s, start_fields)
        outcome, error = _JOINED, ""
        start: int | None = None
        if self.ranks.leader:
            try:
                start = self._join(resume, timeout_s, start_fields)
                outcome = _JOINED if start is not None else _DRAINED
            except SyncError as exc:
                outcome, error = _FAILED, str(exc)
        header = self.ranks.broadcast_ints([outcome, start or 0, *(self.version.get(f.index, 0) for f in self.layout)])
        if header[0] == _FAILED:
            raise SyncError(error or "rank 0 of this learner could not join the synchronizer")
        if header[0] == _DRAINED:
            return None
        self.start_step = self.step_count = header[1]
        if not self.ranks.leader:
            self.version = {f.index: v for f, v in zip(self.layout, header[2:], strict=True)}
            self.joined = True
        for frag in self.layout:  # every rank starts from rank 0's parameters (genesis or fetched)
            self._share_fragment(frag.index)
        return self.start_step

    def _join(self, resume: bool | None, timeout_s: float | None, start_fields: dict[str, Any]) -> int | None:
        self.comm.start()
        timeout_s = self.cfg.join_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not self.comm.join.ready.wait(0.1):
            if self.comm.draining.is_set():
                self.log.info("drained before joining")
                self.close("drained")
                return None
            if time.monotonic() > deadline:
                self.close("failed")
                raise SyncError(f"could not join the synchronizer at {self.cfg.synchronizer} within {timeout_s:g}s "
                                "(learner.join_timeout_s)")
        if self.comm.join.error:
            self.close("failed")
            raise SyncError(f"synchronizer refused this learner: {self.comm.join.error}")
        if self.comm.join.genesis:
            for frag in self.layout:
                self.base[frag.index] = gather(frag, self.params)
                self.version[frag.index] = 0
        else:
            for p, (version, values) in self.comm.join.fetched.items():
                scatter(self.layout[p], values, self.params)
                self.base[p] = values.clone()
                self.version[p] = version
            if resume if resume is not None else self.cfg.train.resume == "fleet":
                self.start_step = fleet_progress(self.comm.join.fleet_step, self.version,
                                                 self.cfg.protocol.sync_every, self.steps)
        self.step_count = self.start_step
        self.window_start = {f.index: self.start_step + 1 for f in self.layout}
        self.joined = True
        params = sum(t.numel() for t in self.params.values())
        self.events.emit("start", start_step=self.start_step, num_fragments=self.layout.num_fragments,
                         fragment_sizes=[f.numel for f in self.layout], params=params,
                         genesis=self.comm.join.genesis, versions=dict(self.version), mode=self.cfg.protocol.mode,
                         apply_policy=self.cfg.apply_policy, config=to_dict(self.cfg, redact=True), **start_fields)
        self.log.info("joined", genesis=self.comm.join.genesis, params=params, start_step=self.start_step,
                      fragments=self.layout.num_fragments)
        self._last_end = time.perf_counter()
        return self.start_step

    # -- each step ------------------------------------------------------------------------

    def _time(self, phase: str, t0: float) -> float:
        """Add the seconds since ``t0`` to ``timings[phase]``; returns the clock now."""
        now = time.perf_counter()
        entry = self.timings.setdefault(phase, [0, 0.0])
        entry[0] += 1
        entry[1] += now - t0
        return now

    def step(self, tokens: int, loss: float | None = None, *, step_s: float | None = None) -> None:
        """Account for one inner step just taken (``tokens`` trained on, its ``loss``), answer the
        synchronizer's requests due at this boundary, and apply the merged fragments due before
        the next step. A non-finite ``loss`` puts every fragment back to its last global version."""
        if not self.joined:
            raise SyncError("call join() before step()")
        if self._ended:
            raise SyncError("step() after end_training()/finish()")
        t0 = time.perf_counter()
        try:
            self._step(tokens, loss, step_s)
        finally:
            self._time("step", t0)

    def _step(self, tokens: int, loss: float | None, step_s: float | None) -> None:
        if self.ranks.world > 1:
            finite = loss is None or math.isfinite(loss)
            total, broken = self.ranks.sum_ints([int(tokens), 0 if finite else 1])
            tokens, loss = total, (float("nan") if broken else loss)
            if not self.ranks.leader:
                self.step_count += 1
                self.tokens += tokens
                self._follow()
                return
        self._touched = {}
        self.step_count += 1
        step = self.step_count
        tokens = int(tokens)
        self.tokens += tokens
        if loss is not None and not math.isfinite(loss):
            self.heal(None, f"non-finite loss {loss}")
        else:
            for c in self.counters.values():
                c[0] += tokens
                c[1] += 1
        for p in self.comm.take_heals():
            self.heal([p], f"{HEAL_AFTER} contributions in a row refused for their content")
        due = ({p: 0 for p in self.schedule.due(step)} if self.learners_wait else self.comm.take_requests())
        for p, round_no in sorted(due.items()):
            if self._answered_lately(p, step):
                self.events.emit("skip", step=step, fragment=p, round=round_no,
                                 reason=f"its answer of step {self.sent[p].step} awaits its merge")
                continue
            self._send(p, step, round_no)
        now = time.perf_counter()
        interval = now - self._last_end
        stats = self.comm.stats
        stats.step, stats.tokens_total = step, self.tokens
        stats.step_time_s = self._pace.update(interval)  # waits for merges count: the fleet paces on them
        if step == self.start_step + 2:  # the first step's time is mostly warm-up; from the second the pace is known
            self.comm.beat_now()
        stats.tokens_per_s = tokens / stats.step_time_s if stats.step_time_s else 0.0
        self._last_end = now
        # Blocking modes wait here for the merges due before the next step, but never after the
        # last one (or when draining): the other learners may be waiting for the contributions
        # that ending hands over.
        blocked = self._apply_arrivals(step + 1, wait=step < self.steps and not self.comm.draining.is_set())
        self.events.emit("step", step=step, loss=loss, tokens=self.tokens,
                         step_s=interval if step_s is None else step_s, blocked_s=blocked)
        m = self.metrics
        m.steps.inc()
        m.tokens.inc(tokens)
        if loss is not None:
            m.loss.set(loss)
        m.blocked.inc(blocked)
        m.tokens_per_s.set(stats.tokens_per_s)
        m.count_bytes(self.comm.bytes_sent, self.comm.bytes_received)
        if self.ranks.world > 1:
            self._lead()

    # -- several ranks --------------------------------------------------------------------

    def _lead(self) -> None:
        """Rank 0, after its boundary: tell the other ranks whether to drain and which fragments
        it overwrote (applied or healed), then send them those fragments' values."""
        touched = sorted(self._touched.items())
        control = [int(self.comm.draining.is_set()), len(touched)]
        for p, healed in touched:
            control += [p, int(healed), self.version.get(p, 0)]
        self.ranks.broadcast_ints(control + [0] * (2 + 3 * self.layout.num_fragments - len(control)))
        self._agreed_drain = bool(control[0])
        for p, _ in touched:
            self._share_fragment(p)

    def _follow(self) -> None:
        """Any other rank: take rank 0's decisions and values for this boundary."""
        control = self.ranks.broadcast_ints([0] * (2 + 3 * self.layout.num_fragments))
        self._agreed_drain = bool(control[0])
        state = self.optimizer.state if self.optimizer is not None else {}
        for i in range(control[1]):
            p, healed, version = control[2 + 3 * i: 5 + 3 * i]
            self._share_fragment(p)
            self.version[p] = version
            if healed:
                for spec in self.layout[p].tensors:
                    state.pop(self.params[spec.name], None)

    def _share_fragment(self, p: int) -> None:
        """Rank 0's values of fragment ``p`` into every rank's parameters."""
        frag = self.layout[p]
        values = gather(frag, self.params) if self.ranks.leader else torch.empty(frag.numel, dtype=torch.float32)
        values = self.ranks.broadcast_tensor(values)
        if not self.ranks.leader:
            scatter(frag, values, self.params)

    # -- ending ---------------------------------------------------------------------------

    def end_training(self) -> None:
        """Training is over: hand over the progress made since each fragment's last send, so no
        trained step is lost, and tell the synchronizer at once."""
        if self._ended or not self.joined:
            return
        self._ended = True
        if not self.ranks.leader:
            return
        step = self.step_count
        if step > self.start_step:
            for frag in self.layout:
                pending = self.sent.get(frag.index)
                if pending is None:
                    self._send(frag.index, step, 0)
                elif pending.step != step:
                    # an answer still awaits its merge: count only the progress since it, so that
                    # no token is counted twice (if the answer is still waiting, this one replaces
                    # it and undercounts: the lesser error for a weight)
                    counters = self.counters[frag.index]
                    self.counters[frag.index] = [counters[0] - pending.counters[0], counters[1] - pending.counters[1]]
                    self._send(frag.index, step, 0)
        self.comm.training_done()

    def close(self, reason: str | None = None, *, flush_timeout_s: float = 30.0) -> bool:
        """Wait up to ``flush_timeout_s`` for every contribution's result, say goodbye and stop the
        communication thread. Returns whether every contribution was answered."""
        if self._closed:
            return True
        self._closed = True
        if not self.ranks.leader:
            self.events.close()
            return True
        started = time.monotonic()
        pending = self.comm.pending() if self.joined else 0
        if pending:
            self.log.info("waiting for contributions to be sent and answered", pending=pending,
                          timeout_s=flush_timeout_s, hint="a second SIGTERM leaves at once, dropping them")
        answered = self.comm.flush(timeout_s=flush_timeout_s) if pending else True
        if not answered:
            self.log.warning("leaving with contributions unanswered", pending=self.comm.pending(),
                             reason="second stop request" if self.comm.hurry.is_set() else "flush timeout")
        self.comm.stop(reason or ("drained" if self.draining else "finished"))
        if self.joined:
            self.events.emit("flushed", all_answered=answered, pending_s=time.monotonic() - started)
        self.events.close()
        return answered

    def finish(self, *, flush_timeout_s: float = 30.0) -> bool:
        """``end_training()`` then ``close()``: the end of a training loop."""
        self.end_training()
        return self.close(flush_timeout_s=flush_timeout_s)

    def __enter__(self) -> DecoupledSync:
        if not self.joined and self.join() is None:
            raise SyncError("drained before joining")
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.finish()
        else:  # the loop failed: leave without handing over a possibly broken state
            self.close("failed", flush_timeout_s=5.0)

    # -- healing --------------------------------------------------------------------------

    def heal(self, fragments: list[int] | None, reason: str) -> None:
        """Put ``fragments`` (None: all) back to their base with fresh optimizer moments, fetch
        the newest global version of them, and start their counters over."""
        step = self.step_count
        fragments = [f.index for f in self.layout] if fragments is None else fragments
        self.log.warning("healing", fragments=fragments, step=step, reason=reason)
        state = self.optimizer.state if self.optimizer is not None else {}
        for p in fragments:
            frag = self.layout[p]
            scatter(frag, self.base[p], self.params)
            for spec in frag.tensors:
                state.pop(self.params[spec.name], None)
            self.counters[p] = [0, 0]
            self.window_start[p] = step + 1
            self.sent.pop(p, None)
            self._touched[p] = True
        self.comm.resync(tuple(fragments))
        self.events.emit("heal", step=step, fragments=fragments, reason=reason)

    # -- contributions and merges ---------------------------------------------------------

    def _answered_lately(self, p: int, step: int) -> bool:
        """Whether a request for ``p`` finds the previous answer's merge not yet applied, less
        than H of this learner's steps after it was sent. The counters run from the last applied
        merge, so answering would count that answer's steps again (a learner slower than the
        fleet's pace is asked again before its merge comes back). An answer whose merge never
        comes (lost in a synchronizer restart) holds the fragment back H steps at most."""
        sent = self.sent.get(p)
        return sent is not None and not self.learners_wait and step - sent.step < self.schedule.sync_every

    def _send(self, p: int, step: int, round_no: int) -> None:
        frag = self.layout[p]
        tokens, steps = self.counters[p]
        if steps == 0:
            return
        t0 = time.perf_counter()
        current = gather(frag, self.params)
        t0 = self._time("gather", t0)
        delta = outer_gradient(self.base[p], current)
        finite = all_finite(delta)
        t0 = self._time("outer_gradient", t0)
        if not finite:
            self.heal([p], "non-finite outer gradient")
            return
        if self.corrupted.is_set():  # fault injection: a hostile learner (its own model stays sound)
            delta = delta * self.cfg.corrupt_factor
        claimed = tokens
        if self.inflated.is_set():  # fault injection: a learner that claims more than it trained
            claimed = max(1, round(tokens * self.cfg.inflate_factor))
        seq = next(self.sequence)
        self.comm.submit(Outgoing(p, seq, self.version[p], claimed, steps, step, delta, round=round_no))
        self._time("handoff", t0)
        self.events.emit("send", step=step, fragment=p, sequence=seq, base_version=self.version[p], tokens=claimed,
                         steps=steps, from_step=self.window_start[p], to_step=step, round=round_no)
        keep = current if self.cfg.apply_policy == "replay" else None
        self.sent[p] = SentState(step, (tokens, steps), self.version[p], keep)

    def _apply_arrivals(self, step: int, *, wait: bool = True) -> float:
        """Apply merged fragments due at the boundary before ``step``; returns seconds blocked waiting."""
        blocked = 0.0
        if self.learners_wait and wait:
            for p, sent in list(self.sent.items()):
                if step > self.schedule.apply_step(sent.step) and p not in self.pending:
                    known = self.comm.peek_version(p)
                    if known is None or known <= sent.base_version:
                        t0 = time.perf_counter()
                        self.comm.wait_arrival(p, sent.base_version, self.cfg.wait_timeout_s)
                        blocked += time.perf_counter() - t0
        self.pending.update(self.comm.take_arrivals())
        for p, arrival in list(self.pending.items()):
            sent = self.sent.get(p)
            if not arrival.resync:
                if sent is None:
                    # A merge of other learners' contributions, before ours for this fragment was sent:
                    # hold it until ours is on its way, so no unsent local progress is thrown away.
                    continue
                if step <= self.schedule.apply_step(sent.step):
                    continue  # arrived early: apply tau steps after sending
            del self.pending[p]
            self._apply(p, arrival, step)
        self.blocked_s += blocked
        return blocked

    def _apply(self, p: int, arrival: Arrival, step: int) -> None:
        frag = self.layout[p]
        if not arrival.resync and arrival.version <= self.version[p]:
            return
        policy = "overwrite" if arrival.resync else self.cfg.apply_policy
        sent = self.sent.pop(p, None)
        t0 = time.perf_counter()
        local = gather(frag, self.params)
        reference = sent.values if (sent is not None and sent.values is not None) else self.base[p]
        new = apply_global(policy, local=local, global_=arrival.values, reference=reference,
                           alpha=self.cfg.mix_alpha)
        scatter(frag, new, self.params)
        self._time("apply", t0)
        self._touched.setdefault(p, False)
        self.base[p] = arrival.values
        self.version[p] = arrival.version
        now = (self.counters[p][0], self.counters[p][1])
        tokens, steps = counters_after_apply(policy, now, sent.counters if sent else None)
        self.counters[p] = [tokens, steps]
        if policy == "overwrite":
            self.window_start[p] = step
        elif sent is not None:
            self.window_start[p] = sent.step + 1
        self.events.emit("apply", step=step, fragment=p, version=arrival.version, policy=policy,
                         resync=arrival.resync)


__all__ = ["DecoupledSync", "SyncError", "fleet_progress", "parameter_fingerprint", "sync_config"]
