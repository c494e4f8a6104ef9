"""No secret leaves its file: real ``ddiloco synchronizer`` and ``ddiloco learner`` processes with
tokens from files, then every output is searched for the tokens.

Searched: both processes' stdout and stderr (the structured logs), the event logs, the
synchronizer's Prometheus page, ``ddiloco status --json``, and the processes' command lines. A
learner with the wrong token is refused and says so without echoing it.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request

from ddiloco.lab.cluster import wait_ready_info

CONFIG = """
protocol: {num_fragments: 2, sync_every: 8, overlap: 2}
model: {d_model: 32, n_layer: 1, n_head: 2, context: 32}
data: {batch_size: 4, context: 32, max_bytes: 300000}
train: {eval_every: 1000, eval_batches: 1, lr: 0.003, warmup_steps: 2}
synchronizer: {policy: {quorum: 1, grace_gamma: 0.5, max_grace_s: 0.5}, heartbeat_interval_s: 0.5,
               operators: [ops]}
"""
TOKENS = {"learner-0": "tok-learner-0-7f3a9c1e5b2d", "ops": "tok-operator-4e8d2a6c0f1b",
          "learner-1": "tok-learner-1-9b1c3e5a7d2f"}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddiloco.core.cli", *args]


def test_tokens_appear_in_no_log_metric_status_or_command_line(tmp_path: pathlib.Path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG)
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text("".join(f"{k}: {v}\n" for k, v in TOKENS.items()))
    for name, token in TOKENS.items():
        (tmp_path / f"{name}.token").write_text(token + "\n")
    (tmp_path / "wrong.token").write_text("tok-not-listed-anywhere-0000\n")
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if k != "DDILOCO_TOKEN"}
    sync = subprocess.Popen(_cli("synchronizer", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                                 "--config", str(cfg), "--auth-tokens-file", str(tokens_file), "--metrics-port", "0",
                                 "--event-log", str(tmp_path / "sync.jsonl"), "--ready-file", str(ready)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        info = wait_ready_info(sync, ready, timeout_s=60)
        target = f"127.0.0.1:{info['port']}"
        learner = subprocess.run(  # the token from the environment (a Secret exposed as a variable)
            _cli("learner", "--synchronizer", target, "--learner-id", "learner-0", "--config", str(cfg),
                 "--steps", "24", "--threads", "1", "--event-log", str(tmp_path / "learner-0.jsonl")),
            capture_output=True, text=True, timeout=240, env={**env, "DDILOCO_TOKEN": TOKENS["learner-0"]})
        assert learner.returncode == 0, learner.stderr[-2000:]
        cmdline = pathlib.Path(f"/proc/{sync.pid}/cmdline").read_bytes().decode(errors="replace")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=10).read().decode()
        status = subprocess.run(_cli("status", "--synchronizer", target, "--json", "--token-file",
                                     str(tmp_path / "ops.token")), capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["fragments"]
        as_learner = subprocess.run(_cli("status", "--synchronizer", target, "--token-file",
                                         str(tmp_path / "learner-1.token")), capture_output=True, text=True, timeout=60)
        assert as_learner.returncode == 1 and "PERMISSION_DENIED" in as_learner.stderr
        impostor = subprocess.run(  # the token from a file (a mounted Secret)
            _cli("learner", "--synchronizer", target, "--learner-id", "learner-1", "--config", str(cfg),
                 "--steps", "4", "--threads", "1", "--token-file", str(tmp_path / "wrong.token")),
            capture_output=True, text=True, timeout=120, env=env)
        assert impostor.returncode != 0
        assert "UNAUTHENTICATED" in impostor.stdout + impostor.stderr
    finally:
        sync.send_signal(signal.SIGTERM)
        sync_out, _ = sync.communicate(timeout=60)
    outputs = {
        "synchronizer output": sync_out, "learner output": learner.stdout + learner.stderr,
        "impostor output": impostor.stdout + impostor.stderr, "metrics": metrics, "status": status.stdout,
        "status refusal": as_learner.stderr, "synchronizer command line": cmdline,
        "synchronizer event log": (tmp_path / "sync.jsonl").read_text(),
        "learner event log": (tmp_path / "learner-0.jsonl").read_text(),
    }
    assert '"merge"' in outputs["synchronizer event log"]
    assert '"token": "<redacted>"' in outputs["learner event log"].replace('"token":"', '"token": "')
    for where, text in outputs.items():
        for token in [*TOKENS.values(), "tok-not-listed-anywhere-0000"]:
            assert token not in text, f"a token appears in the {where}"
