"""Every contribution's outcome reaches the learner process that sent it, and only that one.

Two claims, each checked on a real synchronizer over gRPC on 127.0.0.1 with scripted learners:

- A restarted learner (a new incarnation under the same id) numbers its contributions from 1
  again. An outcome of its previous process decided after the restart (the old contribution was
  waiting in an inbox, alone or summed into the new process's slot) must not reach the new process,
  which would read it as the outcome of its own contribution of that number. It is still counted
  and written to the event log with its incarnation.
- A round whose commit fails puts its contributions back; one whose learner sent a newer
  contribution while the commit was failing must still end merged or superseded, and be answered.
  The commit fails for real: the version's temp file is a FIFO, so the store's write blocks until
  the test opens its other end and then its ``fsync`` fails (EINVAL, a FIFO cannot be synced).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib

import pytest
import torch

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.synchronizer.server import SynchronizerServer
from tests.scripted import ScriptedLearner, eventually, running_server, seed_genesis, sync_config


def _delta(seed: int, learner: ScriptedLearner, fragment: int) -> torch.Tensor:
    return torch.randn(learner.layout[fragment].numel, generator=torch.Generator().manual_seed(seed)) * 0.01


async def _join(server: SynchronizerServer, learner_id: str) -> ScriptedLearner:
    """A learner connected to a ready synchronizer, pumping its stream and heartbeating."""
    learner = ScriptedLearner(server.port, learner_id)
    assert (await learner.connect()).state == "ready"
    learner.start_pump()
    await learner.heartbeat()
    return learner


def _events(path: pathlib.Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


@pytest.mark.parametrize("summed", [False, True], ids=["waiting-alone", "summed-into-the-new-process"])
async def test_an_outcome_of_a_replaced_learner_process_never_reaches_its_successor(tmp_path, summed):
    log = tmp_path / "events.jsonl"
    cfg = sync_config(tmp_path / "state", policy=QuorumPolicy(quorum=2, grace_gamma=0.0, max_grace_s=0.0),
                      event_log=str(log))
    async with running_server(cfg) as server:
        await seed_genesis(server)
        old, b = await _join(server, "a"), await _join(server, "b")
        rounds = server.engine.rounds
        s_old = await old.contribute(0, _delta(1, old, 0), base_version=0)  # waits: quorum 2
        await eventually(lambda: len(rounds[0].inbox) == 1, what="the old process's contribution held")
        new = await _join(server, "a")  # a restart: same id, a new incarnation, sequences from 1 again
        assert new.incarnation != old.incarnation
        await eventually(lambda: old.closed is not None, what="the old process's stream ended")
        s_own = await new.contribute(1, _delta(2, new, 1), base_version=0)
        assert s_own == s_old, "the new process numbers its contributions from the old one's start"
        mine = {s_own: 1}  # its contributions: sequence -> fragment
        if summed:
            s_more = await new.contribute(0, _delta(3, new, 0), base_version=0)
            mine[s_more] = 0
            await eventually(lambda: [p.sequence for e in rounds[0].inbox.entries for p in e.parts()] == [s_more, s_old],
                             what="the new process's contribution carrying the old one's")
        else:
            await eventually(lambda: len(rounds[1].inbox) == 1, what="the new process's contribution held")
        sb0 = await b.contribute(0, _delta(4, b, 0), base_version=0)  # fragment 0 merges, the old part in it
        assert (await b.wait_result(sb0)).version == 1
        sb1 = await b.contribute(1, _delta(5, b, 1), base_version=0)  # then fragment 1, the new one's
        assert (await b.wait_result(sb1)).version == 1
        # Results queue in order: the new process's result for fragment 1 follows anything the
        # merge of fragment 0 sent it.
        await eventually(lambda: any(r.fragment_id == 1 for r in new.results), what="the new process's result")
        got = sorted((r.sequence, r.fragment_id, r.outcome) for r in new.results)
        assert got == sorted((s, p, "merged") for s, p in mine.items()), got
        # the old process's outcome is not lost: merged, counted, and in the event log with its incarnation
        merge = next(e for e in _events(log, "merge") if e["fragment"] == 0)
        assert ["a", old.incarnation, s_old] in merge["contributions"]
        by_id = {ls.learner_id: ls for ls in server.engine.status().learners}
        assert by_id["a"].merged == len(mine) + 1
        for learner in (old, new, b):
            await learner.close()


@contextlib.contextmanager
def _failing_commit(path: pathlib.Path):  # type: ignore[no-untyped-def]
    """Make the store's next write of ``path`` (a version's temp file) block until ``release`` is
    called and then fail: the name is a FIFO, opening its read end lets the writer through, and the
    writer's fsync fails with EINVAL. Leaving the block removes the FIFO and unblocks any writer."""
    os.mkfifo(path)
    readers: list[int] = []

    def release() -> None:
        readers.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))

    try:
        yield release
    finally:
        if not readers and path.exists():
            release()
        path.unlink(missing_ok=True)
        for fd in readers:
            os.close(fd)


