"""The real images, built from the repository's Dockerfile: a synchronizer and two learners made
from them train and merge on a user-defined network, each container holds only its own service and
runs as an unprivileged user, and the synchronizer's state on a named volume (written as that user)
survives its restart. The containers are testcontainers' (fleet.py); restart and ``docker stop`` go
to the Docker SDK container each wraps."""

from __future__ import annotations

import time

import pytest
from testcontainers.core.container import DockerContainer

from tests.containers.fleet import Fleet, exec_output, wait_for

pytestmark = pytest.mark.timeout(1800)


def _ddiloco(*args: str) -> list[str]:
    return list(args)  # the images' entry point is `ddiloco`


def _own_service_only(container: DockerContainer, role: str, other: str) -> None:
    """What a running container of the image holds: its service's command and not the other's,
    no lab, and it runs as the unprivileged user."""
    code, out = exec_output(container, ["ddiloco", "--help"])
    assert code == 0, out
    commands = out.decode().split("installed commands:")[1].split("\n\n")[0]
    names = {line.split()[0] for line in commands.strip().splitlines()}
    assert role in names and other not in names and "run" not in names, names
    code, out = exec_output(container, ["python", "-c", "import os; print(os.getuid(), os.getgid())"])
    assert code == 0 and out.decode().split() == ["10001", "10001"], out


def test_real_images_train_merge_and_keep_state_across_a_restart(docker_client, service_images, tmp_path):
    fleet = Fleet(docker_client, service_images, [], _ddiloco, tmp_path)
    try:
        fleet.start_synchronizer()
        for i in range(2):
            fleet.start_learner(f"learner-{i}")
        t0 = time.time()
        for i in range(2):
            wait_for(f"learner-{i} in a merge", lambda i=i: fleet.merges_with(f"learner-{i}", t0), 300)
        _own_service_only(fleet.containers["synchronizer"], "synchronizer", "learner")
        _own_service_only(fleet.containers["learner-0"], "learner", "synchronizer")
        before = {int(f["fragment_id"]): int(f["version"]) for f in fleet.status()["fragments"]}

        fleet.sdk("synchronizer").restart(timeout=30)  # state on the named volume, written as uid 10001
        t = time.time()
        after = wait_for("the restarted synchronizer answering", lambda: (fleet.status() or {}).get("fragments"), 120)
        assert all(int(f["version"]) >= before[int(f["fragment_id"])] for f in after), (before, after)
        for i in range(2):
            wait_for(f"learner-{i} merging after the restart", lambda i=i: fleet.merges_with(f"learner-{i}", t), 180)

        for i in range(2):
            c = fleet.sdk(f"learner-{i}")
            c.stop(timeout=60)
            c.reload()
            assert c.attrs["State"]["ExitCode"] == 0, fleet.logs(f"learner-{i}")
        fleet.sdk("synchronizer").stop(timeout=30)
        result = fleet.check(t0)
        assert result["versions_monotonic"], result["version_problems"]
        assert result["unaccounted_contributions"] == 0, result
    finally:
        fleet.close()
