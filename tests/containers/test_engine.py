"""The container tests' own engine: a storage driver dockerd refuses is passed over, not fatal.

The engine fixture tries ``overlay2`` first and falls back to ``vfs`` when dockerd exits at
start-up. Here a real dockerd is given a driver it cannot load, on a root of its own (it never
touches the suite's engine), and must be reported as refused with nothing left running.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest

from tests.containers.conftest import _install_engine, _start_engine, is_mount_point


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
