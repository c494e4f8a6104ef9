"""The learner service: the built-in training loop (data shard, model, AdamW) on ``DecoupledSync``.

Everything protocol — the fragment layout, the communication thread, answering the
synchronizer's requests, applying merged fragments, healing — lives in
``ddiloco.learner.sync.DecoupledSync``, the same object a user wraps around their own training
loop; this module adds what a stand-alone learner process needs around it: the corpus shard and
its batches, the model from the config, the inner optimizer with its learning-rate schedule
(continued from the fleet's progress for a learner that joins late), periodic and final
evaluation, the ``speed`` and ``min_step_s`` knobs of experiments and tests, and the NaN fault hook
(SIGUSR1).

A learner heals itself: when its loss is non-finite, when an outer gradient it is about to send is
non-finite, or when the synchronizer refused its contributions of a fragment for their content
``mailbox.HEAL_AFTER`` times in a row, the affected fragments go back to their base (the last
global version applied), their optimizer moments start fresh, a fetch of the newest global
version is queued, and the learner logs why and goes on. Nothing is sent from a broken state.
"""

from __future__ import annotations

import json
import threading
import time

import torch

from ddiloco.core import events as schema
from ddiloco.core.config import to_dict
from ddiloco.core.logs import get_logger
from ddiloco.core.resources import available_cpus
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.sync import DecoupledSync, SyncError
from ddiloco.training.data import TokenShard, eval_batches, load_corpus, shard_generator
from ddiloco.training.inner_loop import InnerLoop, resolve_device
from ddiloco.training.model import build_model, model_fingerprint, num_params


class LearnerError(SyncError):
    """The learner cannot run (refused by the synchronizer, bad configuration)."""


class Learner:
    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        self.learner_id = cfg.resolved_id
        threads = cfg.train.threads or available_cpus()
        torch.set_num_threads(threads)
        self.device = resolve_device(cfg.train.device)
        self.log = get_logger("ddiloco.learner", learner_id=self.learner_id)
        corpus = load_corpus(cfg.data)
        self.shard_index, self.num_shards = cfg.resolved_shard()
        self.shard = TokenShard(corpus.train, self.shard_index, self.num_shards)
        self.generator = shard_generator(cfg.data.seed * 1_000_003 + cfg.train.seed, cfg.batch_stream())
        self.eval_set = eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.context, cfg.train.eval_batches)
        model = build_model(cfg.model, cfg.train.seed)
        self.fingerprint = model_fingerprint(model, cfg.model)
        self.inner = InnerLoop(model, cfg.train, self.device)
        self.sync = DecoupledSync(self.inner.model, optimizer=self.inner.optimizer, config=cfg,
                                  fingerprint=self.fingerprint,
                                  model_ref=json.dumps(to_dict(cfg.model), sort_keys=True))
        self.comm = self.sync.comm
        self.events = self.sync.events
        self.metrics = self.sync.metrics
        self.layout = self.sync.layout
        self.poisoned = threading.Event()
        """Set by a test or chaos hook (SIGUSR1): the parameters turn NaN at the next step boundary."""
        self.corrupted = self.sync.corrupted
        """Set by a chaos hook (SIGUSR2): every outer gradient sent is scaled by corrupt_factor."""

    @property
    def metrics_port(self) -> int | None:
        return self.sync.metrics_port

    @property
    def start_step(self) -> int:
        return self.sync.start_step

    def join(self) -> bool:
        """Join the fleet (genesis upload or state fetch); False when told to drain (SIGTERM)
        before it got in, so a pod being scaled down or rolled leaves at once."""
        try:
            start = self.sync.join(shard=self.shard_index, speed=self.cfg.speed)
        except SyncError as exc:
            raise LearnerError(str(exc)) from exc
        if start is None:
            return False
        if start:
            self.inner.resume_at(start)
        self.log.info("shard", shard=f"{self.shard_index}/{self.num_shards}", params=num_params(self.inner.model))
        return True

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> dict:
        summary = {"learner_id": self.learner_id, "steps": 0, "tokens": 0, "eval_loss": None, "wall_s": 0.0,
                   "blocked_s": 0.0, "start_step": 0}
        if not self.join():
            return summary
        cfg, sync = self.cfg, self.sync
        summary["start_step"] = sync.start_step
        if sync.start_step >= cfg.train.steps:
            self.log.info("the fleet has trained all its steps; nothing left to do", fleet_step=sync.start_step,
                          steps=cfg.train.steps)
            sync.close("finished")
            return summary
        batch_tokens = cfg.data.batch_size * cfg.data.context
        step = sync.start_step
        started = time.time()
        while step < cfg.train.steps:
            step += 1
            if self.poisoned.is_set():
                self.poisoned.clear()
                self._poison(step)
            began = time.perf_counter()
            x, y = self.shard.sample_batch(self.generator, cfg.data.batch_size, cfg.data.context)
            loss, step_s = self.inner.step(x, y)
            if cfg.min_step_s > 0:  # a known pace: the step lasts at least the floor
                time.sleep(max(0.0, began + cfg.min_step_s - time.perf_counter()))
                step_s = max(step_s, time.perf_counter() - began)
            if cfg.speed < 1.0:  # an experiment's slower hardware: the step takes 1/speed as long
                time.sleep(step_s * (1.0 / cfg.speed - 1.0))
                step_s /= cfg.speed
            sync.step(batch_tokens, loss, step_s=step_s)
            if sync.step_count != step:  # caught up with a fleet that went on without it (waiting modes)
                step = sync.step_count
                self.inner.resume_at(step)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                self._eval(step)
            if sync.draining:
                self.log.info("draining", step=step)
                break
        sync.end_training()
        wall = time.time() - started
        # Training ends here. The local model's final evaluation and waiting below for the last
        # contributions' results are the bookkeeping of a finite run (a deployed learner never
        # stops), so they are logged after the end.
        self.events.emit(schema.END, step=step, tokens=sync.tokens, wall_s=wall, blocked_s=sync.blocked_s)
        final = self._eval(step)
        sync.close()
        summary.update(steps=step - sync.start_step, tokens=sync.tokens, eval_loss=final, wall_s=wall,
                       blocked_s=sync.blocked_s)
        return summary

    # -- faults and evaluation ------------------------------------------------------------

    def _poison(self, step: int) -> None:
        """The fault a test or chaos plan injects: every parameter turns NaN."""
        self.log.warning("parameters poisoned (fault injection)", step=step)
        self.events.emit(schema.POISONED, step=step)
        with torch.no_grad():
            for param in self.inner.model.parameters():
                param.fill_(float("nan"))

    def _eval(self, step: int) -> float:
        loss = self.inner.evaluate(self.eval_set)
        self.events.emit(schema.EVAL, step=step, tokens=self.sync.tokens, loss=loss)
        return loss


__all__ = ["Learner", "LearnerError"]
