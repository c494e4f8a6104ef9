"""Real service processes for tests: a synchronizer on 127.0.0.1:0, stopped by its pid; the live
children of a process, and whether one has gone."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator

from ddiloco.lab.cluster import wait_ready


def cli(*args: str) -> list[str]:
    """The command line of ``ddiloco ARGS`` with this interpreter."""
    return [sys.executable, "-m", "ddiloco.core.cli", *args]


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``proc`` by its pid: SIGTERM, then SIGKILL after 15 s (nothing if it has ended)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def synchronizer(tmp_path: pathlib.Path, *args: str, timeout_s: float = 60.0,
                 log: pathlib.Path | None = None, started: list[subprocess.Popen[bytes]] | None = None
                 ) -> Iterator[str]:
    """Run ``ddiloco synchronizer`` with ``args`` (state dir under ``tmp_path`` unless given);
    yields its ``HOST:PORT`` once it listens, and stops it (SIGTERM, then SIGKILL) on exit. The
    process is appended to ``started`` for tests that signal it."""
    ready = tmp_path / f"ready-{time.monotonic_ns()}.json"
    state = [] if "--state-dir" in args else ["--state-dir", str(tmp_path / "state")]
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cli("synchronizer", "--listen", "127.0.0.1:0", "--ready-file", str(ready), *state, *args),
                            stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL)
    if started is not None:
        started.append(proc)
    try:
        yield f"127.0.0.1:{wait_ready(proc, ready, timeout_s)}"
    finally:
        stop(proc)
        if log:
            out.close()  # type: ignore[union-attr]


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc; zombies left out)."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if int(ppid) == pid and state != "Z":
            found.append(int(stat.parent.name))
    return found


def cmdline(pid: int) -> bytes:
    """The command line of ``pid`` as /proc holds it (b"" once it is gone)."""
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def gone(pid: int, within_s: float) -> bool:
    """Whether ``pid`` has exited (and been reaped) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a live process has used (0 when it has gone)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_tree(args: list[str], *, timeout: float, input: str | None = None, **popen: object) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a command that starts processes of its own (``ddiloco run``, the
    benchmarks): it runs in a session of its own, and when ``timeout`` passes the whole session is
    killed before ``TimeoutExpired`` is raised, so no learner or synchronizer it started outlives
    the test. ``capture_output`` and ``text`` as ``subprocess.run`` takes them."""
    if popen.pop("capture_output", False):
        popen["stdout"] = popen["stderr"] = subprocess.PIPE
    proc = subprocess.Popen(args, start_new_session=True, stdin=subprocess.PIPE if input is not None else None,
                            **popen)  # type: ignore[call-overload]
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
