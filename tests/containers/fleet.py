"""A ddiloco fleet as Docker containers on a user-defined network, and what the tests read of it.

Every container writes its JSON event log into one host folder (bind-mounted at ``/events``), so
the run is checked exactly like a ``ddiloco run`` folder: merge log, learner logs, contribution
accounting and the chaos invariants of ``ddiloco.lab.invariants``.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from ddiloco.lab import invariants
from ddiloco.lab.event_logs import load_run_dir
from ddiloco.lab.goodput import fleet_summary

CONFIG = """\
protocol: {num_fragments: 4, sync_every: 8}
model: {d_model: 32, n_layer: 1, n_head: 2, context: 32}
data: {batch_size: 4, context: 32, max_bytes: 200000}
train: {threads: 1, eval_every: 0}
"""

STEPS = "1000000"
"""Learners run until they are stopped (every scenario is bounded by its own deadlines)."""


def wait_for(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


class Fleet:
    """Containers of one scenario; ``close()`` removes every container, the network and volume."""

    def __init__(self, client, images: dict[str, str], mounts: dict[str, dict[str, str]],
                 command: Callable[..., list[str]], workdir: pathlib.Path, config: str = CONFIG) -> None:
        """``images``: role ("synchronizer", "learner") -> image; ``command(*args)``: the container
        command line of ``ddiloco *args`` in those images."""
        self.client, self.images, self.mounts, self.command = client, images, mounts, command
        self.tag = uuid.uuid4().hex[:8]
        self.events = workdir / "events"
        self.events.mkdir(mode=0o777)
        self.events.chmod(0o777)  # the real images write as an unprivileged user
        self.config = workdir / "config.yaml"
        self.config.write_text(config)
        self.config.chmod(0o644)
        self.network = client.networks.create(f"ddiloco-{self.tag}", driver="bridge")
        self.volume = client.volumes.create(f"ddiloco-state-{self.tag}")
        self.containers: dict[str, Any] = {}
        self._learner_runs: dict[str, int] = {}

    # -- containers ----------------------------------------------------------------------------

    def _run(self, role: str, name: str, args: list[str], **kwargs: Any):
        volumes = dict(self.mounts)
        volumes[str(self.events)] = {"bind": "/events", "mode": "rw"}
        volumes[str(self.config)] = {"bind": "/etc/ddiloco/config.yaml", "mode": "ro"}
        volumes.update(kwargs.pop("volumes", {}))
        container = self.client.containers.run(
            self.images[role], self.command(*args), name=f"{name}-{self.tag}", hostname=name, detach=True,
            network=self.network.name, volumes=volumes,
            environment={"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"},
            stop_signal="SIGTERM", **kwargs)
        self.network.reload()
        self.containers[name] = container
        return container

    def start_synchronizer(self, *extra: str):
        c = self._run("synchronizer", "synchronizer", ["synchronizer", "--listen", "0.0.0.0:7000", "--state-dir", "/state",
                                       "--config", "/etc/ddiloco/config.yaml", "--quorum", "1",
                                       "--event-log", "/events/synchronizer.jsonl", *extra],
                      volumes={self.volume.name: {"bind": "/state", "mode": "rw"}},
                      ports={"7000/tcp": ("127.0.0.1", None)})
        return c  # learners dial it by its host name on the network: synchronizer:7000

    def start_learner(self, learner_id: str, *, synchronizer: str = "synchronizer:7000"):
        run = self._learner_runs.get(learner_id, 0)
        self._learner_runs[learner_id] = run + 1
        # a restarted container of the same id logs into a file of its own; logs are joined by id
        return self._run("learner", learner_id, ["learner", "--synchronizer", synchronizer, "--learner-id", learner_id,
                                      "--config", "/etc/ddiloco/config.yaml", "--steps", STEPS,
                                      "--event-log", f"/events/{learner_id}.{run}.jsonl"])

    def status_port(self) -> int:
        c = self.containers["synchronizer"]
        c.reload()
        return int(c.attrs["NetworkSettings"]["Ports"]["7000/tcp"][0]["HostPort"])

    def status(self) -> dict[str, Any] | None:
        """``ddiloco status --json`` against the published port (None while it does not answer)."""
        proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "status", "--synchronizer",
                               f"127.0.0.1:{self.status_port()}", "--json", "--timeout", "5"],
                              capture_output=True, text=True, timeout=60)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def logs(self, name: str) -> str:
        try:
            return self.containers[name].logs(tail=60).decode(errors="replace")
        except Exception as exc:  # diagnostics only
            return f"<no logs: {exc}>"

    def close(self) -> None:
        for c in self.containers.values():
            with contextlib.suppress(Exception):  # already gone
                c.remove(force=True)
        for thing in (self.network, self.volume):
            with contextlib.suppress(Exception):
                thing.remove()

    # -- what the event logs say ---------------------------------------------------------------

    def merges(self) -> list[dict[str, Any]]:
        return load_run_dir(self.events).merges

    def merges_with(self, learner_id: str, after: float) -> int:
        return sum(1 for m in self.merges() if m.get("event") == "merge" and m["t"] > after
                   and learner_id in m.get("learners", []))

    def merged_results(self, learner_id: str, after: float) -> int:
        events = load_run_dir(self.events).learners.get(learner_id, [])
        return sum(1 for e in events if e["event"] == "result" and e.get("outcome") == "merged" and e["t"] > after)

    def check(self, chaos_t: float) -> dict[str, Any]:
        logs = load_run_dir(self.events)
        return invariants.check(logs.learners, logs.merges, fleet_summary(logs.learners, logs.merges), chaos_t)
