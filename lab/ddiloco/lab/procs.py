"""What the lab's commands share about the processes they start: a free loopback port, SIGTERM
that unwinds like Ctrl-C (so ``finally`` blocks stop the children), whether a pid still runs, and
stopping children by pid with a grace period before SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def running(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts: signalling it is refused, not unknown)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_on_sigterm() -> None:
    """Make SIGTERM (a scheduler's stop, a timeout, ``kill PID``) raise ``SystemExit(143)`` in the
    main thread, so ``finally`` blocks stop the processes this one started rather than leaving them
    behind. A second SIGTERM during that cleanup is ignored, so it cannot cut the cleanup short.
    Does nothing outside the main thread (signal handlers can only be set there)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def terminated(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)


def stop_processes(procs: Iterable[subprocess.Popen[Any]], grace_s: float) -> None:
    """Stop every live process of ``procs`` by its pid: SIGCONT (one may be paused) and SIGTERM to
    all, up to ``grace_s`` seconds for all of them together to exit, then SIGKILL for the rest;
    every one is reaped."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
