"""The ``ddiloco`` command line: one entry point, one sub-command per installed part.

Each distribution registers its sub-commands under the ``ddiloco.commands`` entry-point group
(the synchronizer service registers ``synchronizer``, the learner ``learner``, the protocol
package ``status``, the simulator ``simulate``, the lab ``run`` and ``bench``). This module knows
none of them by name: an image that installs only the synchronizer's packages has exactly the
commands that image can run, and a command that is not installed says so instead of failing
with an import error. Sub-commands are imported only when called, so ``ddiloco status`` does not
pay for torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

GROUP = "ddiloco.commands"


def commands() -> dict[str, EntryPoint]:
    """Installed sub-commands by name."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def _summary(ep: EntryPoint) -> str:
    """The first line of the command's module docstring, read without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(ep.module)
    if spec is None or spec.origin is None:
        return ""
    import ast

    try:
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
    except (OSError, SyntaxError):
        return ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    if first.startswith("``") and "``: " in first:  # "``ddiloco x ARGS``: what it does"
        first = first.split("``: ", 1)[1]
    return first


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    installed = commands()
    # The summaries are read from each command's module docstring, which imports its parent
    # packages (some import torch): only a listing pays for that, never a command being run.
    wants_listing = not argv or argv[0] in ("-h", "--help")
    listing = "\n".join(f"  {name:<13} {_summary(ep) if wants_listing else ''}"
                         for name, ep in sorted(installed.items()))
    parser = argparse.ArgumentParser(
        prog="ddiloco", description="Decoupled DiLoCo: resilient distributed pre-training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"installed commands:\n{listing}\n\nRun 'ddiloco COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("command", nargs="?", metavar="COMMAND", help="one of: " + ", ".join(sorted(installed)))
    args, _ = parser.parse_known_args(argv[:1])
    if args.version:
        from ddiloco.core import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    ep = installed.get(args.command)
    if ep is None:
        print(f"ddiloco: unknown or not installed command {args.command!r}; installed: "
              f"{', '.join(sorted(installed)) or 'none'}", file=sys.stderr)
        return 2
    run: Callable[[list[str]], int] = ep.load()
    return int(run(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
