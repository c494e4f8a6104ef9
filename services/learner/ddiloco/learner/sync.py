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

It orchestrates: the fragment layout of the model's parameters, one ``LearnerFragment`` per
fragment (``ddiloco.algorithm.learner_fragment``: base, version, counters, what was sent, and the
rules for when to answer, apply and heal), the communication thread (``Comm``: one gRPC stream,
reconnects, heartbeats, codecs), the event log and the Prometheus metrics. The built-in learner
service (``ddiloco.learner.service``) is a training loop written on top of it.

Contract with the caller:

- ``step()`` is called once per inner step, after ``optimizer.step()``, from the thread that
  trains. Merged fragments are written into the model's parameters inside ``step()`` (and
  ``join()``), never concurrently with the caller's forward/backward.
- Parameters may live on any device and in any dtype; fragments travel as fp32 on the CPU
  (``gather``/``scatter``). The parameter names must be the same on every learner (pass the
  bare module, not a ``DistributedDataParallel`` wrapper whose names gain a ``module.`` prefix).
- The optimizer is optional; when given, healing a fragment also drops its parameters' moments.
- A learner may be several processes (``torchrun``, DDP): pass ``process_group`` (default: the
  default group when ``torch.distributed`` is initialised); rank 0 speaks for the group
  (``ddiloco.learner.ranks``), and ``draining`` is agreed on by all ranks at each step.
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
from typing import Any

import torch
from torch import nn

from ddiloco.algorithm.fleet_clock import fleet_progress, last_merged_step
from ddiloco.core import events as schema
from ddiloco.core.averages import RunningAverage
from ddiloco.core.config import to_dict
from ddiloco.core.logs import get_logger
from ddiloco.core.modes import preset
from ddiloco.fragments.partition import partition_tensors
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner.comm import Comm
from ddiloco.learner.comm_process import ProcessComm
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.learner.local import LocalFragments
from ddiloco.learner.mailbox import HEAL_AFTER, Arrival, Outgoing
from ddiloco.learner.metrics import LearnerMetrics
from ddiloco.learner.ranks import DRAINED, FAILED, JOINED, Ranks
from ddiloco.learner.settings import SyncError, sync_config


