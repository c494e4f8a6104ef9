"""``ddiloco run --mode dp``: the data-parallel reference.

One process trains one model on the combined batch of all learners (batch_size * learners), for
the same number of steps, hence the same tokens, with the same model, data and schedule. Its
inner optimizer's learning rate and warm-up are its own tuned ones (``run_config.DP_TUNED``: 6e-3,
60 steps, for its batch three times a learner's; docs/quality.md, sections 1 and 6) unless the
config file sets ``train.lr`` / ``train.warmup_steps``, so a side-by-side with the learners' modes
is against dp at its best, as the quality study measures it. Its eval loss is the reference that
every other mode is measured against; the final one scores the whole held-out split
(``run.final_eval_batches``), as the distributed modes' global model. It writes a learner's event
log (steps and evaluations; there is nothing to send) and the global-model curve (genesis and
final points), so the summary and plots read it like any run.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

import torch

from ddiloco.core import events as schema
from ddiloco.core.config import to_dict
from ddiloco.core.resources import available_cpus
from ddiloco.lab.global_eval import HeldOut, write_point
from ddiloco.learner.config import load_learner_config
from ddiloco.learner.events import EventLog
from ddiloco.training.data import TokenShard, eval_batches, load_corpus, shard_generator
from ddiloco.training.inner_loop import InnerLoop, evaluate, resolve_device
from ddiloco.training.model import build_model, num_params


def run_dp(doc: dict[str, Any], out: pathlib.Path, show_progress: bool = False) -> dict[str, Any]:
    from tqdm import tqdm

    n = int(doc["run"]["learners"])
    cfg = load_learner_config(str(out / "config.yaml"), learner_id="dp")
    data = dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * n)
    torch.set_num_threads(cfg.train.threads or available_cpus())
    device = resolve_device(cfg.train.device)
    corpus = load_corpus(cfg.data)
    shard = TokenShard(corpus.train, 0, 1)
    generator = shard_generator(cfg.data.seed * 1_000_003 + cfg.train.seed, 0)
    evals = eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.context, cfg.train.eval_batches)
    model = build_model(cfg.model, cfg.train.seed)
    inner = InnerLoop(model, cfg.train, device)
    (out / "learners").mkdir(exist_ok=True)
    events = EventLog(str(out / "learners" / "dp.jsonl"), learner_id="dp", incarnation=1)
    events.emit(schema.START, num_fragments=1, fragment_sizes=[num_params(model)], params=num_params(model),
                genesis=True, mode="dp", config=to_dict(cfg, redact=True))
    write_point(out, 0, evaluate(inner.model, evals, device), 0)
    started = time.time()
    tokens = 0
    batch_tokens = data.batch_size * data.context
    steps = cfg.train.steps
    for step in tqdm(range(1, steps + 1), disable=not show_progress, desc=f"dp x{n}", unit="step"):
        x, y = shard.sample_batch(generator, data.batch_size, data.context)
        loss, step_s = inner.step(x, y)
        tokens += batch_tokens
        events.emit(schema.STEP, step=step, loss=loss, tokens=tokens, step_s=step_s, blocked_s=0.0)
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < steps:
            events.emit(schema.EVAL, step=step, tokens=tokens, loss=inner.evaluate(evals))
    final_batches = HeldOut(corpus.eval, cfg.data.batch_size, cfg.data.context,
                             int(doc["run"]["final_eval_batches"]))
    final = evaluate(inner.model, final_batches, device)  # type: ignore[arg-type]
    write_point(out, tokens, final, steps, final=True)
    events.emit(schema.EVAL, step=steps, tokens=tokens, loss=inner.evaluate(evals))
    wall = time.time() - started
    events.emit(schema.END, step=steps, tokens=tokens, eval_loss=final, wall_s=wall, blocked_s=0.0)
    events.close()
    return {"final_eval_loss": final, "final_eval": final_batches.describe(), "wall_s": wall, "failed_learners": {},
            "status": {}}
