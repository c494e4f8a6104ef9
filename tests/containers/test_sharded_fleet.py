"""A sharded synchronizer as containers on a real Docker engine: one shard killed and started again.

Two synchronizer shards (``synchronizer-0`` and ``synchronizer-1``, ``--shard s/2``, each with its
own named volume and event log) and two learners that dial both by their names on the network
train and merge: each shard merges only the fragments it owns (p mod 2 == s), and
``ddiloco status`` over both shows one consistent fleet. Then shard 1's container is killed
(``docker kill``) and kept down for ``DOWN_S``: shard 0 goes on merging (its versions advance, with
both learners) and the learners go on stepping to the end of the outage. Started again on its
volume (``docker start``), shard 1 comes back with the versions it had committed and merges again,
past them, with both learners. At the end every learner is stopped with SIGTERM (a drain) and the
run's event logs (both shards' merge logs together) must show versions monotonic per fragment and
every contribution accounted for.

These run the checkout's own code in the ``hostroot`` image, like test_fleet_in_containers.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from ddiloco.lab.event_logs import load_run_dir
from tests.containers.conftest import hostroot_command, hostroot_mounts
from tests.containers.fleet import Fleet, wait_for

pytestmark = pytest.mark.timeout(600)

SHARDS = 2
OWNED = {0: {0, 2}, 1: {1, 3}}
"""The fragments each shard owns: the config's 4 fragments, p mod 2."""
LEARNERS = ("learner-0", "learner-1")
DOWN_S = 10.0
"""How long shard 1 stays down at least: many times a healthy shard's gap between merges."""


@pytest.fixture()
def fleet(docker_client, hostroot_image, tmp_path):
    f = Fleet(docker_client, {"synchronizer": hostroot_image, "learner": hostroot_image}, hostroot_mounts(),
              hostroot_command, tmp_path, shards=SHARDS)
    yield f
    f.close()


def _merges(fleet: Fleet, shard: int, after: float = 0.0) -> list[dict[str, Any]]:
    """Shard ``shard``'s merges (from its own event log) after ``after``."""
    return [m for m in fleet.merges(shard) if m["event"] == "merge" and m["t"] > after]


def _merged_everything(fleet: Fleet, shard: int, after: float) -> bool:
    """Whether ``shard`` merged each fragment it owns, and each learner in some merge, after ``after``."""
    merges = _merges(fleet, shard, after)
    return ({int(m["fragment"]) for m in merges} >= OWNED[shard]
            and all(any(lid in m.get("learners", []) for m in merges) for lid in LEARNERS))


def _logged_versions(fleet: Fleet, shard: int) -> dict[int, int]:
    """The highest version each of ``shard``'s fragments reached in its merge log."""
    top: dict[int, int] = {}
    for m in _merges(fleet, shard):
        top[int(m["fragment"])] = max(top.get(int(m["fragment"]), 0), int(m["version"]))
    return top


def _versions(fleet: Fleet, shard: int) -> dict[int, int]:
    """Fragment -> version as shard ``shard`` reports it (empty while it does not answer)."""
    s = fleet.status(shard) or {}
    return {int(f["fragment_id"]): int(f["version"]) for f in s.get("fragments", [])}


def _stepped_after(fleet: Fleet, learner_id: str, after: float) -> int:
    events = load_run_dir(fleet.events).learners.get(learner_id, [])
    return sum(1 for e in events if e["event"] == "step" and e["t"] > after)


def test_one_shard_killed_and_started_again_stalls_only_its_own_fragments(fleet):
    fleet.start_synchronizers()
    for lid in LEARNERS:
        fleet.start_learner(lid)
    t0 = time.time()
    for s in range(SHARDS):
        wait_for(f"shard {s} merging each of its fragments with both learners",
                 lambda s=s: _merged_everything(fleet, s, t0), 240)

    # one fleet, as `ddiloco status` over both shards sees it: every fragment served by its owner,
    # both learners live on both shards
    view = wait_for("ddiloco status answering for both shards", fleet.status, 60)
    assert view["problems"] == [], view["problems"]
    assert [sh["reachable"] for sh in view["shards"]] == [True] * SHARDS, view["shards"]
    assert {f["fragment_id"]: f["shard"] for f in view["fleet"]["fragments"]} == {0: 0, 1: 1, 2: 0, 3: 1}
    live = {ls["learner_id"] for ls in view["fleet"]["learners"] if ls["live"]}
    assert live == set(LEARNERS), view["fleet"]["learners"]

    # shard 1 killed: its fragments stall, shard 0 and training go on
    before_0 = wait_for("shard 0's versions", lambda: _versions(fleet, 0), 30)
    fleet.sdk("synchronizer-1").kill()
    kill_t = time.time()
    before_1 = _logged_versions(fleet, 1)  # what shard 1 had committed: nothing merges there now
    assert set(before_1) == OWNED[1], before_1
    wait_for("shard 1 down", lambda: fleet.status(1) is None, 30)
    wait_for("shard 0's versions advancing while shard 1 is down",
             lambda: (v := _versions(fleet, 0)) and all(v[p] > before_0[p] for p in OWNED[0]), 90)
    wait_for("shard 0 merging with both learners while shard 1 is down",
             lambda: _merged_everything(fleet, 0, kill_t), 90)
    time.sleep(max(0.0, kill_t + DOWN_S - time.time()))
    for lid in LEARNERS:  # still stepping at the end of the outage, not stuck since the kill
        wait_for(f"{lid} stepping through the outage", lambda lid=lid: _stepped_after(fleet, lid, kill_t + DOWN_S), 60)
    assert fleet.status(1) is None and not _merges(fleet, 1, kill_t), "shard 1 back or merging while killed"

    # started again on its volume: the committed versions come back, and merges go on past them
    fleet.sdk("synchronizer-1").start()
    restart_t = time.time()
    restored = wait_for("the restarted shard 1 answering", lambda: _versions(fleet, 1), 120)
    assert set(restored) == OWNED[1] and all(restored[p] >= before_1[p] for p in OWNED[1]), (before_1, restored)
    wait_for("shard 1 merging each of its fragments with both learners again",
             lambda: _merged_everything(fleet, 1, restart_t), 180)
    after_1 = _logged_versions(fleet, 1)
    assert all(after_1[p] > before_1[p] for p in OWNED[1]), (before_1, after_1)

    # scale to zero: SIGTERM drains both learners within their grace period
    for lid in LEARNERS:
        c = fleet.sdk(lid)
        c.stop(timeout=60)
        c.reload()
        assert c.attrs["State"]["ExitCode"] == 0, fleet.logs(lid)
    for s in range(SHARDS):
        fleet.sdk(fleet.synchronizer_name(s)).stop(timeout=30)

    for s in range(SHARDS):  # over the whole run, each shard merged only its own fragments
        assert {int(m["fragment"]) for m in _merges(fleet, s)} == OWNED[s]
    result = fleet.check(kill_t)
    assert result["versions_monotonic"], result["version_problems"]
    assert result["unaccounted_contributions"] == 0, result