def parameter_fingerprint(model: nn.Module, model_ref: str = "") -> str:
    """Identity of a model's parameters: every (name, shape, dtype) in order, plus ``model_ref``."""
    h = hashlib.sha256(model_ref.encode())
    for name, param in model.named_parameters():
        h.update(f"\n{name}|{tuple(param.shape)}|{param.dtype}".encode())
    return "params-" + h.hexdigest()[:24]


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
        cfg = self.cfg = sync_config(config, **settings)
        self.ranks = Ranks(process_group)
        self.model, self.optimizer, self.model_ref = model, optimizer, model_ref
        self.steps = cfg.train.steps if steps is None else int(steps)
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
        if len(cfg.targets) > p.num_fragments:
            raise SyncError(f"{len(cfg.targets)} synchronizer shards for {p.num_fragments} fragments: a shard would "
                            "own none")
        self.fingerprint = fingerprint or parameter_fingerprint(model, model_ref or "")
        self.schedule = FragmentSchedule(num_fragments=p.num_fragments, sync_every=p.sync_every, overlap=p.overlap)
        self.learners_wait = preset(p.mode).learners_wait
        """Modes where learners wait for merges send at their own due steps (ddiloco.core.modes)."""
        self.events = EventLog(cfg.event_log if self.ranks.leader else None, learner_id=self.learner_id,
                               incarnation=self.incarnation)
        self.local = LocalFragments(self.params, self.layout, apply_policy=cfg.apply_policy,
                                    mix_alpha=cfg.mix_alpha, optimizer=optimizer)
        """The parameters in fragments, with each fragment's protocol state (from ``join()`` on)."""
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
        """Set by a chaos hook (SIGUSR2): every outer gradient sent is scaled by corrupt_factor."""
        self.inflated = threading.Event()
        """Set by a chaos hook (SIGRTMIN): every answer claims inflate_factor times its tokens."""
        self.overclaimed = threading.Event()
        """Set by a chaos hook (SIGRTMIN+1): every answer claims overclaim_factor times its steps and
        tokens, with its outer gradient scaled by as much."""
        self._pace = RunningAverage(0.1, clip=4.0)
        """Recent wall time per inner step, what the learner reports to pace the fleet's clock; one
        long step (a stop, a pause) counts at most 4 times the average."""
        self._last_end = 0.0
        self._ended = self._closed = self._drain_requested = self._agreed_drain = False
        self.timings = self.local.timings
        """Where the training thread's time in this object goes: phase -> [calls, seconds]: ``step``
        (all of ``step()``), ``handoff`` (queueing a contribution for the communication thread) and
        the per-fragment phases of ``LocalFragments.timings``. Read by ``ddiloco bench learner``."""
        self.metrics = LearnerMetrics()
        self.metrics_port: int | None = None
        if cfg.metrics_port is not None and self.ranks.leader:
            self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.metrics_host)
        self.events.observers.append(self.metrics.observe)
        comm = ProcessComm if cfg.comm == "process" else Comm
        self.comm = comm(cfg, layout=self.layout, model_fingerprint=self.fingerprint, incarnation=self.incarnation,
                         events=self.events, held=lambda: self.versions, genesis_values=self.local.values,
                         labels={"model": model_ref} if model_ref else {})

    @property
    def draining(self) -> bool:
        """True once the learner should stop: ``drain()`` was called (SIGTERM) or the
        synchronizer asked it to leave. Finish the current step, then call ``finish()``. With
        several ranks, the value all ranks agreed on at the last step."""
        return self._agreed_drain if self.ranks.world > 1 else self.comm.draining.is_set()

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
        return self.local.versions

    # -- joining --------------------------------------------------------------------------

    def join(self, *, resume: bool | None = None, timeout_s: float | None = None,
             **start_fields: Any) -> int | None:
        """Join the fleet: upload this model as the genesis global model, or fetch the fleet's
        global fragments into it. Returns the step training starts after (0, or the fleet's
        progress for a learner joining late when ``resume``, default ``train.resume == "fleet"``),
        or None when told to drain before it got in. ``start_fields`` go into the start event.
        With several ranks, rank 0 joins and the others receive its outcome and its parameters."""
        if self.ranks.world == 1:
            return self._join(resume, timeout_s, start_fields)
        outcome, error, start = JOINED, "", None
        if self.ranks.leader:
            try:
                start = self._join(resume, timeout_s, start_fields)
                outcome = JOINED if start is not None else DRAINED
            except SyncError as exc:
                outcome, error = FAILED, str(exc)
        held = self.versions
        outcome, self.start_step, versions = self.ranks.agree_join(
            outcome, start or 0, [held.get(f.index, 0) for f in self.layout])
        if outcome == FAILED:
            raise SyncError(error or "rank 0 of this learner could not join the synchronizer")
        if outcome == DRAINED:
            return None
        self.step_count = self.start_step
        for frag in self.layout:  # every rank starts from rank 0's parameters (genesis or fetched)
            self.ranks.share_fragment(self.local.bound[frag.index])
        if not self.ranks.leader:
            self.local.follow(versions)
        self.joined = True
        return self.start_step

    def _join(self, resume: bool | None, timeout_s: float | None, start_fields: dict[str, Any]) -> int | None:
        self.comm.start()
        timeout_s = self.cfg.join_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        join = self.comm.join
        while not join.wait(0.1):
            if self.comm.draining.is_set():
                self.log.info("drained before joining")
                self.close("drained")
                return None
            if time.monotonic() > deadline:
                self.close("failed")
                shards = "" if self.comm.shards == 1 else f" (shards {join.pending} of {self.comm.shards} did not answer)"
                raise SyncError(f"could not join the synchronizer at {self.cfg.synchronizer}{shards} within "
                                f"{timeout_s:g}s (learner.join_timeout_s)")
        if join.failure:
            self.close("failed")
            raise SyncError(f"could not join the synchronizer at {self.cfg.synchronizer}: {join.failure}")
        if join.error:
            self.close("failed")
            raise SyncError(f"synchronizer refused this learner: {join.error}")
        if not join.genesis and (resume if resume is not None else self.cfg.train.resume == "fleet"):
            versions = {p: version for p, (version, _) in join.fetched.items()}
            if self.learners_wait:  # in phase with the fleet (fleet_clock.last_merged_step says why)
                self.start_step = min(self.steps, last_merged_step(versions, self.schedule))
            else:
                self.start_step = fleet_progress(join.fleet_step, versions, self.cfg.protocol.sync_every, self.steps)
        self.step_count = self.start_step
        self.local.join(join.fetched, self.start_step)  # what a shard this learner seeded holds is its own
        self.joined = True
        params = sum(t.numel() for t in self.params.values())
        self.events.emit(schema.START, start_step=self.start_step, num_fragments=self.layout.num_fragments,
                         fragment_sizes=[f.numel for f in self.layout], params=params,
                         genesis=join.genesis, versions=self.versions, mode=self.cfg.protocol.mode,
                         apply_policy=self.cfg.apply_policy,
                         apply_at="arrival" if self.cfg.applies_on_arrival else "tau", config=to_dict(self.cfg, redact=True), **start_fields)
        self.log.info("joined", genesis=join.genesis, params=params, start_step=self.start_step,
                      fragments=self.layout.num_fragments)
        self._last_end = time.perf_counter()
        return self.start_step

    # -- each step ------------------------------------------------------------------------

    def step(self, tokens: int, loss: float | None = None, *, step_s: float | None = None) -> None:
        """Account for one inner step just taken (``tokens`` trained on, its ``loss``), answer the
        synchronizer's requests due at this boundary, and apply the merged fragments due before
        the next step. A non-finite ``loss`` puts every fragment back to its last global version.
        In the modes where learners wait for merges, a learner found behind the fleet takes the
        fleet's newest globals and its step: ``step_count`` jumps ahead, and a loop that counts its
        steps (the learning-rate schedule, the run's end) continues from it."""
        if not self.joined:
            raise SyncError("call join() before step()")
        if self._ended:
            raise SyncError("step() after end_training()/finish()")
        t0 = time.perf_counter()
        try:
            if self.ranks.world > 1:
                tokens, loss = self.ranks.agree_step(tokens, loss)
                if not self.ranks.leader:
                    self.step_count += 1
                    self.tokens += tokens
                    return self._follow()
            self._step(int(tokens), loss, step_s)
            if self.ranks.world > 1:
                self._lead()
        finally:
            self.local.time("step", t0)

    def _step(self, tokens: int, loss: float | None, step_s: float | None) -> None:
        self.local.touched = {}
        self.comm.collect()  # what the communication side left since the last boundary, read once
        self.step_count += 1
        step = self.step_count
        self.tokens += tokens
        if loss is not None and not math.isfinite(loss):
            self.heal(None, f"non-finite loss {loss}")
        else:
            self.local.trained(tokens)
        for p in self.comm.take_heals():
            self.heal([p], f"{HEAL_AFTER} contributions in a row refused for their content")
        due = ({p: 0 for p in self.schedule.due(step)} if self.learners_wait else self.comm.take_requests())
        for p, round_no in sorted(due.items()):
            frag = self.local[p]
            if not self.learners_wait and frag.answer_held(step, self.schedule.sync_every):
                self.events.emit(schema.SKIP, step=step, fragment=p, round=round_no,
                                 reason=f"its answer of step {frag.sent.step} awaits its merge")  # type: ignore[union-attr]
                continue
            self._send(p, step, round_no)
        now = time.perf_counter()
        interval, self._last_end = now - self._last_end, now
        stats = self.comm.stats
        stats.step, stats.tokens_total = step, self.tokens
        stats.step_time_s = self._pace.update(interval)  # waits for merges count: the fleet paces on them
        if step == self.start_step + 2:  # the first step's time is mostly warm-up; from the second the pace is known
            self.comm.beat_now()
        stats.tokens_per_s = tokens / stats.step_time_s if stats.step_time_s else 0.0
        # Blocking modes wait here for the merges due before the next step, but never after the
        # last one (or when draining): the other learners may be waiting for the contributions
        # that ending hands over.
        blocked = self._apply_arrivals(step + 1, wait=step < self.steps and not self.comm.draining.is_set())
        if self.learners_wait:
            self._catch_up(step)
        self.events.emit(schema.STEP, step=step, loss=loss, tokens=self.tokens,
                         step_s=interval if step_s is None else step_s, blocked_s=blocked)
        self.metrics.stepped(tokens, loss, blocked, stats.tokens_per_s, self.comm.bytes_sent, self.comm.bytes_received)

    def _catch_up(self, step: int) -> None:
        """Where learners wait for merges, a learner the fleet went on without (stopped, or cut off
        longer than the heartbeat timeout) comes back behind the fleet's last merged round: its due
        fragments belong to rounds that merged already, and the rounds the fleet waits on would wait
        for it until their timeout. It takes the newest global of every fragment it holds (its own
        progress since is dropped, as a heal drops it) and continues from the fleet's step."""
        known = self.versions
        for p, arrival in self.pending.items():
            known[p] = max(known.get(p, 0), arrival.version)
        fleet = last_merged_step(known, self.schedule)
        if fleet <= step:
            return
        self.log.warning("behind the fleet: catching up", step=step, fleet_step=fleet)
        self.local.heal([f.index for f in self.layout], step)
        for p, arrival in sorted(self.pending.items()):
            self.local.apply(p, arrival.values, arrival.version, fleet + 1, resync=True)
        self.pending.clear()
        self.step_count = min(fleet, self.steps)
        self.events.emit(schema.HEAL, step=step, fragments=[f.index for f in self.layout],
                         reason=f"behind the fleet: its last merged round is step {fleet}; continuing from there")

    def _lead(self) -> None:
        """Rank 0, after its boundary: the other ranks get its decisions, then the values."""
        self._agreed_drain = self.comm.draining.is_set()
        self.ranks.lead(self._agreed_drain, self.step_count, self.local.touched, self.versions,
                        self.layout.num_fragments)
        for p in sorted(self.local.touched):
            self.ranks.share_fragment(self.local.bound[p])

    def _follow(self) -> None:
        """Any other rank: take rank 0's decisions and values for this boundary."""
        self._agreed_drain, self.step_count, touched = self.ranks.follow(self.layout.num_fragments)
        for p, healed, version in touched:
            self.ranks.share_fragment(self.local.bound[p])
            self.local[p].version = version
            if healed:
                self.local.drop_moments(p)

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
            for p, frag in self.local.state.items():
                if frag.hand_over(step):
                    self._send(p, step, 0, hand_over=True)
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
            self.events.emit(schema.FLUSHED, all_answered=answered, pending_s=time.monotonic() - started)
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

    # -- contributions, merges and healing --------------------------------------------------

    def heal(self, fragments: list[int] | None, reason: str) -> None:
        """Put ``fragments`` (None: all) back to their base with fresh optimizer moments, fetch
        the newest global version of them, and start their counters over."""
        step = self.step_count
        fragments = [f.index for f in self.layout] if fragments is None else fragments
        self.log.warning("healing", fragments=fragments, step=step, reason=reason)
        self.local.heal(fragments, step)
        self.comm.resync(tuple(fragments))
        self.events.emit(schema.HEAL, step=step, fragments=fragments, reason=reason)

    def _send(self, p: int, step: int, round_no: int, *, hand_over: bool = False) -> None:
        frag = self.local[p]
        tokens, steps = frag.counters
        if steps == 0:
            return
        # In process mode the outer gradient is computed straight into shared memory (a slot the
        # communication process reads it from), not computed and then copied there.
        claim = self.comm.claim(self.layout[p].numel)
        try:
            current, delta = self.local.contribution(p, None if claim is None else claim.values)
            if delta is None:
                self.comm.release(claim)
                self.heal([p], "non-finite outer gradient")
                return
            if self.corrupted.is_set():  # fault injection: a hostile learner (its own model stays sound)
                delta.mul_(self.cfg.corrupt_factor)  # the contribution's own tensor
            claimed = max(1, round(tokens * self.cfg.inflate_factor)) if self.inflated.is_set() else tokens
            if self.overclaimed.is_set():  # fault injection: more work claimed, to carry a larger update
                factor = self.cfg.overclaim_factor
                delta.mul_(factor)
                claimed, steps = max(1, round(claimed * factor)), max(1, round(steps * factor))
            seq = next(self.sequence)
            # Logged before the hand-off: once handed over, the communication thread may send it, and
            # it may be merged (and answered) before this thread runs again; a "send" logged after it
            # could then be missing from the log of a learner frozen or killed in between.
            self.events.emit(schema.SEND, step=step, fragment=p, sequence=seq, base_version=frag.version,
                             tokens=claimed, steps=steps, from_step=frag.window_start, to_step=step, round=round_no,
                             hand_over=hand_over)
        except BaseException:
            self.comm.release(claim)
            raise
        t0 = time.perf_counter()
        self.comm.submit(Outgoing(p, seq, frag.version, claimed, steps, step, delta, round=round_no,
                                  hand_over=hand_over), claim)
        self.local.time("handoff", t0)
        frag.send(step, current, keep_values=self.cfg.apply_policy == "replay")

    def _apply_arrivals(self, step: int, *, wait: bool = True) -> float:
        """Apply merged fragments due at the boundary before ``step``; returns seconds blocked waiting."""
        blocked = 0.0
        if self.learners_wait and wait:
            for p, frag in self.local.state.items():
                sent = frag.sent
                if sent is not None and step > self.schedule.apply_step(sent.step) and p not in self.pending:
                    known = self.comm.peek_version(p)
                    if known is None or known <= sent.base_version:
                        t0 = time.perf_counter()
                        self.comm.wait_arrival(p, sent.base_version, self.cfg.wait_timeout_s)
                        blocked += time.perf_counter() - t0
        self.pending.update(self.comm.take_arrivals())
        for p, arrival in list(self.pending.items()):
            if self.local[p].due(step, self.schedule, resync=arrival.resync, on_arrival=self.cfg.applies_on_arrival):
                del self.pending[p]
                policy = self.local.apply(p, arrival.values, arrival.version, step, resync=arrival.resync)
                if policy is not None:
                    self.events.emit(schema.APPLY, step=step, fragment=p, version=arrival.version, policy=policy,
                                     resync=arrival.resync)
        self.blocked_s += blocked
        return blocked


__all__ = ["DecoupledSync", "SyncError", "parameter_fingerprint", "sync_config"]
