"""The fleet as containers on a real Docker engine, broken the ways an orchestrator breaks it.

One synchronizer (state on a named volume) and three learners on a user-defined network train and
merge; then, in order: a learner is killed (``docker kill``) and a new one started (scale down and
up), one is frozen (``docker pause``: a straggler), the synchronizer is restarted on its volume
(``docker restart``), a learner is cut off the network and put back (``docker network
disconnect``/``connect``), and finally every learner is stopped with SIGTERM (``docker stop``),
which drains. After each fault the others keep merging; at the end the run's event logs must show
versions monotonic per fragment across the restart, every contribution accounted for, and every
restarted or new learner contributing again.

A learner stopped while it is still joining leaves within seconds, not after the grace period.
These run the checkout's own code in the ``hostroot`` image; test_images.py runs the real images.
The containers and the network are testcontainers' (fleet.py); each fault is sent to the Docker
SDK container it wraps.
"""

from __future__ import annotations

import time

import pytest
from docker.models.containers import Container

from tests.containers.conftest import hostroot_command, hostroot_mounts
from tests.containers.fleet import Fleet, wait_for

pytestmark = pytest.mark.timeout(900)


@pytest.fixture()
def fleet(docker_client, hostroot_image, tmp_path):
    f = Fleet(docker_client, {"synchronizer": hostroot_image, "learner": hostroot_image}, hostroot_mounts(),
              hostroot_command, tmp_path)
    yield f
    f.close()


def _live(fleet: Fleet) -> set[str]:
    s = fleet.status()
    return {ls["learner_id"] for ls in (s or {}).get("learners", []) if ls.get("live")}


def _versions(fleet: Fleet) -> dict[int, int]:
    s = fleet.status() or {}
    return {int(f["fragment_id"]): int(f["version"]) for f in s.get("fragments", [])}


def _pause(container: Container, attempts: int = 5) -> None:
    """``docker pause``, tried again when the cgroup freezer gives up ("unable to freeze": runc
    could not freeze every task in its time, which happens on a loaded machine); bounded."""
    import docker.errors

    for attempt in range(attempts):
        try:
            container.pause()
            return
        except docker.errors.APIError as exc:
            if "unable to freeze" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(1.0)


def test_a_containerised_fleet_survives_kill_pause_restart_and_disconnect(fleet, docker_client):
    fleet.start_synchronizer()
    for i in range(3):
        fleet.start_learner(f"learner-{i}")
    t0 = time.time()
    for i in range(3):
        wait_for(f"learner-{i} in a merge", lambda i=i: fleet.merges_with(f"learner-{i}", t0), 240)
    assert _live(fleet) == {"learner-0", "learner-1", "learner-2"}
    chaos_t = time.time()

    # scale down and up: SIGKILL one learner, start a new one
    fleet.sdk("learner-2").kill()
    fleet.start_learner("learner-3")
    t = time.time()
    wait_for("learner-3 contributing", lambda: fleet.merged_results("learner-3", t), 180)
    wait_for("the others merging after the kill", lambda: fleet.merges_with("learner-0", t), 60)

    # straggler: freeze learner-1; the others go on merging without it, and of learner-1 only what
    # it had sent before it froze (in flight then) may still land
    _pause(fleet.sdk("learner-1"))
    t = time.time()
    try:
        wait_for("merges without the paused learner",
                 lambda: fleet.merges_with("learner-0", t) >= 2 and fleet.merges_with("learner-3", t) >= 2, 90)
        landed = fleet.merged_contributions("learner-1", t)
        assert landed <= fleet.sent("learner-1", t), (sorted(landed), "merged, not sent before the pause")
    finally:
        fleet.sdk("learner-1").unpause()
    t = time.time()
    wait_for("learner-1 contributing again after the pause", lambda: fleet.merged_results("learner-1", t), 120)

    # the synchronizer restarts on its volume: versions carry on from the committed state
    before = wait_for("versions before the restart", lambda: _versions(fleet), 30)
    fleet.sdk("synchronizer").restart(timeout=30)
    t = time.time()
    after = wait_for("the restarted synchronizer answering", lambda: _versions(fleet), 120)
    assert all(after[p] >= v for p, v in before.items()), (before, after)
    for lid in ("learner-0", "learner-1", "learner-3"):
        wait_for(f"{lid} merging after the restart", lambda lid=lid: fleet.merges_with(lid, t), 180)

    # network partition of one learner, then healed
    fleet.disconnect("learner-0")
    t = time.time()
    try:
        wait_for("merges during the partition", lambda: fleet.merges_with("learner-3", t) >= 2, 90)
    finally:
        fleet.reconnect("learner-0")
    t = time.time()
    wait_for("learner-0 contributing again after the partition", lambda: fleet.merged_results("learner-0", t), 180)

    # scale to zero: SIGTERM drains every learner within its grace period
    for lid in ("learner-0", "learner-1", "learner-3"):
        c = fleet.sdk(lid)
        started = time.monotonic()
        c.stop(timeout=60)
        c.reload()
        assert c.attrs["State"]["ExitCode"] == 0, fleet.logs(lid)
        assert time.monotonic() - started < 60, f"{lid} took the whole grace period"
    fleet.sdk("synchronizer").stop(timeout=30)

    result = fleet.check(chaos_t)
    assert result["versions_monotonic"], result["version_problems"]
    assert result["unaccounted_contributions"] == 0, result
    assert result["every_restarted_learner_contributed"], result["restarted_learners"]
    assert "learner-3" in result["restarted_learners"]


def test_docker_stop_of_a_joining_learner_returns_within_seconds(fleet):
    # nothing serves the address it dials: it stays in the joining phase
    learner = fleet.start_learner("learner-0", synchronizer="nobody-here:7000")
    wait_for("the learner trying to join", lambda: b"reconnecting" in b"".join(learner.get_logs()), 120)
    c = fleet.sdk("learner-0")
    started = time.monotonic()
    c.stop(timeout=60)
    took = time.monotonic() - started
    c.reload()
    assert c.attrs["State"]["ExitCode"] == 0, fleet.logs("learner-0")
    # half the 60 s grace period: it leaves at once, with room for a machine twice as slow
    assert took < 30, f"docker stop took {took:.1f}s"
    assert b"drained before joining" in b"".join(learner.get_logs())
