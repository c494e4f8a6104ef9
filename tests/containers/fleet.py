"""A ddiloco fleet as Docker containers on a user-defined network, and what the tests read of it.

The containers and the network are made, started and removed with testcontainers
(``DockerContainer`` on a ``Network``); the faults testcontainers has no verb for (kill, pause,
restart, ``docker stop`` without removing, network disconnect) go to the Docker SDK objects it
wraps. The synchronizer's state lives on a named volume, made with the Docker SDK
(testcontainers makes none), and every container, the network and the volume carry this
session's testcontainers label, so whatever a broken test leaves behind can be found.

The synchronizer may be sharded (``shards=S``, default 1): then ``synchronizer-0`` ..
``synchronizer-<S-1>`` each run ``--shard s/S`` with a volume and an event log
(``synchronizer-<s>.jsonl``) of their own, and learners dial every shard by its name on the
network (``--synchronizer synchronizer-0:7000,synchronizer-1:7000``). With one shard every name,
file and argument is the unsharded one (``synchronizer``, ``synchronizer.jsonl``, no ``--shard``).

Every container writes its JSON event log into one host folder (bind-mounted at ``/events``), so
the run is checked exactly like a ``ddiloco run`` folder: merge log (every shard's log together),
learner logs, contribution accounting and the chaos invariants of ``ddiloco.lab.invariants``.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Self

from docker.client import DockerClient
from docker.models.containers import Container
from docker.models.volumes import Volume
from testcontainers.core.container import DockerContainer
from testcontainers.core.labels import LABEL_SESSION_ID, SESSION_ID
from testcontainers.core.network import Network

from ddiloco.lab import invariants
from ddiloco.lab.event_logs import MERGE_LOG_EVENTS, load_jsonl, load_run_dir
from ddiloco.lab.goodput import fleet_summary

CONFIG = """\
protocol: {num_fragments: 4, sync_every: 8}
model: {d_model: 32, n_layer: 1, n_head: 2, context: 32}
data: {batch_size: 4, context: 32, max_bytes: 200000}
train: {threads: 1, eval_every: 0}
"""

STEPS = "1000000"
"""Learners run until they are stopped (every scenario is bounded by its own deadlines)."""

ENGINE_TIMEOUT_S = 600
"""Seconds one call to the engine may take: on ``vfs`` creating a container copies its whole
image (gigabytes for the real images), far beyond the Docker SDK's default minute."""

Mount = tuple[str, str, str]
"""(host path or volume name, path in the container, "ro" or "rw"): ``with_volume_mapping``'s."""


