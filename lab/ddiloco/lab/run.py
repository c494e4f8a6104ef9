"""``ddiloco run``: the whole system on one machine, as real processes on loopback.

One synchronizer process (or one per shard, ``--shards``) and N learner processes, started with the same commands a deployment
uses, share one resolved config file in the run folder. The orchestrator only watches: it tails
the learners' event logs for the progress bar, asks the synchronizer for its status, and at the
end fetches the global model over gRPC to evaluate it. ``--mode dp`` is the data-parallel
reference instead: one process training one model on the combined batch for the same number of
steps (the same tokens), at its own tuned learning rate and warm-up (``run_config.DP_TUNED``)
unless the config file sets ``train.lr`` / ``train.warmup_steps``. Every mode's final evaluation
scores the whole held-out split (``run.final_eval_batches: 0``); ``summary.json`` records the set
(``final_eval``) and the learning rate each run trained at and why (``train``).

The run folder holds ``config.yaml``, ``summary.json``, ``synchronizer.jsonl`` (synchronizer;
``synchronizer-<s>.jsonl`` per shard),
``learners/*.jsonl`` (one per learner), process logs, the synchronizer's state dir, and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import platform
import signal
import sys
import time
from typing import Any

import yaml

from ddiloco.core import events as schema
from ddiloco.core.config import read_document
from ddiloco.lab.chaos import FaultPlan
from ddiloco.lab.event_logs import Tail
from ddiloco.lab.procs import exit_on_sigterm
from ddiloco.lab.run_config import DEFAULT, FROM_CONFIG, RUN_MODES, TUNED, resolve, train_sources, validate


def run_distributed(doc: dict[str, Any], out: pathlib.Path, show_progress: bool,
                    plan: FaultPlan | None = None) -> dict[str, Any]:
    from tqdm import tqdm

    from ddiloco.lab.cluster import LocalCluster
    from ddiloco.lab.global_eval import EvalCurve, GlobalModelEval

    run = doc["run"]
    n, steps = int(run["learners"]), int(run["steps"])
    cfg_path = out / "config.yaml"
    cluster = LocalCluster(out, cfg_path, learners=n, steps=steps, plan=plan,
                           speeds=dict(run.get("learner_speed") or {}), shards=int(run.get("shards", 1)))
    trained = [0]  # the fleet's tokens so far, for the evaluator's thread
    curve = EvalCurve(out, GlobalModelEval(cfg_path, batches=int(doc["train"]["eval_batches"]),
                                           final_batches=int(run["final_eval_batches"])),
                      target=lambda: cluster.target, tokens=lambda: trained[0],
                      every_s=float(run.get("global_eval_every_s", 0) or 0))
    started = time.time()
    try:
        cluster.start_synchronizer()
        curve.start()
        for i in range(n):
            cluster.start_learner(f"learner-{i}", initial=True)
        joined: set[str] = set()
        chaos_started_t: float | None = None
        tails: dict[str, Tail] = {}
        merges_tails = [Tail(path) for path in cluster.merge_logs()]
        bar = tqdm(total=n * steps, unit="step", disable=not show_progress, dynamic_ncols=True,
                   desc=f"{run['mode']} x{n}" + (" chaos" if plan else ""))
        done: dict[tuple[str, int], int] = {}
        last_loss: dict[str, float] = {}
        merges = 0
        batch_tokens = int(doc["data"]["batch_size"]) * int(doc["data"]["context"])

        def read_tails() -> None:
            for lid in cluster.learners():
                tail = tails.setdefault(lid, Tail(out / "learners" / f"{lid}.jsonl"))
                for e in tail.read():
                    if e["event"] == schema.START:
                        joined.add(lid)
                    if e["event"] == schema.STEP:
                        done[(lid, e["incarnation"])] = e["step"]
                        last_loss[lid] = e["loss"]
            trained[0] = sum(done.values()) * batch_tokens

        while True:
            read_tails()
            merges += sum(1 for tail in merges_tails for e in tail.read() if e.get("event") == schema.MERGE)
            alive = cluster.alive_learners()
            bar.n = min(bar.total, sum(done.values()))
            loss = sum(last_loss.values()) / len(last_loss) if last_loss else float("nan")
            tokens = trained[0]
            bar.set_postfix(tokens=f"{tokens / 1e6:.2f}M", loss=f"{loss:.3f}", merges=merges, live=len(alive),
                            refresh=False)
            bar.refresh()
            if plan is not None and chaos_started_t is None and len(joined) >= n:
                cluster.start_chaos()  # fault times count from the moment every learner trains
                chaos_started_t = time.time()
            if cluster.finished():
                break
            for name in cluster.synchronizer_names():
                sync = cluster.procs[name]
                if plan is None and sync.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {sync.returncode} during the run")
            time.sleep(0.5)
        bar.close()
        read_tails()  # the last steps of whoever finished after the loop's last look
        if cluster.driver is not None:
            cluster.driver.stop()
        failed = {lid: cluster.procs[lid].returncode for lid in cluster.learners()
                  if cluster.procs[lid].returncode not in (0, -signal.SIGKILL)}
        final = curve.finish(trained[0])
        final_eval = curve.evaluator.final_batches.describe()
        status = _status(cluster.target)
        faults = cluster.driver.injected if cluster.driver is not None else []
    finally:
        curve.stop()
        cluster.stop_all()
    wall = time.time() - started
    return {"final_eval_loss": final, "final_eval": final_eval, "wall_s": wall, "failed_learners": failed,
            "status": status, "faults_injected": faults, "chaos_started_t": chaos_started_t}


def _status(target: str) -> dict[str, Any]:
    """The synchronizer's status; with shards, the first shard's with the refusals of all."""
    from ddiloco.core.config import to_dict
    from ddiloco.protocol.client import get_status
    from ddiloco.protocol.shards import synchronizer_targets

    async def every_shard() -> list[Any]:  # one after another: grpc's poller outlives a loop of concurrent calls
        return [await get_status(t) for t in synchronizer_targets(target)]

    replies = [to_dict(reply) for reply in asyncio.run(every_shard())]
    status = dict(replies[0])
    refused: dict[str, int] = {}
    for reply in replies:
        for reason, n in (reply.get("rejected_by_reason") or {}).items():
            refused[reason] = refused.get(reason, 0) + n
    status["rejected_by_reason"] = refused
    if len(replies) > 1:
        status["shards"] = replies
    return status


def train_record(doc: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    """The inner learning rate and warm-up a run trains at, and where each came from
    (``run_config.train_sources``): the config file (``config``), dp's tuned default (``dp tuned
    default``) or the learners' (``default``)."""
    from ddiloco.learner.config import learner_config

    train = learner_config(doc, synchronizer="127.0.0.1:1", learner_id="x").train
    return {"lr": train.lr, "lr_from": sources["lr"], "warmup_steps": train.warmup_steps,
            "warmup_steps_from": sources["warmup_steps"]}


