"""``ddiloco bench scale``: the whole system's throughput, tokens per second of ``ddiloco run``
with 1, 2, 3, 4 learners against one learner alone, and the synchronizer's CPU per merge.

Every point is a real ``ddiloco run`` (its own synchronizer and learner processes on loopback,
the same commands a deployment runs), one after the other in this run. "alone" is ``ddiloco run
--mode dp --learners 1``: the same model, batch and inner step in one process with nothing to
synchronise, on every CPU of the machine (a learner alone in a fleet gets them all as well).

- ``tokens_per_s`` = the fleet's tokens / its training window (from the first step's start to the
  last step's end; process start, the genesis upload and the final evaluation are outside it).
  The global model is not evaluated while the runs train (``global_eval_every_s`` 0), since
  that evaluation would take the same cores.
- ``ratio`` = ``tokens_per_s`` / alone's. What a fleet could reach depends on its cores: a
  learner gets max(1, CPUs // learners) torch threads, and a small model does not run twice as
  fast on two threads as on one. So alone is also run on one thread (``alone_1_thread``), and a
  fleet's ``ideal_tokens_per_s`` = max(alone, min(learners, CPUs) x alone on one thread): the
  machine's cores all busy the better of the two ways, with nothing spent on synchronisation.
  ``efficiency`` = ``tokens_per_s`` / ideal. What falls short is synchronisation overhead on the
  learners, the synchronizer's own CPU (on the same cores here, not in a deployment) and the cost
  of more processes than cores. With a core set per learner, ideal is n x alone.
- ``sync_cpu_ms_per_merge``: the synchronizer process's CPU seconds from its first merge to its
  last (every merge event carries ``cpu_s``), over the merges in between: receiving, decoding,
  merging, committing and broadcasting, all of it. ``sync_cores`` is that CPU over the same
  wall time.
- ``--shards 1,2,4`` runs every fleet size against a synchronizer of 1, 2 and 4 shards
  (``ddiloco run --shards``). Each point then has a row per shard (``per_shard``): its merges and
  merges per second (over the fleet's training window), its CPU per merge and cores, and the chunk
  payload bytes it received and sent per second and per merge, from the totals every merge event
  carries (``rx_bytes``, ``tx_bytes``: since the shard's process started), from its start to its
  last merge (the learners' joins included, and the seconds before they join: a short run reads a
  lower rate than a long one; a shard restarted after its last merge reads none). The point's
  ``bytes_per_s`` is the shards' sum; ``sync_cpu_ms_per_merge`` is all shards' CPU over all
  their merges. On one machine the shards share its cores with the learners: the CPU figures say
  what a shard costs, the rates what this machine reached, not what S machines would.
- ``step_ms`` (compute per inner step) and ``blocked_share`` show where a learner's time went;
  ``mean_quorum`` is how many learners' contributions a merge held on average.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import yaml

from ddiloco.core import events as schema
from ddiloco.core.resources import available_cpus
from ddiloco.lab.bench import save_result
from ddiloco.lab.procs import exit_on_sigterm, stop_processes

MODES = ("decoupled", "streaming", "diloco")
BENCH_RUN = {"global_eval_every_s": 0, "final_eval_batches": 4}
"""Laid over the ``run`` section of every point: no evaluation competing for the cores."""


def _counts(what: str) -> Callable[[str], list[int]]:
    """An argparse type: a comma-separated list of ``what`` counts, each >= 1, sorted, each once."""
    def parse(text: str) -> list[int]:
        try:
            counts = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"a comma-separated list of {what} counts, got {text!r}") from None
        if not counts or any(n < 1 for n in counts):
            raise argparse.ArgumentTypeError(f"{what} counts must be >= 1, got {text!r}")
        return sorted(set(counts))
    return parse


def _rate(merges: list[dict[str, Any]], counter: str) -> tuple[float, int, float] | None:
    """A process counter carried by merge events (``cpu_s``, ``rx_bytes``, ...) over the span of
    the merges that carry it: (growth, merges after the first, seconds), or None below two."""
    counted = [e for e in merges if counter in e]
    if len(counted) < 2:
        return None
    return (counted[-1][counter] - counted[0][counter], len(counted) - 1,
            max(counted[-1]["t"] - counted[0]["t"], 1e-9))


def _since_start(events: list[dict[str, Any]]) -> tuple[int, int, int, float] | None:
    """The payload bytes of the synchronizer process that made a shard's last merge: (received,
    sent, its merges, seconds from its start to that merge). A merge event carries the process's
    totals since it started (``rx_bytes``, ``tx_bytes``), so the span is its whole run, the join
    traffic of the learners included; a span between two merges would read nothing for a shard
    that had all of a short run's contributions in before its first merge. None without a start
    event before a merge that carries the totals."""
    start: dict[str, Any] | None = None
    merges, last = 0, None
    for e in events:
        if e.get("event") == schema.SYNC_START:
            start, merges, last = e, 0, None
        elif e.get("event") == schema.MERGE:
            merges += 1
            if "rx_bytes" in e and "tx_bytes" in e:
                last = e
    if start is None or last is None:
        return None
    return last["rx_bytes"], last["tx_bytes"], merges, max(last["t"] - start["t"], 1e-9)


def _shard_row(shard: int, events: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    """One shard's merges, CPU and payload bytes, from its log (start and merge events)."""
    merges = [e for e in events if e.get("event") == schema.MERGE]
    row: dict[str, Any] = {"shard": shard, "merges": len(merges), "merges_per_s": len(merges) / window_s,
                           "sync_cpu_ms_per_merge": None, "sync_cores": None, "rx_bytes_per_s": None,
                           "tx_bytes_per_s": None, "bytes_per_merge": None}
    if cpu := _rate(merges, "cpu_s"):
        row["sync_cpu_ms_per_merge"] = 1e3 * cpu[0] / cpu[1]
        row["sync_cores"] = cpu[0] / cpu[2]
    if payload := _since_start(events):
        rx, tx, counted, seconds = payload
        row["rx_bytes_per_s"] = rx / seconds
        row["tx_bytes_per_s"] = tx / seconds
        row["bytes_per_merge"] = (rx + tx) / counted
    return row