def wait_for(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


EXEC_ATTEMPTS = 5
"""Tries of a command run in a container whose output is wanted (``exec_output``)."""


def exec_output(container: DockerContainer, argv: list[str]) -> tuple[int, bytes]:
    """Run ``argv`` in ``container`` and return its exit code and output, for a command that always
    prints. The engine can lose the whole output of a short-lived exec and still report exit code 0
    (moby/moby#27289, docker/docker-py#2042; seen here once in a CI run); such a run is tried again,
    at most ``EXEC_ATTEMPTS`` times, and the last result is returned for the caller to judge."""
    for _ in range(EXEC_ATTEMPTS):
        code, out = container.exec(argv)
        if code != 0 or out:
            break
        time.sleep(0.2)
    return code, out


class _Container(DockerContainer):
    def with_loopback_port(self, port: str) -> Self:
        """Publish ``port`` on 127.0.0.1 only, on a host port the engine picks: testcontainers'
        ``with_bind_ports`` takes no host address (the engine would listen on every interface),
        and ``ports`` cannot go through ``with_kwargs`` (``start`` passes its own)."""
        self.ports[port] = ("127.0.0.1", None)  # type: ignore[assignment]
        return self


class Fleet:
    """Containers of one scenario; ``close()`` removes every container, the network and the volumes."""

    def __init__(self, client: DockerClient, images: dict[str, str], mounts: Iterable[Mount],
                 command: Callable[..., list[str]], workdir: pathlib.Path, config: str = CONFIG,
                 shards: int = 1) -> None:
        """``client``: the engine's Docker SDK client (the volumes, and the verbs testcontainers
        lacks); ``images``: role ("synchronizer", "learner") -> image; ``mounts``: what every
        container mounts besides the event folder and the config; ``command(*args)``: the
        container command line of ``ddiloco *args`` in those images; ``shards``: how many
        synchronizer shards (each its own container and volume)."""
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards}")
        self.client, self.images, self.mounts, self.command = client, images, list(mounts), command
        self.shards = shards
        self.tag = uuid.uuid4().hex[:8]
        self.events = workdir / "events"
        self.events.mkdir(mode=0o777)
        self.events.chmod(0o777)  # the real images write as an unprivileged user
        self.config = workdir / "config.yaml"
        self.config.write_text(config)
        self.config.chmod(0o644)
        self.containers: dict[str, DockerContainer] = {}
        self._started: list[DockerContainer] = []
        self._learner_runs: dict[str, int] = {}
        self.network = Network(docker_client_kw={"timeout": ENGINE_TIMEOUT_S},
                               docker_network_kw={"driver": "bridge"}).create()
        self.volumes: list[Volume] = []
        try:
            for shard in range(shards):
                suffix = "" if shards == 1 else f"-{shard}"
                self.volumes.append(client.volumes.create(f"ddiloco-state-{self.tag}{suffix}",
                                                          labels={LABEL_SESSION_ID: SESSION_ID}))
        except BaseException:
            for volume in self.volumes:
                with contextlib.suppress(Exception):
                    volume.remove(force=True)
            self.network.remove()
            raise

    @property
    def volume(self) -> Volume:
        """The (first) synchronizer shard's volume: the only one when unsharded."""
        return self.volumes[0]

    def synchronizer_name(self, shard: int | None = None) -> str:
        """Container name and network alias of ``shard`` (None: shard 0, the only one unsharded)."""
        shard = 0 if shard is None else shard
        if not 0 <= shard < self.shards:
            raise ValueError(f"no shard {shard} among {self.shards}")
        return "synchronizer" if self.shards == 1 else f"synchronizer-{shard}"

    def synchronizer_log(self, shard: int | None = None) -> pathlib.Path:
        """The host path of ``shard``'s event log (its merge log)."""
        return self.events / f"{self.synchronizer_name(shard)}.jsonl"

    @property
    def synchronizer_address(self) -> str:
        """What learners dial: every shard's alias on the network, shard 0 first."""
        return ",".join(f"{self.synchronizer_name(s)}:7000" for s in range(self.shards))

    # -- containers ----------------------------------------------------------------------------

    def _run(self, role: str, name: str, args: list[str], *, mounts: Iterable[Mount] = (),
             loopback_ports: Iterable[str] = ()) -> DockerContainer:
        container = (_Container(self.images[role], docker_client_kw={"timeout": ENGINE_TIMEOUT_S})
                     .with_command(self.command(*args))
                     .with_name(f"{name}-{self.tag}")
                     .with_network(self.network)
                     .with_network_aliases(name)
                     .with_env("PYTHONUNBUFFERED", "1")
                     .with_env("PYTHONDONTWRITEBYTECODE", "1")
                     .with_env("HOME", "/tmp")
                     .with_kwargs(hostname=name, stop_signal="SIGTERM"))
        for host, inside, mode in [*self.mounts, (str(self.events), "/events", "rw"),
                                   (str(self.config), "/etc/ddiloco/config.yaml", "ro"), *mounts]:
            container.with_volume_mapping(host, inside, mode)
        for port in loopback_ports:
            container.with_loopback_port(port)
        # registered before it starts: a start that fails half-way still leaves a container to remove
        self._started.append(container)
        self.containers[name] = container
        return container.start()

    def start_synchronizer(self, *extra: str, shard: int | None = None) -> DockerContainer:
        """Start one synchronizer shard (None: shard 0, the only one unsharded); see
        ``start_synchronizers`` for all of them."""
        shard = 0 if shard is None else shard
        # learners dial it by its alias on the network: synchronizer:7000 (synchronizer-<s>:7000)
        name = self.synchronizer_name(shard)
        sharding = [] if self.shards == 1 else ["--shard", f"{shard}/{self.shards}"]
        return self._run("synchronizer", name,
                         ["synchronizer", "--listen", "0.0.0.0:7000", "--state-dir", "/state",
                          "--config", "/etc/ddiloco/config.yaml", "--quorum", "1",
                          "--event-log", f"/events/{name}.jsonl", *sharding, *extra],
                         mounts=[(self.volumes[shard].name, "/state", "rw")], loopback_ports=["7000/tcp"])

    def start_synchronizers(self, *extra: str) -> list[DockerContainer]:
        """Start every synchronizer shard, shard 0 first."""
        return [self.start_synchronizer(*extra, shard=s) for s in range(self.shards)]

    def start_learner(self, learner_id: str, *, synchronizer: str | None = None) -> DockerContainer:
        """A learner dialling ``synchronizer`` (default: every shard of this fleet's)."""
        synchronizer = self.synchronizer_address if synchronizer is None else synchronizer
        run = self._learner_runs.get(learner_id, 0)
        self._learner_runs[learner_id] = run + 1
        # a restarted container of the same id logs into a file of its own; logs are joined by id
        return self._run("learner", learner_id, ["learner", "--synchronizer", synchronizer, "--learner-id", learner_id,
                                                 "--config", "/etc/ddiloco/config.yaml", "--steps", STEPS,
                                                 "--event-log", f"/events/{learner_id}.{run}.jsonl"])

    def sdk(self, name: str) -> Container:
        """The Docker SDK container under ``name``'s testcontainer: kill, pause, restart and
        ``docker stop`` (testcontainers' ``stop`` removes the container) are its verbs only."""
        return self.containers[name].get_wrapped_container()

    def disconnect(self, name: str) -> None:
        """``docker network disconnect`` of ``name`` (a testcontainers ``Network`` only connects)."""
        self.client.networks.get(self.network.id).disconnect(self.sdk(name))

    def reconnect(self, name: str) -> None:
        self.network.connect(self.containers[name].get_container_id(), network_aliases=[name])

    def status_port(self, shard: int | None = None) -> int | None:
        """A synchronizer shard's published port, read afresh: a restart may publish another
        (None while its container is not running, and so publishes none)."""
        c = self.sdk(self.synchronizer_name(shard))
        c.reload()
        bindings = (c.attrs["NetworkSettings"].get("Ports") or {}).get("7000/tcp")
        return int(bindings[0]["HostPort"]) if bindings else None

    def status(self, shard: int | None = None) -> dict[str, Any] | None:
        """``ddiloco status --json`` against the published port(s); None while it does not answer.

        Unsharded, or with ``shard`` given: that synchronizer's own status (``fragments``,
        ``learners``, ...). Sharded with no ``shard``: the fleet view of every shard (``shards``,
        ``fleet``, ``problems``), None unless every shard answered and they agree (exit 0)."""
        shards = [shard] if shard is not None or self.shards == 1 else list(range(self.shards))
        ports = [self.status_port(s) for s in shards]
        if None in ports:
            return None
        proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "status", "--synchronizer",
                               ",".join(f"127.0.0.1:{port}" for port in ports), "--json", "--timeout", "5"],
                              capture_output=True, text=True, timeout=60)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def logs(self, name: str) -> str:
        try:
            return self.sdk(name).logs(tail=60).decode(errors="replace")
        except Exception as exc:  # diagnostics only
            return f"<no logs: {exc}>"

    def close(self) -> None:
        for c in reversed(self._started):
            with contextlib.suppress(Exception):  # already gone, or never created
                c.stop()
        with contextlib.suppress(Exception):
            self.network.remove()
        for volume in self.volumes:
            with contextlib.suppress(Exception):
                volume.remove(force=True)

    # -- what the event logs say ---------------------------------------------------------------

    def merges(self, shard: int | None = None) -> list[dict[str, Any]]:
        """The merge log: every shard's, sorted by time; with ``shard``, only that shard's own."""
        if shard is None:
            return load_run_dir(self.events).merges
        return [e for e in load_jsonl(self.synchronizer_log(shard), missing_ok=True)
                if e.get("event") in MERGE_LOG_EVENTS]

    def merges_with(self, learner_id: str, after: float) -> int:
        return sum(1 for m in self.merges() if m.get("event") == "merge" and m["t"] > after
                   and learner_id in m.get("learners", []))

    def merged_contributions(self, learner_id: str, after: float) -> set[tuple[int, int]]:
        """(incarnation, sequence) of every contribution of ``learner_id`` in a merge after ``after``."""
        return {(int(inc), int(seq)) for m in self.merges() if m.get("event") == "merge" and m["t"] > after
                for lid, inc, seq in m.get("contributions", []) if lid == learner_id}

    def sent(self, learner_id: str, before: float) -> set[tuple[int, int]]:
        """(incarnation, sequence) of every contribution ``learner_id`` logged as sent before ``before``."""
        events = load_run_dir(self.events).learners.get(learner_id, [])
        return {(int(e["incarnation"]), int(e["sequence"])) for e in events
                if e["event"] == "send" and e["t"] < before}

    def merged_results(self, learner_id: str, after: float) -> int:
        events = load_run_dir(self.events).learners.get(learner_id, [])
        return sum(1 for e in events if e["event"] == "result" and e.get("outcome") == "merged" and e["t"] > after)

    def check(self, chaos_t: float) -> dict[str, Any]:
        logs = load_run_dir(self.events)
        return invariants.check(logs.learners, logs.merges, fleet_summary(logs.learners, logs.merges), chaos_t)
