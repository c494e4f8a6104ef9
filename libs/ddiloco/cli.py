"""The ``ddiloco`` command line: one entry point, one sub-command per service or tool.

Sub-commands import their implementation lazily, so ``ddiloco status`` does not pay for torch
and a missing optional piece fails only the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# name -> (module, function, help). Each function takes the remaining argv and returns an exit code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("ddiloco.learner.run", "main", "run the whole system locally: a synchronizer and N learners"),
    "synchronizer": ("ddiloco.synchronizer.main", "main", "start the synchronizer service"),
    "learner": ("ddiloco.learner.main", "main", "start one learner service"),
    "status": ("ddiloco.synchronizer.status_cli", "main", "show a synchronizer's live state"),
    "simulate": ("ddiloco.simulator.cli", "main", "fleet-scale goodput simulator"),
    "bench": ("ddiloco.benchmarks.cli", "main", "benchmark suite (codec, merge, ...)"),
}


def _load(name: str) -> Callable[[list[str]], int]:
    module, func, _ = COMMANDS[name]
    return getattr(importlib.import_module(module), func)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ddiloco", description="Decoupled DiLoCo: resilient distributed pre-training.",
        epilog="Run 'ddiloco COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND",
                        help="one of: " + ", ".join(f"{k} ({v[2]})" for k, v in COMMANDS.items()))
    args, rest = parser.parse_known_args(argv[:1])
    if args.version:
        from ddiloco import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    return int(_load(args.command)(rest + argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
