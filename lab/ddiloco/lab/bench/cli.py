"""``ddiloco bench NAME [options]``: dispatch to one benchmark module's ``main``."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "codec": "ddiloco.lab.bench.codec",
    "learner": "ddiloco.lab.bench.learner",
    "memory": "ddiloco.lab.bench.memory",
    "merge": "ddiloco.lab.bench.merge",
    "scale": "ddiloco.lab.bench.scale",
    "torchft": "ddiloco.lab.bench.torchft",
    "wire": "ddiloco.lab.bench.wire",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in BENCHMARKS:
        print(f"usage: ddiloco bench {{{','.join(BENCHMARKS)}}} [options]  (each takes --help)")
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    return int(importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:]) or 0)
