"""The container tests' own engine: a storage driver dockerd refuses is passed over, not fatal;
a stopped engine's roots are set aside for the session's end, in a folder of the session's own.

The engine fixture tries ``overlay2`` first and falls back to ``vfs`` when dockerd exits at
start-up. Here a real dockerd is given a driver it cannot load, on a root of its own (it never
touches the suite's engine), and must be reported as refused with nothing left running.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest

from tests.conftest import ENGINE_LEFTOVERS_ROOT, SESSION_PID_ENV, engine_leftovers, remove_set_aside
from tests.containers.conftest import (
    _install_engine,
    _start_engine,
    is_mount_point,
    release_mounts,
    set_aside,
)


@pytest.fixture
def engine_root():
    # short: dockerd's containerd socket lives under it, and a unix socket path has at most 107 bytes
    root = pathlib.Path(tempfile.mkdtemp(prefix="dde-"))
    yield root
    shutil.rmtree(root)


def test_a_storage_driver_dockerd_refuses_is_passed_over_and_leaves_nothing_running(engine_root):
    _install_engine()
    root = engine_root
    (root / "data").mkdir()
    (root / "data" / "half-made").write_text("left by a refused start")

    proc = _start_engine(root, "no-such-driver")

    assert proc is None, "dockerd answered with a driver that does not exist"
    log = (root / "dockerd.log").read_text()
    assert "--- dockerd --storage-driver=no-such-driver" in log
    assert "error initializing graphdriver" in log, "dockerd's own refusal is kept in the log"
    assert not (root / "data" / "half-made").exists(), "a previous half-made root is cleared first"
    assert not is_mount_point(root / "data"), "the data root dockerd bound onto itself is released"
    pid_file = root / "dockerd.pid"
    if pid_file.exists():  # dockerd removes it on a clean exit; if not, its pid must be gone
        pid = int(pid_file.read_text().strip() or 0)
        if pid:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_a_stopped_engines_roots_are_moved_aside_whole_not_removed(engine_root):
    if os.geteuid() != 0:
        pytest.skip("binding a folder onto itself, as dockerd does with its data root, needs root")
    root = engine_root
    (root / "data" / "overlay2").mkdir(parents=True)
    (root / "data" / "overlay2" / "layer").write_text("a layer")
    (root / "exec").mkdir()
    subprocess.run(["mount", "--bind", str(root / "data"), str(root / "data")], check=True, timeout=60)
    leftovers = root / "removed"  # on the engine root's file system, as engine_leftovers() is

    try:
        set_aside(root, leftovers)
    finally:
        release_mounts(root / "data")

    assert not (root / "data").exists() and not (root / "exec").exists()
    assert sorted(p.name.split("-")[0] for p in leftovers.iterdir()) == ["data", "exec"]
    (data,) = leftovers.glob("data-*")
    assert (data / "overlay2" / "layer").read_text() == "a layer", "moved whole, removed later"
    set_aside(root, leftovers)  # nothing left to move
    assert len(list(leftovers.iterdir())) == 2


def test_a_session_removes_its_own_and_ended_sessions_set_aside_roots_never_a_running_ones(tmp_path):
    root = tmp_path / "removed"
    running = subprocess.Popen(["sleep", "120"])
    ended = subprocess.Popen(["true"])
    ended.wait(timeout=60)
    try:
        for name in (str(os.getpid()), str(running.pid), str(ended.pid), "not-a-session"):
            (root / name / "data-1").mkdir(parents=True)
            (root / name / "data-1" / "layer").write_text("a layer")

        removed = remove_set_aside(root, os.getpid())

        assert sorted(p.name for p in removed) == sorted([str(os.getpid()), str(ended.pid)])
        assert sorted(p.name for p in root.iterdir()) == sorted([str(running.pid), "not-a-session"])
        assert (root / str(running.pid) / "data-1" / "layer").read_text() == "a layer", "a running session's stay"
    finally:
        running.kill()
        running.wait(timeout=60)
    assert remove_set_aside(root, os.getpid()) == [root / str(running.pid)], "ended since: removed"
    assert remove_set_aside(tmp_path / "never-made", os.getpid()) == []


def test_this_sessions_roots_are_set_aside_under_its_controlling_process():
    folder = engine_leftovers()
    assert folder.parent == ENGINE_LEFTOVERS_ROOT
    assert folder.name == os.environ[SESSION_PID_ENV], "set by the controller, inherited by xdist's workers"
    os.kill(int(folder.name), 0)  # the controlling process is this one or this worker's controller
