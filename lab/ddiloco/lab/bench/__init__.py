"""Benchmarks of ddiloco's hot paths; each prints a table and writes JSON (``ddiloco bench NAME``)."""

import argparse
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

from ddiloco.core.resources import with_huge_pages
from ddiloco.lab.procs import exit_on_sigterm, stop_processes

THP_SETTING = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def save_result(result: dict[str, Any], out: str | pathlib.Path) -> pathlib.Path:
    """Write a benchmark's JSON results to ``out`` (its folder made as needed); returns the path."""
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def transparent_huge_pages() -> str:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or ``""`` where the
    kernel does not say."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return ""
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else ""


def memory_environment() -> dict[str, str]:
    """What a benchmark's JSON records about the memory its processes were given."""
    return {"glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "transparent_hugepage": transparent_huge_pages()}


def add_huge_pages_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on",
                        help="on (default): the benchmark's processes run with the environment the services "
                             "run with (transparent huge pages for malloc's large buffers, as 'ddiloco run' and "
                             "the service image set), re-running the benchmark in a child process where needed; "
                             "off: the environment as it is")


def rerun_as_deployed(benchmark: str, argv: list[str]) -> int | None:
    """Run ``ddiloco bench BENCHMARK ARGV`` again in a child started with the environment the
    services run with (``with_huge_pages``: glibc reads its tunables only when a process starts),
    and return the child's exit code; None where this process already has that environment.

    SIGTERM or Ctrl-C here stops the child by its pid (SIGTERM, which the benchmarks unwind on, so
    they stop what they started; SIGKILL after 30 s)."""
    env = with_huge_pages(os.environ)
    if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES"):
        return None
    exit_on_sigterm()
    child = subprocess.Popen([sys.executable, "-m", "ddiloco.core.cli", "bench", benchmark, *argv], env=env)
    try:
        code = child.wait()
    finally:
        stop_processes([child], grace_s=30.0)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
