"""The quality study (`ddiloco study`): resumable, on the in-process reference fleet.

    ddiloco study quality --sweep dp-lr --sweep tune       # run what is not saved yet
    ddiloco study quality --cases dp,decoupled:sync_every=12:fragments=12 --seeds 0,1,2
    ddiloco study quality --sweep frontier --list          # what would run, and what is saved
    ddiloco study report                                   # tables and plots from what is saved
    ddiloco study faults                                   # the modes under one fault plan, real fleets

Each case is saved as ``<out>/<id>.json`` when it finishes and skipped when present, so a study
can be stopped and resumed at any time, and several workers (``--threads 1`` each) may share one
results folder. A case is named by what differs from the defaults of ``ddiloco run`` (dp: its
tuned lr and warm-up), its data order, final evaluation set (the whole held-out split) and the
Python version included, so a result saved under other ones is never taken for it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

DEFAULT_OUT = "study-results/quality"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco study", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quality", help="run the cases of sweeps (or listed cases) not yet saved")
    q.add_argument("--sweep", action="append", default=[], help="a named sweep (repeatable); see --list-sweeps")
    q.add_argument("--cases", default="", help="comma-separated cases, MODE[:key=value...], e.g. "
                                               "'dp:inner_lr=6e-3,decoupled:sync_every=12:fragments=12'")
    q.add_argument("--seeds", default="", help="comma-separated seeds to run every case at (default: each case's own)")
    q.add_argument("--steps", type=int, help="steps of every case that does not set its own")
    q.add_argument("--out", default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    q.add_argument("--threads", type=int, default=0, help="torch threads (0: the CPUs this process may use)")
    q.add_argument("--list", action="store_true", help="list the cases and whether each is saved; run nothing")
    q.add_argument("--list-sweeps", action="store_true", help="list the named sweeps and exit")
    f = sub.add_parser("faults", help="decoupled, streaming and diloco under one fault plan: eval loss against "
                                      "wall time (real local fleets)")
    f.add_argument("--out", default="study-results/faults", help="results folder (default study-results/faults)")
    f.add_argument("--steps", type=int, default=600, help="inner steps per learner (default 600)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--config", default=None, help="a config file every mode's ddiloco run gets (as its --config)")
    r = sub.add_parser("report", help="tables and plots of the saved results")
    r.add_argument("--out", default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    r.add_argument("--docs", default="", help="also write the report's PNG plots into this folder")
    args = parser.parse_args(argv)
    if args.command == "faults":
        if args.steps < 1:
            parser.error("--steps must be >= 1")
        import pathlib

        from ddiloco.lab.study.faults import run_modes

        if args.config is not None and not pathlib.Path(args.config).is_file():
            f.error(f"--config: no such file: {args.config}")
        run_modes(pathlib.Path(args.out), steps=args.steps, seed=args.seed, config=args.config)
        return 0
    if args.command == "report":
        from ddiloco.lab.study.report import report

        return report(args.out, args.docs or None)
    return _quality(parser, args)


def _quality(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ddiloco.lab.study.case import parse_case
    from ddiloco.lab.study.store import Results, ResultsError
    from ddiloco.lab.study.sweeps import SWEEPS, expand

    if args.list_sweeps:
        for name, sweep in SWEEPS.items():
            print(f"{name:<10} {len(sweep):>3} cases: {', '.join(sweep)}")
        return 0
    base: dict[str, Any] = {}
    if args.steps is not None:
        if args.steps < 1:
            parser.error("--steps must be >= 1")
        base["steps"] = args.steps
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    specs: list[str] = []
    try:
        for name in args.sweep:
            specs += expand(name)
    except ValueError as exc:
        parser.error(str(exc))
    specs += [c for c in args.cases.split(",") if c.strip()]
    if not specs:
        parser.error("nothing to run: give --sweep NAME or --cases SPECS (--list-sweeps lists the sweeps)")
    seed_list: list[int | None] = [*seeds] if seeds else [None]
    cases = []
    try:
        for spec in specs:
            for seed in seed_list:
                extra = {**base, **({"seed": seed} if seed is not None else {})}
                case = parse_case(spec, **extra)
                if case not in cases:
                    cases.append(case)
    except ValueError as exc:
        parser.error(str(exc))
    results = Results(args.out)
    for old, new in results.reindex():
        print(f"renamed {old.name} -> {new.name} (a default changed)")
    if args.list:
        for case in cases:
            try:
                saved = results.get(case)
                state = f"{saved['final_eval_loss']:.4f}" if saved else "-"
            except ResultsError as exc:
                state = f"unusable: {exc}"
            print(f"{case.id:<70} {state}")
        return 0
    import torch

    from ddiloco.core.resources import available_cpus
    from ddiloco.lab.study.reference import run_case

    torch.set_num_threads(args.threads or available_cpus())
    failed = 0
    for n, case in enumerate(cases, 1):
        tag = f"[{n}/{len(cases)}] {case.id}"
        try:
            if results.get(case) is not None:
                print(f"{tag}: saved", flush=True)
                continue
        except ResultsError as exc:
            print(f"{tag}: {exc}", file=sys.stderr, flush=True)
            failed += 1
            continue
        with results.claim(case) as mine:
            if not mine:
                print(f"{tag}: another worker runs it", flush=True)
                continue
            print(f"{tag}: running ({case.tokens / 1e6:.2f}M tokens)", flush=True)
            try:
                result = run_case(case, progress=_progress(tag))
            except ValueError as exc:  # a case this interpreter or corpus cannot run (another Python)
                print(f"{tag}: {exc}", file=sys.stderr, flush=True)
                failed += 1
                continue
            path = results.save(case, result)
            print(f"{tag}: eval {result['final_eval_loss']:.4f}, {result['bytes_per_token']:.1f} B/token, "
                  f"{result['wall_s']:.0f} s -> {path}", flush=True)
    return 1 if failed else 0


def _progress(tag: str):  # type: ignore[no-untyped-def]
    """A line every 10% of a case (a log, not a bar: studies run in the background)."""
    started = time.monotonic()
    shown = [0]

    def show(step: int, steps: int) -> None:
        tenth = step * 10 // steps
        if tenth > shown[0] and step < steps:
            shown[0] = tenth
            elapsed = time.monotonic() - started
            print(f"{tag}: {tenth * 10}% ({elapsed:.0f} s, ~{elapsed * (steps - step) / step:.0f} s left)",
                  flush=True)

    return show