def describe_train(mode: str, train: dict[str, Any]) -> str:
    """One line saying what learning rate a run trains at and why."""
    from ddiloco.lab.run_config import DP_TUNED
    from ddiloco.training.config import TrainConfig

    def why(key: str, tuned: Any) -> str:
        source = train[f"{key}_from"]
        if source == TUNED:
            return "dp's tuned default, docs/quality.md sections 1 and 6"
        if source == FROM_CONFIG:
            return "the config file's" + (f"; dp's tuned default is {tuned}" if mode == "dp" else "")
        return "the default" if source == DEFAULT else source

    learners = TrainConfig()
    line = (f"{mode} trains at lr {train['lr']:g} ({why('lr', f'{DP_TUNED.lr:g}')}), warm-up "
            f"{train['warmup_steps']} steps ({why('warmup_steps', DP_TUNED.warmup_steps)})")
    if mode == "dp":
        line += f"; the learners' modes default to lr {learners.lr:g}, warm-up {learners.warmup_steps}"
    return line


def summarize(doc: dict[str, Any], out: pathlib.Path, result: dict[str, Any]) -> dict[str, Any]:
    from ddiloco.lab.event_logs import load_jsonl, synchronizer_logs
    from ddiloco.lab.global_eval import read_curve
    from ddiloco.lab.goodput import fleet_summary
    from ddiloco.lab.invariants import check as check_invariants
    from ddiloco.training.data import load_corpus, unigram_entropy

    run = doc["run"]
    logs = {p.stem: load_jsonl(p) for p in sorted((out / "learners").glob("*.jsonl"))}
    # every shard's merge log, one after another (a sharded run has synchronizer-<s>.jsonl)
    sync_logs = [(shard, load_jsonl(path)) for shard, path in synchronizer_logs(out)]
    merge_log = [e for _, log in sync_logs for e in log]
    fleet = fleet_summary(logs, merge_log)
    replies = (result.get("status") or {}).get("shards") or []
    per_shard = []
    for shard, log in sync_logs:  # each shard's merges on their own: one shard's outage is not the fleet's
        if shard is None:
            continue
        of_shard = fleet_summary(logs, log)
        per_shard.append({"shard": str(shard), "merges": of_shard.get("merges"),
                          "max_merge_gap_s": of_shard.get("max_merge_gap_s"),
                          "restart_to_first_merge_s": of_shard.get("restart_to_first_merge_s", []),
                          # each shard counts the fleet's steps itself (replies are in shard order)
                          "fleet_step": replies[shard].get("fleet_step") if shard < len(replies) else None})
    if per_shard:  # a shard's restart is measured to its own first merge, not the next shard's
        fleet["restart_to_first_merge_s"] = [t for shard in per_shard for t in shard["restart_to_first_merge_s"]]
    if run["mode"] == "dp":
        # One process training the one model: every step is in the model when it ends. There is
        # nothing to merge, so the merge-based measures do not apply.
        fleet.update(learner_goodput=fleet.get("compute_share"), global_downtime_s=0.0, max_merge_gap_s=None)
    # over every incarnation: a restarted learner counts its steps from 1 again
    tokens = int(fleet.get("tokens") or 0)
    steps = int(fleet.get("steps") or 0)
    from ddiloco.learner.config import load_learner_config

    data_cfg = load_learner_config(str(out / "config.yaml"), learner_id="x").data
    status = result.get("status") or {}
    return {
        "mode": run["mode"],
        "learners": int(run["learners"]),
        "steps": steps,
        "steps_per_learner": int(run["steps"]),
        "tokens": tokens,
        "merges": sum(1 for e in merge_log if e.get("event") == schema.MERGE),
        "final_eval_loss": result["final_eval_loss"],
        # what the final loss was measured on: the whole held-out split ("all") or a sample
        "final_eval": result.get("final_eval"),
        "train": result.get("train"),
        "data_order": getattr(data_cfg, "order", "contiguous"),
        "python": platform.python_version(),
        "unigram_baseline_loss": unigram_entropy(load_corpus(data_cfg).eval),
        "global_eval": [[t, loss] for t, loss in read_curve(out)],
        "learner_goodput": fleet.get("learner_goodput"),
        "global_downtime_s": fleet.get("global_downtime_s"),
        "max_merge_gap_s": fleet.get("max_merge_gap_s"),
        "restart_to_first_merge_s": fleet.get("restart_to_first_merge_s", []),
        "rejected_contributions": sum((status.get("rejected_by_reason") or {}).values()),
        "rejected_by_reason": status.get("rejected_by_reason") or {},
        "blocked_share": fleet.get("blocked_share"),
        "compute_share": fleet.get("compute_share"),
        "contributions": fleet.get("contributions"),
        "faults_injected": result.get("faults_injected", []),
        "rounds": fleet.get("rounds"),
        "invariants": check_invariants(logs, merge_log, fleet, result["chaos_started_t"])
        if result.get("chaos_started_t") else None,
        "failed_learners": result.get("failed_learners", {}),
        "wall_s": result["wall_s"],
        "seed": int(run["seed"]),
        "per_learner": fleet.get("per_learner"),
        **({"shards": per_shard} if per_shard else {}),
    }


