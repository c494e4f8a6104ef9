"""``ddiloco synchronizer --listen HOST:PORT --state-dir DIR [--config FILE]``: the service as deployed.

The process holds its state dir's lock (``store``) from the moment its state store opens until it
exits: a second synchronizer on the same state dir is refused at start, with exit code 2 and the
holder named, before it has touched the dir or bound a port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from ddiloco.core.config import read_document
from ddiloco.core.logs import configure, get_logger
from ddiloco.core.modes import MODES
from ddiloco.core.resources import fix_mmap_threshold
from ddiloco.protocol.shards import parse_shard
from ddiloco.synchronizer.config import SynchronizerConfig, synchronizer_config


def config_from_args(args: argparse.Namespace) -> SynchronizerConfig:
    document = read_document(args.config)
    if args.quorum is not None:
        section = dict(document.get("synchronizer") or {})
        section["policy"] = {**(section.get("policy") or {}), "quorum": args.quorum}
        document = {**document, "synchronizer": section}
    shard_index = shard_count = None
    if args.shard is not None:
        shard_index, shard_count = parse_shard(args.shard)
    return synchronizer_config(document, args.mode, listen=args.listen, state_dir=args.state_dir,
                               metrics_port=args.metrics_port, event_log=args.event_log,
                               auth_tokens_file=args.auth_tokens_file, shard_index=shard_index,
                               shard_count=shard_count, reseed=True if args.reseed else None)


async def serve(cfg: SynchronizerConfig, ready_file: str | None = None) -> int:
    from ddiloco.synchronizer.server import SynchronizerServer

    server = SynchronizerServer(cfg)
    port = await server.start()
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            json.dump({"port": port, "metrics_port": server.metrics_port,
                       "synchronizer_id": server.engine.synchronizer_id}, f)
        import os

        os.replace(ready_file + ".tmp", ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
    server.engine.store.close()  # the state dir's lock: what the process's exit would release anyway
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco synchronizer", description=__doc__)
    parser.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:7000)")
    parser.add_argument("--state-dir", dest="state_dir", help="durable state folder")
    parser.add_argument("--config", help="YAML/JSON config file (sections: synchronizer, protocol)")
    parser.add_argument("--mode", choices=MODES, help="mode preset (default: the config's protocol.mode)")
    parser.add_argument("--quorum", type=int, help="minimum quorum K (0 = all live learners)")
    parser.add_argument("--shard", metavar="s/S",
                        help="serve shard s of S (it owns fragments p with p mod S == s; its own --state-dir); "
                             "ordinal/S takes s from the host name's trailing -N (a StatefulSet pod)")
    parser.add_argument("--reseed", action="store_true",
                        help="an operator's re-seed of a state dir that was lost: the next learner seeds it even "
                             "though the fleet has merged versions it does not hold (synchronizer.reseed)")
    parser.add_argument("--metrics-port", dest="metrics_port", type=int, help="Prometheus port")
    parser.add_argument("--auth-tokens-file", dest="auth_tokens_file",
                        help="YAML/JSON file of identity: token (a mounted Secret; re-read when it changes)")
    parser.add_argument("--event-log", help="append one JSON line per start, merge and rejection here")
    parser.add_argument("--ready-file", help="write {port, ...} JSON here once serving (for orchestration)")
    args = parser.parse_args(argv)
    configure()
    fix_mmap_threshold()  # merged fragments come and go at every merge: return them to the system
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"ddiloco synchronizer: {exc}", file=sys.stderr)
        return 2
    if cfg.reseed:
        get_logger("ddiloco.synchronizer").warning(
            "operator re-seed allowed: without state, the next learner seeds this synchronizer whatever it holds",
            state_dir=cfg.state_dir, shard=f"{cfg.shard_index}/{cfg.shard_count}")
    from ddiloco.synchronizer.store import StateError  # imports torch: not for a refused command line

    try:
        return asyncio.run(serve(cfg, args.ready_file))
    except ValueError as exc:  # unreadable credentials (tokens file, TLS files)
        print(f"ddiloco synchronizer: {exc}", file=sys.stderr)
        return 2
    except StateError as exc:  # the state dir is another synchronizer's, or not this model's
        get_logger("ddiloco.synchronizer").error("cannot start", state_dir=cfg.state_dir, error=str(exc))
        print(f"ddiloco synchronizer: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        get_logger("ddiloco.synchronizer").error("cannot start", error=str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
