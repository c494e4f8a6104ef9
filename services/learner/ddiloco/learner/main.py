"""``ddiloco learner --synchronizer HOST:PORT --learner-id ID [--config FILE]``: one learner service."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys

from ddiloco.core.logs import configure, get_logger


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco learner", description=__doc__)
    parser.add_argument("--synchronizer", help="HOST:PORT of the synchronizer; a sharded one: HOST:PORT,HOST:PORT,... "
                        "in shard order, or a pattern holding {shard} with --synchronizer-shards")
    parser.add_argument("--synchronizer-shards", dest="synchronizer_shards", type=int,
                        help="number of synchronizer shards (default: one per address listed)")
    parser.add_argument("--learner-id", dest="learner_id", help="stable learner identity (default $HOSTNAME)")
    parser.add_argument("--config", help="YAML/JSON config (sections: learner, protocol, model, data, train)")
    parser.add_argument("--steps", type=int, help="inner steps to run")
    parser.add_argument("--shard", type=int, dest="shard_index", help="data shard index")
    parser.add_argument("--num-shards", type=int, dest="num_shards", help="number of data shards")
    parser.add_argument("--threads", type=int, help="torch threads")
    parser.add_argument("--resume", choices=("fleet", "none"),
                        help="joining a fleet already training: start at its step (fleet, the default) "
                             "or at step 1 (none); overrides train.resume")
    parser.add_argument("--speed", type=float, help="experiments: run at this fraction of full speed (0 < S <= 1)")
    parser.add_argument("--event-log", help="append one JSON line per event (steps, sends, results, applies, evals) here")
    parser.add_argument("--summary-file", help="write the final summary JSON here")
    parser.add_argument("--token-file", dest="token_file",
                        help="file holding the bearer token (default: the config's token_file, else $DDILOCO_TOKEN)")
    args = parser.parse_args(argv)
    configure()
    from ddiloco.learner.config import load_learner_config
    from ddiloco.learner.service import Learner, LearnerError
    from ddiloco.learner.sync import SyncError
    from ddiloco.protocol.credentials import TOKEN_ENV

    try:
        cfg = load_learner_config(args.config, synchronizer=args.synchronizer,
                                  synchronizer_shards=args.synchronizer_shards, learner_id=args.learner_id,
                                  shard_index=args.shard_index, num_shards=args.num_shards,
                                  event_log=args.event_log, speed=args.speed,
                                  token_file=args.token_file)
        if cfg.token is None and cfg.token_file is None and os.environ.get(TOKEN_ENV):
            cfg = dataclasses.replace(cfg, token=os.environ[TOKEN_ENV])
        overrides = {k: v for k, v in (("steps", args.steps), ("threads", args.threads), ("resume", args.resume))
                     if v is not None}
        if overrides:
            train = dataclasses.replace(cfg.train, **overrides)
            cfg = dataclasses.replace(cfg, train=train)
    except ValueError as exc:
        print(f"ddiloco learner: {exc}", file=sys.stderr)
        return 2
    try:
        learner = Learner(cfg)
    except (ValueError, SyncError) as exc:  # the model, data and protocol do not fit together
        print(f"ddiloco learner: {exc}", file=sys.stderr)
        return 2
    # the first SIGTERM drains; a second one leaves at once, dropping what is unsent or unanswered
    signal.signal(signal.SIGTERM, lambda *_: learner.sync.drain())
    # fault injection for tests and chaos plans: the parameters turn NaN at the next step boundary
    signal.signal(signal.SIGUSR1, lambda *_: learner.poisoned.set())
    # ... and from the next send on, every outer gradient is scaled by corrupt_factor (a hostile learner)
    signal.signal(signal.SIGUSR2, lambda *_: learner.corrupted.set())
    # ... and from the next send on, every answer claims inflate_factor times its tokens
    signal.signal(signal.SIGRTMIN, lambda *_: learner.sync.inflated.set())
    # ... and from the next send on, every answer claims overclaim_factor times its steps and tokens,
    # its outer gradient scaled to match
    signal.signal(signal.SIGRTMIN + 1, lambda *_: learner.sync.overclaimed.set())
    try:
        summary = learner.run()
    except LearnerError as exc:
        get_logger("ddiloco.learner").error("learner failed", error=str(exc))
        return 3
    if args.summary_file:
        with open(args.summary_file, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