BASELINE_KEYS = ("mode", "learners", "steps_per_learner", "seed")
"""What a no-fault baseline must share with the run it is compared with."""


def load_baseline(run_dir: str, doc: dict[str, Any]) -> dict[str, Any]:
    """An earlier run's summary, checked to be comparable with the run ``doc`` describes."""
    path = pathlib.Path(run_dir)
    path = path if path.name == "summary.json" else path / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--baseline: cannot read {path}: {exc}") from exc
    if not isinstance(summary, dict) or "final_eval_loss" not in summary:
        raise ValueError(f"--baseline: {path} is not a ddiloco run summary")
    run = doc["run"]
    wanted = {"mode": run["mode"], "learners": int(run["learners"]), "steps_per_learner": int(run["steps"]),
              "seed": int(run["seed"])}
    differ = {k: (summary.get(k), v) for k, v in wanted.items() if summary.get(k) != v}
    if differ:
        detail = ", ".join(f"{k} {a!r} (this run: {b!r})" for k, (a, b) in differ.items())
        raise ValueError(f"--baseline: {path} is not comparable: {detail}")
    if summary.get("faults_injected"):
        raise ValueError(f"--baseline: {path} had faults injected; a baseline must be a no-fault run")
    theirs, ours = eval_set(summary.get("final_eval")), eval_set(int(run["final_eval_batches"]))
    if theirs != ours:
        raise ValueError(f"--baseline: {path} measured its final eval loss on {theirs}, this run on {ours}: "
                         "not comparable")
    return {"run": str(path.parent), **summary}


