"""The reference fleet: M learners and the synchronizer's rules in one process, deterministic.

A distributed run (``ddiloco run``) measures the system; its eval loss moves by a few percent from
run to run because learners that share a small machine run at different speeds. This module
measures the *algorithm* the system runs, with every rule taken from the libraries the services
use, so a reference result and a service result differ only in timing:

- inner steps: ``InnerLoop`` (AdamW, warm-up, cosine), the learner's data shards and batches;
- schedule: ``FragmentSchedule`` (fragment p falls due at ``t mod H == floor(p*H/P)``, its merge
  is applied ``tau`` steps after sending, or with ``apply_at: arrival`` one step after: every
  merge comes back at once here, and a learner applies one at the first boundary after it
  arrived); the synchronizer asks every learner at the due step, and learners of equal speed all
  answer at that boundary;
- contribution: ``gather``, ``outer_gradient``, the learner's codec with ``ErrorFeedback``; the
  bytes of every payload are counted;
- merge: ``token_weights``, ``merge_deltas`` (RDA, embeddings by the mean), ``reanchor`` for a
  contribution against an older version, ``OuterNesterov``; the merged fragment is sent back in
  the global codec and each learner applies what it decodes (``apply_global``,
  ``counters_after_apply``);
- the end: each learner hands over the progress since each fragment's last send (re-anchored
  where a merge was still in flight), as ``DecoupledSync.end_training`` does; a merge of
  hand-overs only takes no momentum unless ``hand_over_momentum`` (the synchronizer's rule), and
  the final global model is evaluated on the case's held-out set: the whole split by default, as
  ``ddiloco run``'s final evaluation (``global_eval.HeldOut``); the curve's points on 8 evenly
  spaced batches, as the run's periodic ones.

``dp`` trains one model on the combined batch for the same steps. Its bytes per token are what a
ring all-reduce of fp32 gradients across M learners would send: ``2 (M-1) N * 4`` bytes a step.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.algorithm.learner_fragment import LearnerFragment
from ddiloco.algorithm.merge import embedding_mask, merge_deltas, reanchor
from ddiloco.algorithm.outer_optimizer import OuterNesterov
from ddiloco.algorithm.policies import token_weights
from ddiloco.fragments.codec import make_codec
from ddiloco.fragments.error_feedback import ErrorFeedback
from ddiloco.fragments.outer_gradient import gather, outer_gradient, scatter
from ddiloco.fragments.partition import FragmentLayout, partition_tensors
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.lab.global_eval import HeldOut
from ddiloco.lab.study.case import CONTEXT, Case, running_python
from ddiloco.training.config import TrainConfig
from ddiloco.training.data import DataConfig, TokenShard, eval_batches, load_corpus, shard_generator
from ddiloco.training.inner_loop import InnerLoop, evaluate
from ddiloco.training.model import ModelConfig, build_model, num_params

MODELS: dict[str, dict[str, Any]] = {
    "default": {},
    "m5": {"d_model": 256, "n_layer": 6, "n_head": 8},
    "moe": {"kind": "moe"},
}
CURVE_BATCHES = 8
"""Evenly spaced held-out batches of each point of a case's curve (``ddiloco run``'s periodic
evaluations read ``train.eval_batches``, 8, the same way)."""
STALENESS_WINDOW = 4
"""Versions of each fragment retained for re-anchoring (the synchronizer's default window)."""

Progress = Callable[[int, int], None]


def run_case(case: Case, progress: Progress | None = None) -> dict[str, Any]:
    """Train ``case`` and return its result: the case's settings, ``final_eval_loss``, bytes sent
    each way, ``bytes_per_token``, the loss curve and the wall time."""
    started = time.perf_counter()
    if case.python != running_python():
        raise ValueError(f"case {case.id} is for Python {case.python}; this is {running_python()} (its stdlib "
                         "corpus is another)")
    data = data_config(case)
    model_cfg = ModelConfig(context=CONTEXT, **MODELS[case.model])
    train = TrainConfig(steps=case.steps, lr=case.inner_lr, warmup_steps=case.warmup_steps,
                        min_lr_ratio=case.min_lr_ratio, seed=case.seed)
    corpus = load_corpus(data)
    evals = HeldOut(corpus.eval, data.batch_size, CONTEXT, case.eval_batches)
    curve_evals = eval_batches(corpus.eval, data.batch_size, CONTEXT, CURVE_BATCHES)
    runner = _DataParallel(case, model_cfg, train, corpus) if case.mode == "dp" else \
        _Fleet(case, model_cfg, train, corpus)
    marks = {round(case.steps * k / case.curve_points) for k in range(1, case.curve_points)} if case.curve_points else set()
    curve: list[tuple[int, float]] = [(0, evaluate(runner.global_model(), curve_evals, runner.device))]
    for step in range(1, case.steps + 1):
        runner.step(step)
        if step in marks:
            curve.append((step * case.learners * case.batch_size * CONTEXT,
                          evaluate(runner.global_model(), curve_evals, runner.device)))
        if progress is not None:
            progress(step, case.steps)
    runner.finish()
    final = evaluate(runner.global_model(), evals, runner.device)  # type: ignore[arg-type]
    curve.append((case.tokens, evaluate(runner.global_model(), curve_evals, runner.device)))
    mean_model = runner.learner_mean_model()
    learner_mean = None if mean_model is None else evaluate(mean_model, evals, runner.device)  # type: ignore[arg-type]
    up, down = runner.bytes_up, runner.bytes_down
    return {**case.settings(), "id": case.id, "final_eval_loss": final, "learner_mean_eval_loss": learner_mean,
            "final_eval": evals.describe(), "curve_eval": {"split": "spaced", "batches": CURVE_BATCHES},
            "python_version": platform.python_version(), "params": runner.params,
            "tokens": case.tokens, "bytes_up": up, "bytes_down": down,
            "bytes_per_token": (up + down) / case.tokens, "merges": runner.merges, "stale_rows": runner.stale_rows,
            "curve": curve, "wall_s": time.perf_counter() - started, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def data_config(case: Case) -> DataConfig:
    """The data section of ``case``: ``ddiloco run``'s (its seed lays out a shuffled corpus)."""
    settings: dict[str, Any] = {"batch_size": case.batch_size, "context": CONTEXT, "seed": case.seed}
    if hasattr(DataConfig(), "order"):
        settings["order"] = case.data_order
    elif case.data_order != "contiguous":
        raise ValueError(f"data_order {case.data_order!r}: this version's corpus is laid out contiguously only")
    return DataConfig(**settings)


class _DataParallel:
    """One model, the combined batch of M learners, sampling the whole training split."""

    def __init__(self, case: Case, model_cfg: ModelConfig, train: TrainConfig, corpus: Any) -> None:
        self.case = case
        self.device = torch.device("cpu")
        self.model = build_model(model_cfg, case.seed)
        self.inner = InnerLoop(self.model, train, self.device)
        self.shard = TokenShard(corpus.train, 0, 1)
        self.gen = shard_generator(case.seed, 0)
        self.params = num_params(self.model)
        m = case.learners
        self.bytes_per_step = 2 * (m - 1) * self.params * 4
        self.bytes_up = self.bytes_down = 0
        self.merges = self.stale_rows = 0

    def global_model(self) -> torch.nn.Module:
        return self.model

    def step(self, step: int) -> None:
        self.inner.step(*self.shard.sample_batch(self.gen, self.case.batch_size * self.case.learners, CONTEXT))
        self.bytes_up += self.bytes_per_step // 2
        self.bytes_down += self.bytes_per_step - self.bytes_per_step // 2

    def finish(self) -> None:
        pass

    def learner_mean_model(self) -> None:
        return None


@dataclass
class _Learner:
    """One learner's training state and its per-fragment protocol state (``DecoupledSync``'s)."""

    inner: InnerLoop
    shard: TokenShard
    gen: torch.Generator
    params: dict[str, torch.Tensor]
    frags: list[LearnerFragment]
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)
    held: dict[int, tuple[torch.Tensor, int, tuple[int, int]]] = field(default_factory=dict)
    """late learners: fragment -> (sent values, base version, counters) waiting for the next round."""


class _Fleet:
    """M learners and one synchronizer, stepped in lock-step."""

    def __init__(self, case: Case, model_cfg: ModelConfig, train: TrainConfig, corpus: Any) -> None:
        self.case = case
        self.device = torch.device("cpu")
        self.model = build_model(model_cfg, case.seed)
        self.params = num_params(self.model)
        named = dict(self.model.named_parameters())
        self.layout: FragmentLayout = partition_tensors(list(named.items()), case.fragments)
        # every merge is back at once: on arrival, a learner applies it one step after the send
        self.schedule = FragmentSchedule(num_fragments=case.fragments, sync_every=case.sync_every,
                                         overlap=1 if case.apply_at == "arrival" else case.overlap)
        self.segments = [[(s, e) for _, s, e in frag.segments()] for frag in self.layout]
        self.embedding = [embedding_mask(frag) for frag in self.layout]
        genesis = [gather(frag, named) for frag in self.layout]
        self.theta = [g.clone() for g in genesis]
        self.momentum = [torch.zeros_like(g) for g in genesis]
        self.version = [0] * case.fragments
        self.outer_steps = [0] * case.fragments
        self.history: list[dict[int, torch.Tensor]] = [{0: g.clone()} for g in genesis]
        self.codec = make_codec(case.codec, threads=1)
        self.global_codec = make_codec(case.global_codec, threads=1)
        self.learners: list[_Learner] = []
        for i in range(case.learners):
            model = build_model(model_cfg, case.seed)
            params: dict[str, torch.Tensor] = dict(model.named_parameters())
            self.learners.append(_Learner(
                inner=InnerLoop(model, train, self.device),
                shard=TokenShard(corpus.train, i, case.data_shards),
                gen=shard_generator(case.seed, i),
                params=params, frags=[LearnerFragment(p, g.clone()) for p, g in enumerate(genesis)]))
        self.arrivals: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        """step after which to apply -> [(fragment, version, decoded values)]"""
        self.bytes_up = self.bytes_down = 0
        self.merges = self.stale_rows = 0
        self.tokens_per_step = case.batch_size * CONTEXT

    # -- the global model -------------------------------------------------------------------

    def global_model(self) -> torch.nn.Module:
        named = dict(self.model.named_parameters())
        for frag, values in zip(self.layout, self.theta, strict=True):
            scatter(frag, values, named)
        return self.model

    def learner_mean_model(self) -> torch.nn.Module:
        """The plain mean of the learners' final models (what an end without an outer step
        would give): beside the final global model, it shows what the last outer step does."""
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, param in named.items():
                param.copy_(torch.stack([learner.params[name].detach() for learner in self.learners]).mean(0))
        return self.model

    # -- one fleet step ---------------------------------------------------------------------

    def step(self, step: int) -> None:
        case = self.case
        for learner in self.learners:
            learner.inner.step(*learner.shard.sample_batch(learner.gen, case.batch_size, CONTEXT))
            for frag in learner.frags:
                frag.trained(self.tokens_per_step)
        for p in self.schedule.due(step):
            rows = [row for i, learner in enumerate(self.learners)
                    if (row := self._contribution(learner, p, step, late=i < case.late)) is not None]
            if rows:
                self._merge(p, rows, step)
                self.arrivals.setdefault(self.schedule.apply_step(step), []).append(
                    (p, self.version[p], self._broadcast(p)))
        for p, version, values in self.arrivals.pop(step, []):
            for learner in self.learners:
                self._apply(learner, p, version, values, step)

    def finish(self) -> None:
        """Every learner hands over the progress since each fragment's last send; one last merge
        per fragment (the arrivals still due are never applied: training is over)."""
        step = self.case.steps
        for p in range(self.case.fragments):
            rows = [row for learner in self.learners if learner.frags[p].hand_over(step)
                    and (row := self._contribution(learner, p, step, late=False)) is not None]
            held = [self._release(learner, p) for learner in self.learners if p in learner.held]
            if rows or held:  # hand-overs only: the synchronizer's rule for their momentum
                self._merge(p, rows + held, step, hand_overs=not held)

    # -- learner side -------------------------------------------------------------------------

    def _contribution(self, learner: _Learner, p: int, step: int, *, late: bool
                      ) -> tuple[torch.Tensor, int, tuple[int, int]] | None:
        """What ``learner`` sends for fragment ``p`` (values as decoded, base version, counters);
        a late learner's previous one instead (its new one waits for the next round)."""
        state = learner.frags[p]
        tokens, steps = state.counters
        if steps == 0:
            return None
        frag = self.layout[p]
        current = gather(frag, learner.params)
        delta = outer_gradient(state.base, current)
        if self.case.error_feedback:
            payload, sent = learner.feedback.encode(p, delta, self.codec)
        else:
            payload = self.codec.encode(delta)
            sent = self.codec.decode(payload, delta.numel())
        self.bytes_up += len(payload)
        state.send(step, current, keep_values=self.case.apply == "replay")
        row = (sent, state.version, (tokens, steps))
        if not late:
            return row
        previous = self._release(learner, p) if p in learner.held else None
        learner.held[p] = row
        return previous

    def _release(self, learner: _Learner, p: int) -> tuple[torch.Tensor, int, tuple[int, int]]:
        return learner.held.pop(p)

    def _apply(self, learner: _Learner, p: int, version: int, values: torch.Tensor, step: int) -> None:
        frag = self.layout[p]
        new = learner.frags[p].apply(self.case.apply, local=gather(frag, learner.params), values=values,
                                     version=version, step=step, alpha=self.case.mix_alpha)
        if new is not None:
            scatter(frag, new, learner.params)

    # -- synchronizer side --------------------------------------------------------------------

    def _merge(self, p: int, rows: list[tuple[torch.Tensor, int, tuple[int, int]]], step: int, *,
               hand_overs: bool = False) -> None:
        case = self.case
        current = self.theta[p]
        deltas = torch.stack([values for values, _, _ in rows])
        for r, (_, base, _) in enumerate(rows):
            if base != self.version[p]:
                if self.version[p] - base > STALENESS_WINDOW:
                    raise RuntimeError(f"fragment {p}: a contribution {self.version[p] - base} versions stale")
                if case.anchor == "point":
                    reanchor(deltas[r], current, self.history[p][base])
                self.stale_rows += 1
        if case.token_weights:
            weights = token_weights([c[0] for _, _, c in rows], [c[1] for _, _, c in rows])
        else:
            weights = [1.0 / len(rows)] * len(rows)
        merged = merge_deltas(deltas, weights, self.segments[p], self.embedding[p], case.merge)
        self.outer_steps[p] += 1
        lr = outer_lr(case, step)
        outer = OuterNesterov(lr=lr, momentum=case.outer_momentum, momentum_warmup=case.momentum_warmup)
        outer = outer.at(self.outer_steps[p])
        if hand_overs and not case.hand_over_momentum:
            outer = dataclasses.replace(outer, momentum=0.0)
        outer.step(current, self.momentum[p], merged)
        self.version[p] += 1
        self.history[p][self.version[p]] = current.clone()
        self.history[p].pop(self.version[p] - STALENESS_WINDOW - 1, None)
        self.merges += 1

    def _broadcast(self, p: int) -> torch.Tensor:
        payload = self.global_codec.encode(self.theta[p])
        self.bytes_down += len(payload) * self.case.learners
        return self.global_codec.decode(payload, self.theta[p].numel())


def outer_lr(case: Case, step: int) -> float:
    """The outer learning rate of a merge at fleet ``step`` (the case's schedule)."""
    progress = min(1.0, step / case.steps)
    floor = case.outer_lr * case.outer_lr_min
    if case.outer_schedule == "cosine":
        lr = floor + (case.outer_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    elif case.outer_schedule == "linear":
        lr = case.outer_lr - (case.outer_lr - floor) * progress
    else:
        lr = case.outer_lr
    return lr
