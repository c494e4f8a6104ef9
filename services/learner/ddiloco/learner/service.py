"""One learner: inner loop -> requested fragment -> outer gradient -> hand-off -> apply on arrival.

The training loop runs on the calling thread; ``Comm`` owns the network on its own thread. Per
fragment p the learner keeps its base (the last global fragment it applied, fp32, with its
version) and the counters (tokens, steps) of the progress that the next contribution carries.
The synchronizer clocks the rounds: when it asks for p, the learner answers at its next step
boundary with ``Delta = base_p - theta_p`` (fp32) and the counters, however many steps they
cover, hands it to Comm and goes on training.
Merged fragments are applied at step boundaries, ``tau`` steps after this learner sent the
fragment: a version merged from other learners' contributions while ours was not yet sent is held
until ours is on its way, so that unsent local progress is never overwritten. Decoupled mode
applies a late arrival as soon as it is there; streaming and diloco block for it, with a timeout,
and count that time as blocked.

A learner heals itself: when its loss is non-finite, when an outer gradient it is about to send is
non-finite, or when the synchronizer refused its contributions of a fragment for their content
``comm.HEAL_AFTER`` times in a row, the affected fragments go back to their base (the last
global version applied), their optimizer moments start fresh, a fetch of the newest global
version is queued, and the learner logs why and goes on. Nothing is sent from a broken state.
"""

from __future__ import annotations

import itertools
import math
import random
import threading
import time
from dataclasses import dataclass

import torch

from ddiloco.core.config import to_dict
from ddiloco.core.logs import get_logger
from ddiloco.core.modes import preset
from ddiloco.core.resources import available_cpus
from ddiloco.fragments.outer_gradient import gather, outer_gradient, scatter
from ddiloco.fragments.partition import partition_tensors
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner.apply import apply_global, counters_after_apply
from ddiloco.learner.comm import HEAL_AFTER, Arrival, Comm, Outgoing
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.data import TokenShard, eval_batches, load_corpus, shard_generator
from ddiloco.learner.events import EventLog
from ddiloco.learner.inner_loop import InnerLoop, resolve_device
from ddiloco.learner.metrics import LearnerMetrics
from ddiloco.learner.model import build_model, model_fingerprint, num_params


def fleet_progress(fleet_step: int, versions: dict[int, int], sync_every: int, steps: int) -> int:
    """The step a learner joining a fleet that is already training starts after: the further of
    the synchronizer's fleet step (its clock; it starts again from 0 when the synchronizer
    restarts) and the durable progress in the fragments' versions (each version is one round of
    ``sync_every`` steps; the least advanced fragment counts), at most ``steps``."""
    durable = min(versions.values(), default=0) * sync_every
    return max(0, min(steps, max(int(fleet_step), durable)))


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


class LearnerError(RuntimeError):
    """The learner cannot run (refused by the synchronizer, bad configuration)."""