def eval_set(final_eval: dict[str, Any] | int | None) -> str:
    """In words, the final evaluation set of a summary's ``final_eval`` (or of ``final_eval_batches``):
    a summary from before it was recorded measured an unknown one (32 spaced batches by default)."""
    if isinstance(final_eval, int):
        return "the whole held-out split" if final_eval == 0 else f"{final_eval} evenly spaced batches"
    if not isinstance(final_eval, dict):
        return "a set it did not record (a run from before the whole split was the default)"
    return "the whole held-out split" if final_eval.get("split") == "all" else \
        f"{final_eval.get('batches')} evenly spaced batches"


def add_baseline(summary: dict[str, Any], baseline: dict[str, Any]) -> None:
    """Put a no-fault run's final eval loss (and goodput) beside this run's, with the relative gap."""
    base_loss = float(baseline["final_eval_loss"])
    gap = float(summary["final_eval_loss"]) / base_loss - 1.0
    summary["baseline"] = {"run": baseline["run"], "final_eval_loss": base_loss,
                           "learner_goodput": baseline.get("learner_goodput"), "wall_s": baseline.get("wall_s")}
    summary["eval_loss_vs_baseline"] = gap
    if summary.get("invariants") is not None:
        summary["invariants"]["eval_loss_vs_no_fault"] = gap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, help="learner processes (default 3)")
    parser.add_argument("--steps", type=int, help="inner steps per learner (default 600)")
    parser.add_argument("--mode", choices=RUN_MODES, help="decoupled (default), streaming, diloco, or dp (reference)")
    parser.add_argument("--learner-speed", action="append", metavar="ID=FRACTION",
                        help="run a learner at a fraction of full speed, e.g. learner-2=0.5 (repeatable)")
    parser.add_argument("--chaos", help="fault plan: a YAML/JSON file or a shorthand like random:mtbf=30s")
    parser.add_argument("--out", help="run folder (default runs/<time>-<mode>)")
    parser.add_argument("--seed", type=int, help="seed for model init and data order (default 0)")
    parser.add_argument("--shards", type=int, help="synchronizer shards (processes; default 1)")
    parser.add_argument("--config", help="YAML/JSON config with sections run, protocol, model, data, train, "
                                         "learner, synchronizer")
    parser.add_argument("--baseline", metavar="auto|RUN_DIR",
                        help="report the final eval loss beside a no-fault run with the same settings: 'auto' "
                             "runs it after this one (in OUT/baseline), RUN_DIR reuses an earlier run's folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    from ddiloco.core.logs import configure

    configure(json=True)
    exit_on_sigterm()
    try:
        file_doc = read_document(args.config)
        run_cfg, doc = resolve(args, file_doc)
        validate(doc)
        sources = train_sources(file_doc, run_cfg.mode)
        plan = None
        if args.chaos:
            if run_cfg.mode == "dp":
                raise ValueError("--chaos needs a distributed mode, not dp")
            plan = FaultPlan.parse(args.chaos, learners=[f"learner-{i}" for i in range(run_cfg.learners)],
                                   duration_s=run_cfg.chaos_horizon_s)
        baseline = load_baseline(args.baseline, doc) if args.baseline not in (None, "auto") else None
    except ValueError as exc:
        print(f"ddiloco run: {exc}", file=sys.stderr)
        return 2
    mode = doc["run"]["mode"]
    out = pathlib.Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{mode}")
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    show = not args.no_progress and sys.stderr.isatty()
    # This process's own log lines (fault proxies, chaos driver) go to the run folder, not over the
    # progress bar; every service process writes its own file under logs/ as well.
    (out / "logs").mkdir(exist_ok=True)
    run_log = open(out / "logs" / "run.log", "a", buffering=1)  # noqa: SIM115 (open for the whole run)
    configure(json=True, file=run_log)
    from ddiloco.lab.dp import run_dp

    train = train_record(doc, sources)
    print(f"ddiloco run: {describe_train(mode, train)}", file=sys.stderr)
    from ddiloco.core.logs import get_logger

    get_logger("ddiloco.run").info("train_settings", mode=mode, **train)
    if mode == "dp":
        result = run_dp(doc, out, show_progress=show)
    else:
        result = run_distributed(doc, out, show_progress=show, plan=plan)
    result["train"] = train
    summary = summarize(doc, out, result)
    if args.baseline == "auto":
        base_out = out / "baseline"
        base_out.mkdir(exist_ok=True)
        (base_out / "config.yaml").write_text(cfg_path.read_text())
        print(f"ddiloco run: no-fault baseline run in {base_out}", file=sys.stderr)
        base_result = (run_dp(doc, base_out, show_progress=show) if mode == "dp"
                       else run_distributed(doc, base_out, show_progress=show, plan=None))
        base_result["train"] = train
        base_summary = summarize(doc, base_out, base_result)
        (base_out / "summary.json").write_text(json.dumps(base_summary, indent=2))
        baseline = {"run": str(base_out), **base_summary}
    if baseline is not None:
        add_baseline(summary, baseline)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    try:
        from ddiloco.lab.global_eval import read_curve
        from ddiloco.lab.plots import plot_run

        plot_run(out, out, global_eval=read_curve(out))
    except Exception as exc:  # plots are a convenience; the summary is the contract
        print(f"ddiloco run: plotting failed: {exc}", file=sys.stderr)
    head = {k: summary[k] for k in ("mode", "learners", "steps", "tokens", "merges", "final_eval_loss",
                                    "unigram_baseline_loss", "learner_goodput", "global_downtime_s",
                                    "max_merge_gap_s", "rejected_contributions", "wall_s")}
    head["final_eval"] = {k: (summary["final_eval"] or {}).get(k) for k in ("split", "batches", "tokens")}
    head["lr"] = summary["train"]["lr"]
    rounds = summary.get("rounds") or {}
    if rounds.get("merges"):
        head["rounds"] = {k: rounds[k] for k in ("participation_mean", "stale_share", "max_merge_wait_s")}
    print(json.dumps(head, indent=2))
    print(f"run folder: {out}")
    return 0 if not summary["failed_learners"] else 1
