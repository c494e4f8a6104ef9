"""``ddiloco.lab.procs``: SIGTERM unwinds through ``finally`` (a second SIGTERM cannot cut that
short), and children are stopped by pid: a paused one is resumed and exits on SIGTERM, one that
ignores SIGTERM is killed after the grace period. Real processes throughout."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from ddiloco.lab.procs import free_port, stop_processes

UNWINDS = """
import os, signal, sys, time
from ddiloco.lab.procs import exit_on_sigterm
exit_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM, during the cleanup
    time.sleep(0.2)
    open(sys.argv[1], "w").write("cleaned up")
"""


def test_sigterm_unwinds_through_finally_and_a_second_one_is_ignored(tmp_path):
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", UNWINDS, str(marker)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert marker.read_text() == "cleaned up"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_processes_resumes_the_paused_and_kills_what_ignores_sigterm():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                 "print('ready', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == "ready"
        sleeper.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        stop_processes([sleeper, stubborn], grace_s=1.0)
        took = time.monotonic() - t0
        assert sleeper.returncode == -signal.SIGTERM  # resumed, then ended by SIGTERM
        assert stubborn.returncode == -signal.SIGKILL  # ignored SIGTERM: killed after the grace
        assert 0.9 <= took < 20
    finally:
        for p in (sleeper, stubborn):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_free_port_is_a_bindable_loopback_port():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert 0 < port < 65536


def test_a_command_that_outlives_its_timeout_is_killed_with_every_process_it_started(tmp_path):
    """The tests' ``run_tree``: a command whose child would outlive it (as a benchmark's
    synchronizer outlives a benchmark killed by a plain ``subprocess.run`` timeout) loses both."""
    import pytest

    from tests.procs import gone, run_tree

    pid_file = tmp_path / "child.pid"
    parent = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(120)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_tree([sys.executable, "-c", parent], timeout=5, capture_output=True, text=True)
    child = int(pid_file.read_text())
    assert gone(child, within_s=10), "the child of a timed-out command was left running"
    done = run_tree([sys.executable, "-c", "print('hi')"], timeout=30, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "hi\n")