class Learner:
    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        self.learner_id = cfg.resolved_id
        self.incarnation = random.SystemRandom().getrandbits(62) + 1
        threads = cfg.train.threads or available_cpus()
        torch.set_num_threads(threads)
        self.device = resolve_device(cfg.train.device)
        self.log = get_logger("ddiloco.learner", learner_id=self.learner_id)
        corpus = load_corpus(cfg.data)
        self.shard_index, self.num_shards = cfg.resolved_shard()
        self.shard = TokenShard(corpus.train, self.shard_index, self.num_shards)
        self.generator = shard_generator(cfg.data.seed * 1_000_003 + cfg.train.seed, self.shard_index)
        self.eval_set = eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.context, cfg.train.eval_batches)
        model = build_model(cfg.model, cfg.train.seed)
        self.fingerprint = model_fingerprint(model, cfg.model)
        self.inner = InnerLoop(model, cfg.train, self.device)
        self.params = dict(self.inner.model.named_parameters())
        p = cfg.protocol
        self.layout = partition_tensors(list(self.params.items()), p.num_fragments)
        self.schedule = FragmentSchedule(num_fragments=p.num_fragments, sync_every=p.sync_every, overlap=p.overlap)
        self.events = EventLog(cfg.event_log, learner_id=self.learner_id, incarnation=self.incarnation)
        self.base: dict[int, torch.Tensor] = {}
        self.version: dict[int, int] = {}
        self.counters: dict[int, list[int]] = {f.index: [0, 0] for f in self.layout}
        self.window_start: dict[int, int] = {f.index: 1 for f in self.layout}
        self.sent: dict[int, SentState] = {}
        self.pending: dict[int, Arrival] = {}
        self.sequence = itertools.count(1)
        self.tokens = 0
        self.blocked_s = 0.0
        self.start_step = 0
        """The step this learner joined the fleet at (its first step is the next one)."""
        self.learners_wait = preset(cfg.protocol.mode).learners_wait
        """Modes where learners wait for merges send at their own due steps (ddiloco.core.modes)."""
        self.poisoned = threading.Event()
        self.corrupted = threading.Event()
        """Set by a chaos hook (SIGUSR2): every outer gradient sent is scaled by corrupt_factor."""
        """Set by a test or chaos hook (SIGUSR1): the parameters turn NaN at the next step boundary."""
        self.metrics = LearnerMetrics()
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.metrics_host)
        self.events.observers.append(self._observe)
        self.comm = Comm(cfg, layout=self.layout, model_fingerprint=self.fingerprint, incarnation=self.incarnation,
                         events=self.events, held=lambda: dict(self.version), genesis_values=self._genesis_values)

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

    def join(self) -> bool:
        """Join the fleet (genesis upload or state fetch); False when told to drain (SIGTERM)
        before it got in, so a pod being scaled down or rolled leaves at once."""
        self.comm.start()
        timeout_s = self.cfg.join_timeout_s
        deadline = time.monotonic() + timeout_s
        while not self.comm.join.ready.wait(0.1):
            if self.comm.draining.is_set():
                self.log.info("drained before joining")
                return False
            if time.monotonic() > deadline:
                raise LearnerError(f"could not join the synchronizer at {self.cfg.synchronizer} within {timeout_s:g}s "
                                   "(learner.join_timeout_s)")
        if self.comm.join.error:
            raise LearnerError(f"synchronizer refused this learner: {self.comm.join.error}")
        if self.comm.join.genesis:
            for frag in self.layout:
                self.base[frag.index] = gather(frag, self.params)
                self.version[frag.index] = 0
        else:
            for p, (version, values) in self.comm.join.fetched.items():
                scatter(self.layout[p], values, self.params)
                self.base[p] = values.clone()
                self.version[p] = version
            if self.cfg.train.resume == "fleet":
                self.start_step = fleet_progress(self.comm.join.fleet_step, self.version,
                                                 self.cfg.protocol.sync_every, self.cfg.train.steps)
                self.inner.resume_at(self.start_step)
        self.events.emit("start", start_step=self.start_step, num_fragments=self.layout.num_fragments,
                         fragment_sizes=[f.numel for f in self.layout], params=num_params(self.inner.model),
                         genesis=self.comm.join.genesis, versions=dict(self.version), shard=self.shard_index,
                         mode=self.cfg.protocol.mode, apply_policy=self.cfg.apply_policy, speed=self.cfg.speed,
                         config=to_dict(self.cfg, redact=True))
        self.log.info("joined", genesis=self.comm.join.genesis, params=num_params(self.inner.model),
                      start_step=self.start_step,
                      fragments=self.layout.num_fragments, shard=f"{self.shard_index}/{self.num_shards}")
        return True

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> dict:
        if not self.join():
            self.comm.stop("drained")
            self.events.close()
            return {"learner_id": self.learner_id, "steps": 0, "tokens": 0, "eval_loss": None, "wall_s": 0.0,
                    "blocked_s": 0.0}
        cfg = self.cfg
        if self.start_step >= cfg.train.steps:
            self.log.info("the fleet has trained all its steps; nothing left to do", fleet_step=self.start_step,
                          steps=cfg.train.steps)
            self.comm.stop("finished")
            self.events.close()
            return {"learner_id": self.learner_id, "steps": 0, "tokens": 0, "eval_loss": None, "wall_s": 0.0,
                    "blocked_s": 0.0, "start_step": self.start_step}
        batch_tokens = cfg.data.batch_size * cfg.data.context
        step = self.start_step
        started = time.time()
        pace = StepPace()
        last_end = time.perf_counter()
        for step in range(self.start_step + 1, cfg.train.steps + 1):
            if self.poisoned.is_set():
                self.poisoned.clear()
                self._poison(step)
            blocked = self._apply_arrivals(step)
            x, y = self.shard.sample_batch(self.generator, cfg.data.batch_size, cfg.data.context)
            loss, step_s = self.inner.step(x, y)
            if cfg.speed < 1.0:  # an experiment's slower hardware: the step takes 1/speed as long
                time.sleep(step_s * (1.0 / cfg.speed - 1.0))
                step_s /= cfg.speed
            self.tokens += batch_tokens
            if not math.isfinite(loss):
                self._heal([f.index for f in self.layout], step, f"non-finite loss {loss}")
            else:
                for c in self.counters.values():
                    c[0] += batch_tokens
                    c[1] += 1
            for p in self.comm.take_heals():
                self._heal([p], step, f"{HEAL_AFTER} contributions in a row refused for their content")
            due = ({p: 0 for p in self.schedule.due(step)} if self.learners_wait
                   else self.comm.take_requests())
            for p, round_no in sorted(due.items()):
                self._send(p, step, round_no)
            now = time.perf_counter()
            stats = self.comm.stats
            stats.step, stats.tokens_total = step, self.tokens
            stats.step_time_s = pace.update(now - last_end)  # waits for merges count: the fleet paces on them
            if step == self.start_step + 2:  # the first step's time is mostly warm-up; from the second the pace is known
                self.comm.beat_now()
            stats.tokens_per_s = batch_tokens / stats.step_time_s if stats.step_time_s else 0.0
            last_end = now
            self.events.emit("step", step=step, loss=loss, tokens=self.tokens, step_s=step_s, blocked_s=blocked)
            m = self.metrics
            m.steps.inc()
            m.tokens.inc(batch_tokens)
            m.loss.set(loss)
            m.blocked.inc(blocked)
            m.tokens_per_s.set(stats.tokens_per_s)
            m.count_bytes(self.comm.bytes_sent, self.comm.bytes_received)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                self._eval(step)
            if self.comm.draining.is_set():
                self.log.info("draining", step=step)
                break
        # Hand over the progress made since each fragment's last send, so no trained step is lost
        # when the learner finishes or drains.
        for frag in self.layout:
            if self.sent.get(frag.index) is None or self.sent[frag.index].step != step:
                self._send(frag.index, step, 0)
        self.comm.training_done()
        wall = time.time() - started
        # Training ends here. The local model's final evaluation and waiting below for the last
        # contributions' results are the bookkeeping of a finite run (a deployed learner never
        # stops), so they are logged after the end.
        self.events.emit("end", step=step, tokens=self.tokens, wall_s=wall, blocked_s=self.blocked_s)
        final = self._eval(step)
        answered = self.comm.flush(timeout_s=30.0)
        self.comm.stop("finished" if not self.comm.draining.is_set() else "drained")
        self.events.emit("flushed", all_answered=answered, pending_s=time.time() - started - wall)
        self.events.close()
        return {"learner_id": self.learner_id, "steps": step - self.start_step, "tokens": self.tokens,
                "eval_loss": final, "wall_s": wall, "blocked_s": self.blocked_s, "start_step": self.start_step}

    # -- healing --------------------------------------------------------------------------

    def _poison(self, step: int) -> None:
        """The fault a test or chaos plan injects: every parameter turns NaN."""
        self.log.warning("parameters poisoned (fault injection)", step=step)
        self.events.emit("poisoned", step=step)
        with torch.no_grad():
            for param in self.params.values():
                param.fill_(float("nan"))

    def _heal(self, fragments: list[int], step: int, reason: str) -> None:
        """Put ``fragments`` back to their base with fresh optimizer moments, fetch the newest
        global version of them, and start their counters over."""
        self.log.warning("healing", fragments=fragments, step=step, reason=reason)
        state = self.inner.optimizer.state
        for p in fragments:
            frag = self.layout[p]
            scatter(frag, self.base[p], self.params)
            for spec in frag.tensors:
                state.pop(self.params[spec.name], None)
            self.counters[p] = [0, 0]
            self.window_start[p] = step + 1
            self.sent.pop(p, None)
        self.comm.resync(tuple(fragments))
        self.events.emit("heal", step=step, fragments=fragments, reason=reason)

    def _eval(self, step: int) -> float:
        loss = self.inner.evaluate(self.eval_set)
        self.events.emit("eval", step=step, tokens=self.tokens, loss=loss)
        return loss

    def _send(self, p: int, step: int, round_no: int) -> None:
        frag = self.layout[p]
        tokens, steps = self.counters[p]
        if steps == 0:
            return
        current = gather(frag, self.params)
        delta = outer_gradient(self.base[p], current)
        if not bool(torch.isfinite(delta).all()):
            self._heal([p], step, "non-finite outer gradient")
            return
        if self.corrupted.is_set():  # fault injection: a hostile learner (its own model stays sound)
            delta = delta * self.cfg.corrupt_factor
        seq = next(self.sequence)
        self.comm.submit(Outgoing(p, seq, self.version[p], tokens, steps, step, delta, round=round_no))
        self.events.emit("send", step=step, fragment=p, sequence=seq, base_version=self.version[p], tokens=tokens,
                         steps=steps, from_step=self.window_start[p], to_step=step, round=round_no)
        keep = current if self.cfg.apply_policy == "replay" else None
        self.sent[p] = SentState(step, (tokens, steps), self.version[p], keep)

    def _apply_arrivals(self, step: int) -> float:
        """Apply merged fragments due at this step boundary; returns seconds blocked waiting."""
        blocked = 0.0
        if self.learners_wait:
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
        local = gather(frag, self.params)
        reference = sent.values if (sent is not None and sent.values is not None) else self.base[p]
        new = apply_global(policy, local=local, global_=arrival.values, reference=reference,
                           alpha=self.cfg.mix_alpha)
        scatter(frag, new, self.params)
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