async def test_every_contribution_of_a_round_whose_commit_failed_is_answered(tmp_path):
    log = tmp_path / "events.jsonl"
    state = tmp_path / "state"
    cfg = sync_config(state, policy=QuorumPolicy(quorum=2, grace_gamma=0.0, max_grace_s=0.0), event_log=str(log))
    async with running_server(cfg) as server:
        await seed_genesis(server)
        a, b, c = await _join(server, "a"), await _join(server, "b"), await _join(server, "c")
        round0, frag0 = server.engine.rounds[0], server.engine.fragments[0]
        sa0, sb0 = await a.contribute(0, _delta(1, a, 0), base_version=0), await b.contribute(0, _delta(2, b, 0),
                                                                                             base_version=0)
        assert (await a.wait_result(sa0)).version == (await b.wait_result(sb0)).version == 1
        temp = state / "fragments" / "p0000" / f".v000000000002.frag.{os.getpid()}.tmp"
        with _failing_commit(temp) as fail:
            # b's one version stale (it merges with the round, not counting for its quorum), then
            # a's and c's on the current version: the three are merged together into version 2...
            sb1 = await b.contribute(0, _delta(3, b, 0), base_version=0)
            sa1 = await a.contribute(0, _delta(4, a, 0), base_version=1)
            await eventually(lambda: len(round0.inbox) == 2, what="b's and a's contributions held")
            sc1 = await c.contribute(0, _delta(5, c, 0), base_version=1)
            await eventually(lambda: round0.merging, what="the merge of version 2 under way")
            # ...while a and b send their next: a's on the same base (it holds sa1's progress),
            # b's on version 1 (it does not hold sb1's)
            sa2 = await a.contribute(0, _delta(6, a, 0), base_version=1)
            sb2 = await b.contribute(0, _delta(7, b, 0), base_version=1)
            await eventually(lambda: len(round0.inbox) == 2, what="the newer contributions held")
            fail()
            await eventually(lambda: not round0.merging, what="the failed commit")
            assert frag0.version == 1, "a failed commit makes no version"
        # the retry commits version 2 from what was put back and what arrived meanwhile
        ra1, ra2 = await a.wait_result(sa1, timeout_s=5), await a.wait_result(sa2, timeout_s=5)
        rb1, rb2 = await b.wait_result(sb1, timeout_s=5), await b.wait_result(sb2, timeout_s=5)
        rc1 = await c.wait_result(sc1, timeout_s=5)
        assert (ra1.outcome, ra1.detail) == ("superseded", f"replaced by contribution {sa2}")
        assert (ra2.outcome, ra2.version) == ("merged", 2)
        assert (rb1.outcome, rb1.version, rb1.staleness) == ("merged", 2, 1)
        assert (rb2.outcome, rb2.version, rb2.staleness) == ("merged", 2, 0)
        assert (rc1.outcome, rc1.version) == ("merged", 2)
        assert frag0.version == 2 and (state / "fragments" / "p0000" / "v000000000002.frag").is_file()
        merge = next(e for e in _events(log, "merge") if e["fragment"] == 0 and e["version"] == 2)
        assert sorted(merge["contributions"]) == sorted([["a", a.incarnation, sa2], ["b", b.incarnation, sb2],
                                                         ["b", b.incarnation, sb1], ["c", c.incarnation, sc1]])
        by_id = {ls.learner_id: ls for ls in server.engine.status().learners}
        assert (by_id["a"].merged, by_id["a"].superseded, by_id["b"].merged, by_id["c"].merged) == (2, 1, 3, 1)
        for learner in (a, b, c):
            await learner.close()
