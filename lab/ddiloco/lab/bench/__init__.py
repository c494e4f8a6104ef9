"""Benchmarks of ddiloco's hot paths; each prints a table and writes JSON (``ddiloco bench NAME``)."""

import argparse
import contextlib
import json
import os
import pathlib
import signal
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


def memory_environment() -> dict[str, Any]:
    """What a benchmark's JSON records about the memory its processes were given: the tunables, the
    kernel's mode, and whether malloc's large buffers get huge pages (glibc's ``hugetlb`` 1 or 2 asked
    for, and a kernel that gives them)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    thp = transparent_huge_pages()
    asked = any(t in ("glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=2") for t in tunables.split(":"))
    return {"glibc_tunables": tunables, "transparent_hugepage": thp,
            "huge_pages_in_effect": asked and thp in ("always", "madvise")}


def add_huge_pages_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on",
                        help="on (default): the benchmark's processes run with the environment the services "
                             "run with (transparent huge pages for malloc's large buffers, as 'ddiloco run' and "
                             "the service image set; an operator's own glibc.malloc.hugetlb value is kept), "
                             "re-running the benchmark in a child process where needed; off: the environment "
                             "as it is")


def needs_rerun() -> bool:
    """Whether this process lacks the environment the services run with (and no operator chose a
    ``glibc.malloc.hugetlb`` value of their own)."""
    return with_huge_pages(os.environ).get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES")


def rerun_as_deployed(benchmark: str, argv: list[str]) -> int | None:
    """Run ``ddiloco bench BENCHMARK ARGV`` again in a child started with the environment the
    services run with (``with_huge_pages``: glibc reads its tunables only when a process starts),
    and return the child's exit code; None where this process already has that environment.

    SIGTERM here stops the child by its pid (SIGTERM, which the benchmarks unwind on, so they stop
    what they started; SIGKILL after 30 s). Ctrl-C reaches the child as well: it is given 10 s to
    unwind by itself before it is stopped the same way."""
    if not needs_rerun():
        return None
    exit_on_sigterm()
    child: subprocess.Popen[bytes] | None = None
    try:
        child = subprocess.Popen([sys.executable, "-m", "ddiloco.core.cli", "bench", benchmark, *argv],
                                 env=with_huge_pages(os.environ))
        try:
            code = child.wait()
        except KeyboardInterrupt:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=10.0)
            code = -signal.SIGINT if child.returncode is None else child.returncode
    finally:
        if child is not None:
            stop_processes([child], grace_s=30.0)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
