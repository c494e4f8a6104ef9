"""Joining, as a pod sees it: a learner whose synchronizer is not there yet leaves at once on
SIGTERM (a scale-down or rollout does not wait out the grace period), and gives up with a clear
error after ``join_timeout_s``. Real learner processes against a port nobody serves."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

CONFIG = """
protocol: {num_fragments: 4, sync_every: 8}
model: {d_model: 32, n_layer: 1, n_head: 2, context: 32}
data: {batch_size: 4, context: 32, max_bytes: 200000}
learner: {JOIN}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _learner(tmp_path, join: str) -> subprocess.Popen[str]:
    cfg = tmp_path / "learner.yaml"
    cfg.write_text(CONFIG.replace("{JOIN}", join))
    return subprocess.Popen([sys.executable, "-m", "ddiloco.core.cli", "learner", "--synchronizer",
                             f"127.0.0.1:{_free_port()}", "--learner-id", "learner-0", "--config", str(cfg),
                             "--steps", "10", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigterm_while_joining_ends_the_learner_at_once(tmp_path):
    proc = _learner(tmp_path, "{}")
    try:
        lines = []
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # wait until it is trying to reach the synchronizer
            lines.append(line)
            if "reconnecting" in line or time.monotonic() > deadline:
                break
        assert any("reconnecting" in line for line in lines), "".join(lines)[-2000:]
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out[-2000:]
        assert time.monotonic() - sent < 10
        assert "drained before joining" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_join_timeout_gives_up_with_a_clear_error(tmp_path):
    proc = _learner(tmp_path, "{join_timeout_s: 2.0}")
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3
    assert "join_timeout_s" in out


def test_a_model_that_cannot_be_split_is_a_clear_error(tmp_path):
    cfg = tmp_path / "learner.yaml"
    cfg.write_text(CONFIG.replace("{JOIN}", "{}").replace("num_fragments: 4", "num_fragments: 64"))
    proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "learner", "--synchronizer", "127.0.0.1:9",
                           "--learner-id", "a", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("ddiloco learner: cannot split") and "Traceback" not in proc.stderr
