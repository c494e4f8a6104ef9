"""``ddiloco bench quality``: single-process reference runs of the algorithm, without timing noise.

The distributed runs (``ddiloco run``) measure the system; their eval loss moves by several
percent from run to run because learners sharing a small machine run at different speeds, which
changes which contributions are stale. This benchmark measures the *algorithm* on the same model,
data, inner loop, merge (token-weighted RDA) and outer optimizer, deterministically, in one
process:

- ``dp``: one model, the combined batch of M learners, the same steps (the same tokens);
- ``diloco``: M replicas on disjoint shards, every H steps the outer gradients are merged and one
  Nesterov step is taken on the global model, which every replica then continues from.
  ``--late N`` makes the first N replicas' outer gradients reach the merge one round late (a
  straggler pattern the decoupled system shows all the time): the late replica continues from a
  global model that lacks its own last contribution, which joins the next merge either re-anchored
  to its model (``--anchor point``: Delta + Theta_now - Theta_base) or as is (``--anchor delta``).

Each case prints one JSON line and all of them are saved to ``--out``. A case takes about as long
as the distributed run it mirrors (1,800 inner steps of the default model: ~4 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from dataclasses import dataclass

import torch

CASES = ("dp", "diloco")


@dataclass(frozen=True, kw_only=True)
class Case:
    mode: str = "diloco"
    learners: int = 3
    steps: int = 600
    sync_every: int = 24
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    inner_lr: float = 3e-3
    late: int = 0
    anchor: str = "point"
    merge: str = "rda"
    seed: int = 0
    eval_batches: int = 32

    def __post_init__(self) -> None:
        if self.mode not in CASES:
            raise ValueError(f"mode must be one of {CASES}, got {self.mode!r}")
        if self.learners < 1 or self.steps < 1 or self.sync_every < 1:
            raise ValueError("learners, steps and sync_every must be >= 1")
        if not 0 <= self.late < self.learners:
            raise ValueError(f"late must be in [0, learners), got {self.late}")
        if self.anchor not in ("point", "delta"):
            raise ValueError(f"anchor must be 'point' or 'delta', got {self.anchor!r}")


def run_case(case: Case) -> dict:
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from ddiloco.algorithm.merge import embedding_mask, merge_deltas
    from ddiloco.algorithm.outer_optimizer import OuterNesterov
    from ddiloco.algorithm.policies import token_weights
    from ddiloco.fragments.partition import partition_tensors
    from ddiloco.learner.config import TrainConfig
    from ddiloco.learner.data import DataConfig, TokenShard, eval_batches, load_corpus, shard_generator
    from ddiloco.learner.inner_loop import InnerLoop, evaluate
    from ddiloco.learner.model import ModelConfig, build_model

    data, model_cfg = DataConfig(), ModelConfig()
    train = TrainConfig(steps=case.steps, lr=case.inner_lr, seed=case.seed)
    cpu = torch.device("cpu")
    corpus = load_corpus(data)
    evals = eval_batches(corpus.eval, data.batch_size, data.context, case.eval_batches)
    m = case.learners
    started = time.perf_counter()
    if case.mode == "dp":
        model = build_model(model_cfg, case.seed)
        inner = InnerLoop(model, train, cpu)
        shard, gen = TokenShard(corpus.train, 0, 1), shard_generator(case.seed * 1_000_003 + case.seed, 0)
        for _ in range(case.steps):
            inner.step(*shard.sample_batch(gen, data.batch_size * m, data.context))
        loss = evaluate(model, evals, cpu)
        return {**case.__dict__, "final_eval_loss": loss, "wall_s": time.perf_counter() - started}

    glob_model = build_model(model_cfg, case.seed)
    replicas = [build_model(model_cfg, case.seed) for _ in range(m)]
    inners = [InnerLoop(r, train, cpu) for r in replicas]
    shards = [TokenShard(corpus.train, i, m) for i in range(m)]
    gens = [shard_generator(case.seed * 1_000_003 + case.seed, i) for i in range(m)]
    layout = partition_tensors(list(glob_model.named_parameters()), 1)
    segments = [(s, e) for _, s, e in layout[0].segments()]
    emb = embedding_mask(layout[0])
    glob = parameters_to_vector(glob_model.parameters()).detach().clone()
    momentum = torch.zeros_like(glob)
    outer = OuterNesterov(lr=case.outer_lr, momentum=case.outer_momentum)
    bases = [glob.clone() for _ in range(m)]
    held: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * m
    stale_rows = 0
    for step in range(1, case.steps + 1):
        for i in range(m):
            inners[i].step(*shards[i].sample_batch(gens[i], data.batch_size, data.context))
        if step % case.sync_every and step != case.steps:
            continue
        rows = []
        for i, r in enumerate(replicas):
            delta = bases[i] - parameters_to_vector(r.parameters()).detach()
            if i < case.late and step != case.steps:
                pending = held[i]
                if pending is not None:
                    old, old_base = pending
                    rows.append(old + (glob - old_base) if case.anchor == "point" else old)
                    stale_rows += 1
                held[i] = (delta, bases[i].clone())
            else:
                pending = held[i]
                if i < case.late and pending is not None:  # the last round: both arrive
                    old, old_base = pending
                    delta = delta + (old + (glob - old_base) if case.anchor == "point" else old)
                rows.append(delta)
        if rows:
            tokens = [data.batch_size * data.context * case.sync_every] * len(rows)
            weights = token_weights(tokens, [case.sync_every] * len(rows))
            merged = merge_deltas(torch.stack(rows), weights, segments, emb, case.merge)
            outer.step(glob, momentum, merged)
        for i, r in enumerate(replicas):
            vector_to_parameters(glob.clone(), r.parameters())
            bases[i] = glob.clone()
    vector_to_parameters(glob, glob_model.parameters())
    loss = evaluate(glob_model, evals, cpu)
    return {**case.__dict__, "final_eval_loss": loss, "stale_rows": stale_rows,
            "wall_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco bench quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="dp,diloco",
                        help="comma-separated cases, each a mode with optional :key=value settings, e.g. "
                             "'dp,diloco,diloco:late=1:anchor=delta,diloco:outer_lr=0.5'")
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--out", default="bench-results/quality.json", help="JSON results file")
    args = parser.parse_args(argv)
    fields = {f for f in Case.__dataclass_fields__}
    cases = []
    try:
        for spec in [c for c in args.cases.split(",") if c.strip()]:
            mode, *opts = spec.strip().split(":")
            kw: dict = {"mode": mode, "learners": args.learners, "steps": args.steps}
            for opt in opts:
                key, _, value = opt.partition("=")
                if key not in fields or key == "mode":
                    parser.error(f"unknown case setting {key!r}; known: {', '.join(sorted(fields - {'mode'}))}")
                kind = type(getattr(Case(), key))
                kw[key] = kind(value)
            cases.append(Case(**kw))
    except ValueError as exc:
        parser.error(str(exc))
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    results = []
    for case in cases:
        result = run_case(case)
        results.append(result)
        print(json.dumps(result), flush=True)
    dp = next((r["final_eval_loss"] for r in results if r["mode"] == "dp"), None)
    if dp is not None:
        for r in results:
            r["vs_dp"] = r["final_eval_loss"] / dp - 1
            print(f"{r['mode']:>7} late={r['late']} anchor={r['anchor']:<5} H={r['sync_every']:<3} "
                  f"outer_lr={r['outer_lr']:<4} loss {r['final_eval_loss']:.4f}  vs dp {r['vs_dp']:+.1%}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results, "torch": torch.__version__, "threads": args.threads}, indent=2))
    print(f"saved {out}")
    return 0