def measure(out: pathlib.Path) -> dict[str, Any]:
    """Throughput and synchronizer CPU of one finished ``ddiloco run`` folder (every shard's)."""
    from ddiloco.lab.event_logs import load_jsonl, synchronizer_logs
    from ddiloco.lab.goodput import fleet_summary

    logs = {p.stem: load_jsonl(p) for p in sorted((out / "learners").glob("*.jsonl"))}
    per_log = [[e for e in load_jsonl(p) if e.get("event") in (schema.MERGE, schema.SYNC_START)]
               for _, p in synchronizer_logs(out)]
    merges = sorted((e for m in per_log for e in m if e["event"] == schema.MERGE), key=lambda e: e["t"])
    fleet = fleet_summary(logs, merges)
    if not fleet.get("training_window") or not fleet.get("steps"):
        raise RuntimeError(f"{out}: the run logged no training steps")
    start, end = fleet["training_window"]
    summary = json.loads((out / "summary.json").read_text())
    row: dict[str, Any] = {
        "tokens": int(fleet["tokens"]),
        "window_s": end - start,
        "tokens_per_s": fleet["tokens"] / (end - start),
        "step_ms": 1e3 * fleet["compute_s"] / fleet["steps"],
        "blocked_share": fleet.get("blocked_share"),
        "merges": len(merges),
        "mean_quorum": sum(e["quorum"] for e in merges) / len(merges) if merges else None,
        "final_eval_loss": summary["final_eval_loss"],
        "sync_cpu_ms_per_merge": None,
        "sync_cores": None,
        "bytes_per_s": None,
    }
    if not per_log:
        return row  # dp: nothing synchronised
    shards = [_shard_row(s, m, end - start) for s, m in enumerate(per_log)]
    row["shards"] = len(shards)
    row["per_shard"] = shards
    timed = [s for s in shards if s["sync_cpu_ms_per_merge"] is not None]
    if timed:
        # all shards' CPU over all their merges (each shard's first merge only opens its span)
        cpu_ms = sum(s["sync_cpu_ms_per_merge"] * (s["merges"] - 1) for s in timed)
        row["sync_cpu_ms_per_merge"] = cpu_ms / sum(s["merges"] - 1 for s in timed)
        row["sync_cores"] = sum(s["sync_cores"] for s in timed)
    if all(s["rx_bytes_per_s"] is not None for s in shards):
        row["bytes_per_s"] = sum(s["rx_bytes_per_s"] + s["tx_bytes_per_s"] for s in shards)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco bench scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=_counts("learner"), default=[1, 2, 3, 4],
                        help="fleet sizes to run, comma-separated (default 1,2,3,4)")
    parser.add_argument("--steps", type=int, default=120, help="inner steps per learner (default 120)")
    parser.add_argument("--shards", type=_counts("shard"), default=[1],
                        help="synchronizer shard counts to run every fleet size with, comma-separated (default 1)")
    parser.add_argument("--mode", choices=MODES, default="decoupled", help="the fleets' mode (default decoupled)")
    parser.add_argument("--config", help="a ddiloco run config (YAML/JSON) for every point: model, data, protocol")
    parser.add_argument("--seed", type=int, default=0, help="seed of every point (default 0)")
    parser.add_argument("--workdir", help="where the runs' folders go (default runs/bench-scale-<time>)")
    parser.add_argument("--out", default="bench-results/scale.json", help="JSON results file")
    parser.add_argument("--json", action="store_true", help="print the JSON results instead of the table")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one point may take (default 1800)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps >= 1 required, got {args.steps}")
    if args.timeout <= 0:
        parser.error(f"--timeout > 0 required, got {args.timeout}")
    try:
        document = _document(args)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    exit_on_sigterm()
    workdir = pathlib.Path(args.workdir or f"runs/bench-scale-{time.strftime('%Y%m%d-%H%M%S')}")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "bench.yaml"
    config.write_text(yaml.safe_dump(document, sort_keys=False))
    try:
        result = _run(args, workdir, config)
    except RuntimeError as exc:
        print(f"ddiloco bench scale: {exc} (the runs' folders are in {workdir})", file=sys.stderr)
        return 1
    path = save_result(result, args.out)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
        print(f"results: {path}")
    return 0


