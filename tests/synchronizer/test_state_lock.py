"""One synchronizer per state dir: a second one on the same dir is refused and changes nothing.

Two synchronizers on one state dir would each commit their own version N over the other's, and
the second's start-up would delete the first's commits in flight (its temp files). The service
holds an exclusive lock on the state dir for its life (``store``); these tests run real
``ddiloco synchronizer`` processes on one state dir: the second is refused with the holder named
and exits non-zero, the first keeps every file and goes on committing; ``ddiloco export`` reads
the dir while it is held; and the lock is gone once its holder stopped or was SIGKILLed, so a
restart on the same dir serves at once. Within one process, stores of one dir share the lock
(an engine restarted in the same process) and the last one closed releases it.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch

from ddiloco.lab.cluster import wait_ready
from ddiloco.synchronizer.store import LOCK, StateStore
from tests.procs import cli
from tests.scripted import ScriptedLearner, eventually, toy_protocol

START_TIMEOUT_S = 90.0
"""A synchronizer process imports torch and grpc before it serves: slow on a loaded machine."""


def _config(tmp_path: pathlib.Path) -> pathlib.Path:
    """The scripted learners' protocol, quorum 1, no grace: every contribution merges at once."""
    protocol = toy_protocol()
    path = tmp_path / "sync.json"
    path.write_text(json.dumps({
        "protocol": {k: getattr(protocol, k) for k in ("mode", "num_fragments", "sync_every", "overlap",
                                                       "max_chunk_bytes", "global_codec")},
        "synchronizer": {"policy": {"quorum": 1, "grace_gamma": 0.0, "max_grace_s": 0.0},
                         "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0},
    }))
    return path


class Service:
    """A ``ddiloco synchronizer`` process on ``state`` (stderr kept in a file), stopped by its pid."""

    def __init__(self, tmp_path: pathlib.Path, state: pathlib.Path, name: str) -> None:
        self.ready = tmp_path / f"{name}.ready.json"
        self.stderr_path = tmp_path / f"{name}.stderr"
        self.ready.unlink(missing_ok=True)
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cli("synchronizer", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--config",
                    str(_config(tmp_path)), "--ready-file", str(self.ready)),
                stdout=subprocess.DEVNULL, stderr=err)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def port(self) -> int:
        return wait_ready(self.proc, self.ready, timeout_s=START_TIMEOUT_S)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def exit_code(self, timeout_s: float) -> int:
        """The code it exits with; fails if it serves (writes its ready file) or outlives ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            assert not self.ready.exists(), f"the second synchronizer serves on the same state dir: {self.stderr()}"
            assert time.monotonic() < deadline, f"still running after {timeout_s}s: {self.stderr()}"
            time.sleep(0.05)
        return self.proc.returncode

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def services() -> Iterator[list[Service]]:
    """Every service a test starts is stopped at its end, whatever happened."""
    started: list[Service] = []
    yield started
    for service in started:
        service.stop(signal.SIGKILL)


def _files(folder: pathlib.Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` (hidden ones included): its bytes and mtime."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


async def _merge_one(port: int, learner_id: str, *, genesis_into: pathlib.Path | None = None) -> int:
    """Connect (uploading genesis first, committed into ``genesis_into``, when given) and have one
    contribution to fragment 0 merged; the version it made."""
    learner = ScriptedLearner(port, learner_id)
    try:
        welcome = await learner.connect()
        if genesis_into is not None:
            assert welcome.state == "genesis_requested"
            await learner.upload_genesis()
            await eventually(lambda: (genesis_into / "meta.json").exists(), timeout_s=30, what="genesis commit")
        learner.start_pump()
        seq = await learner.contribute(0, torch.full((learner.layout[0].numel,), 0.001),
                                       base_version=welcome.versions.get(0, 0))
        result = await learner.wait_result(seq, timeout_s=30)
        assert result.outcome == "merged", result
        return result.version
    finally:
        await learner.close()


async def test_a_second_synchronizer_on_the_same_state_dir_is_refused_and_changes_nothing(tmp_path, services):
    state = tmp_path / "state"
    first = Service(tmp_path, state, "first")
    services.append(first)
    port = first.port()
    assert await _merge_one(port, "a", genesis_into=state) == 1
    # a commit of the first in flight: a temp file, of the kind a start-up removes (its own, after a crash)
    in_flight = state / "fragments" / "p0001" / f".v000000000009.frag.{first.pid}.tmp"
    in_flight.write_bytes(b"half a version file")
    before = _files(state)

    second = Service(tmp_path, state, "second")
    services.append(second)
    code = second.exit_code(timeout_s=START_TIMEOUT_S)
    message = second.stderr()
    assert code == 2, message
    assert f"state dir {state} is in use by another synchronizer (pid {first.pid} on host" in message, message
    assert _files(state) == before, "a refused synchronizer must not touch the state dir"
    assert json.loads(before[LOCK][0])["pid"] == first.pid, "the lock file names its holder"

    # the first goes on: it still commits, its lock is its own
    assert await _merge_one(port, "b") == 2
    assert first.proc.poll() is None
    assert in_flight.read_bytes() == b"half a version file"

    # export only reads: it runs beside the synchronizer that holds the lock
    out = tmp_path / "model.safetensors"
    exported = subprocess.run(cli("export", "--state-dir", str(state), "--out", str(out)), capture_output=True,
                              text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert "fragment 0: version 2" in exported.stderr and out.stat().st_size > 0
    assert first.stop() == 0


async def test_the_lock_is_released_when_its_synchronizer_stops_or_is_killed(tmp_path, services):
    state = tmp_path / "state"
    first = Service(tmp_path, state, "first")
    services.append(first)
    assert await _merge_one(first.port(), "a", genesis_into=state) == 1
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL  # no shutdown code runs: the kernel releases it

    second = Service(tmp_path, state, "second")
    services.append(second)
    assert await _merge_one(second.port(), "a") == 2, "restarted on the killed one's state"
    assert json.loads((state / LOCK).read_text())["pid"] == second.pid
    assert second.stop() == 0

    third = Service(tmp_path, state, "third")
    services.append(third)
    assert await _merge_one(third.port(), "a") == 3, "restarted after a graceful stop"
    assert third.stop() == 0


TRY_STORE = textwrap.dedent("""
    import sys
    from ddiloco.synchronizer.store import StateLocked, StateStore
    try:
        StateStore(sys.argv[1]).close()
    except StateLocked as exc:
        print(exc)
        sys.exit(3)
""")


def _other_process_opens(root: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", TRY_STORE, str(root)], capture_output=True, text=True, timeout=120)


def test_stores_of_one_process_share_the_lock_and_the_last_one_closed_releases_it(tmp_path):
    root = tmp_path / "state"
    first, second = StateStore(root), StateStore(root)  # an engine restarted in the same process
    tmp = root / "fragments" / f".v000000000001.frag.{os.getpid()}.tmp"
    tmp.write_bytes(b"in flight")
    refused = _other_process_opens(root)
    assert refused.returncode == 3, refused.stderr
    assert f"pid {os.getpid()} on host" in refused.stdout and str(root) in refused.stdout
    assert tmp.exists(), "a refused store removes nothing"
    first.close()
    first.close()  # closing twice gives back one use, once
    assert _other_process_opens(root).returncode == 3, "the second store still holds it"
    second.close()
    taken = _other_process_opens(root)
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert not tmp.exists(), "the store that took the lock removed the temp files"
    again = StateStore(root)  # and this process can take it back
    assert _other_process_opens(root).returncode == 3
    again.close()


def test_a_second_store_of_one_process_leaves_the_firsts_commits_in_flight(tmp_path):
    """Stores of one dir in one process share its lock; only the one that took it removes the temp
    files of commits cut off by a crash (the second would delete the first's commits in flight)."""
    first = StateStore(tmp_path / "state")
    in_flight = tmp_path / "state" / "fragments" / ".v000000000003.frag.tmp"
    in_flight.write_bytes(b"half a commit")
    second = StateStore(tmp_path / "state")
    assert in_flight.exists()
    second.close()
    first.close()
    StateStore(tmp_path / "state").close()  # a fresh start: what was in flight was cut off
    assert not in_flight.exists()