def _document(args: argparse.Namespace) -> dict[str, Any]:
    """The user's config with the benchmark's ``run`` settings over it, checked for every fleet size."""
    from ddiloco.core.config import read_document
    from ddiloco.lab.run_config import merge_documents, resolve, validate

    document = merge_documents(read_document(args.config) if args.config else {}, {"run": BENCH_RUN})
    for n, mode, shards in [(1, "dp", 1), *((n, args.mode, s) for n in args.learners for s in args.shards)]:
        ns = argparse.Namespace(config=args.config, learners=n, steps=args.steps, mode=mode, seed=args.seed,
                                learner_speed=None, shards=shards)
        validate(resolve(ns, document)[1])
    return document


def _run(args: argparse.Namespace, workdir: pathlib.Path, config: pathlib.Path) -> dict[str, Any]:
    cpus = available_cpus()
    one_thread = workdir / "bench-1-thread.yaml"
    document = yaml.safe_load(config.read_text())
    document.setdefault("train", {})["threads"] = 1
    one_thread.write_text(yaml.safe_dump(document, sort_keys=False))

    def point(name: str, learners: int, mode: str, config: pathlib.Path = config, shards: int = 1) -> dict[str, Any]:
        out = workdir / name
        cmd = [sys.executable, "-m", "ddiloco.core.cli", "run", "--config", str(config), "--out", str(out),
               "--no-progress", "--learners", str(learners), "--steps", str(args.steps), "--mode", mode,
               "--seed", str(args.seed)]
        if shards > 1:
            cmd += ["--shards", str(shards)]
        print(f"ddiloco bench scale: {name}: {learners} learner(s), {mode}, {shards} shard(s), "
              f"{args.steps} steps ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise RuntimeError(f"{name} timed out after {args.timeout:g} s") from None
        except BaseException:
            _stop(proc)  # Ctrl-C or SIGTERM here
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"ddiloco run failed for {name} (exit {proc.returncode}): {err[-2000:]}")
        row = {"learners": learners, "mode": mode, "run": str(out), **measure(out)}
        print(f"ddiloco bench scale: {name}: {row['tokens_per_s']:.0f} tokens/s "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        return row

    alone = point("alone", 1, "dp")
    alone_1 = point("alone-1-thread", 1, "dp", one_thread) if cpus > 1 else alone
    fleets = []
    for n in args.learners:
        for shards in args.shards:
            row = point(f"learners-{n}" if shards == 1 else f"learners-{n}-shards-{shards}", n, args.mode,
                        shards=shards)
            row["ratio"] = row["tokens_per_s"] / alone["tokens_per_s"]
            row["ideal_tokens_per_s"] = max(alone["tokens_per_s"], min(n, cpus) * alone_1["tokens_per_s"])
            row["efficiency"] = row["tokens_per_s"] / row["ideal_tokens_per_s"]
            fleets.append(row)
    return {
        "benchmark": "scale",
        "what": "tokens/s of ddiloco run with N learners against one learner alone (dp, nothing to "
                "synchronise), each a real run on this machine, measured in this run",
        "machine": {"cpus": cpus, "platform": platform.platform(), "python": platform.python_version()},
        "mode": args.mode,
        "shards": args.shards,
        "steps": args.steps,
        "seed": args.seed,
        "config": args.config,
        "alone": alone,
        "alone_1_thread": alone_1,
        "fleets": fleets,
    }


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM a ``ddiloco run`` (it stops its own synchronizer and learners), SIGKILL after 60 s;
    what it printed is read afterwards (a few lines: the pipes cannot fill meanwhile)."""
    stop_processes([proc], grace_s=60)
    proc.communicate()


def _print_table(r: dict[str, Any]) -> None:
    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def mib(v: Any) -> str:
        return "-" if v is None else f"{v / 2**20:.2f}"

    print(f"ddiloco bench scale: {r['mode']}, {r['steps']} steps per learner, {r['machine']['cpus']} CPUs")
    print(f"{'learners':>16} {'shards':>6} {'tokens/s':>9} {'ratio':>6} {'ideal':>7} {'effic.':>7} {'step ms':>8} "
          f"{'blocked':>8} {'merges':>7} {'sync ms/merge':>14} {'sync cores':>11} {'MiB/s':>7} {'eval loss':>10}")
    for name, a in (("alone", r["alone"]), ("alone, 1 thread", r["alone_1_thread"])):
        print(f"{name:>16} {'':>6} {a['tokens_per_s']:>9.0f} {a['tokens_per_s'] / r['alone']['tokens_per_s']:>6.2f} "
              f"{'':>7} {'':>7} {a['step_ms']:>8.1f} {'':>8} {'':>7} {'':>14} {'':>11} {'':>7} "
              f"{a['final_eval_loss']:>10.4f}")
    for f in r["fleets"]:
        print(f"{f['learners']:>16} {f.get('shards', 1):>6} {f['tokens_per_s']:>9.0f} {f['ratio']:>6.2f} "
              f"{f['ideal_tokens_per_s']:>7.0f} {f['efficiency']:>7.2f} {f['step_ms']:>8.1f} "
              f"{num(f['blocked_share'], '.3f'):>8} {f['merges']:>7} {num(f['sync_cpu_ms_per_merge'], '.1f'):>14} "
              f"{num(f['sync_cores'], '.2f'):>11} {mib(f.get('bytes_per_s')):>7} {f['final_eval_loss']:>10.4f}")
    sharded = [f for f in r["fleets"] if f.get("shards", 1) > 1]
    if sharded:
        print(f"per shard: {'learners':>8} {'shards':>6} {'shard':>5} {'merges':>7} {'merges/s':>9} "
              f"{'ms/merge':>9} {'cores':>6} {'rx MiB/s':>9} {'tx MiB/s':>9} {'KiB/merge':>10}")
        for f in sharded:
            for s in f["per_shard"]:
                kib = "-" if s["bytes_per_merge"] is None else f"{s['bytes_per_merge'] / 1024:.1f}"
                print(f"{'':>10} {f['learners']:>8} {f['shards']:>6} {s['shard']:>5} {s['merges']:>7} "
                      f"{s['merges_per_s']:>9.2f} {num(s['sync_cpu_ms_per_merge'], '.1f'):>9} "
                      f"{num(s['sync_cores'], '.2f'):>6} {mib(s['rx_bytes_per_s']):>9} "
                      f"{mib(s['tx_bytes_per_s']):>9} {kib:>10}")
