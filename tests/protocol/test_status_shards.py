"""``ddiloco status`` of a sharded synchronizer: one fleet view of every shard.

Two real synchronizer shards (``shard_index`` 0 and 1 of ``shard_count`` 2) serve on loopback in
this process; ``main()`` runs on a thread (it runs an event loop of its own) with the shards' addresses
as a list or as a ``{shard}`` pattern. The rules of the merged view (sums, the live rule, the
consistency checks) are also tested on hand-made replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import socket
import time

import pytest

from ddiloco.fragments.payload import encode_fragment
from ddiloco.protocol import wire
from ddiloco.protocol.shards import owner
from ddiloco.protocol.status import (
    EXIT_INCONSISTENT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    ShardReply,
    fleet_problems,
    fleet_view,
    main,
)
from tests.scripted import ScriptedLearner, eventually, running_server, sync_config, toy_protocol

P = 4
PROTOCOL = toy_protocol(num_fragments=P)


def _shard_config(tmp_path, shard: int, shards: int = 2, **kw):
    return sync_config(tmp_path / f"shard-{shard}", protocol=PROTOCOL, shard_index=shard, shard_count=shards, **kw)


async def _genesis(server, learner: ScriptedLearner, shard: int, shards: int) -> None:
    """``learner`` uploads the fragments ``shard`` owns (what a learner sends each shard)."""
    assert (await learner.connect()).state == "genesis_requested"
    for frag in learner.layout:
        if owner(frag.index, shards) != shard:
            continue
        chunks = encode_fragment(learner.flat(frag.index), frag, codec=learner.codec, kind="genesis", version=0,
                                 transfer_id=next(learner.transfer_ids), layout_hash=learner.layout.fingerprint,
                                 sequence=next(learner.sequence), max_chunk_bytes=PROTOCOL.max_chunk_bytes)
        await learner.stream.send_transfer(chunks)
    await eventually(lambda: server.engine.ready, what=f"shard {shard}'s genesis")
    learner.start_pump()


def _run(*args: str) -> tuple[int, str, str]:
    """``ddiloco status ARGS``: exit status, stdout, stderr (the servers log through their own stream)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


async def _status(*args: str) -> tuple[int, str, str]:
    return await asyncio.to_thread(_run, "--timeout", "3", *args)


def _table(out: str, heading: str) -> list[list[str]]:
    """The rows (split on blanks) of the table of ``out`` whose heading line starts with ``heading``."""
    block = next(b for b in out.split("\n\n") if b.lstrip().startswith(heading))
    return [line.split() for line in block.splitlines()[1:] if not line.startswith("(")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_two_ready_shards_give_one_fleet_view(tmp_path):
    async with running_server(_shard_config(tmp_path, 0)) as s0, running_server(_shard_config(tmp_path, 1)) as s1:
        learners = {}
        for shard, server in enumerate((s0, s1)):
            a = ScriptedLearner(server.port, "a", protocol=PROTOCOL)
            await _genesis(server, a, shard, 2)
            b = ScriptedLearner(server.port, "b", protocol=PROTOCOL)
            assert (await b.connect()).state == "ready"
            b.start_pump()
            learners[shard] = (a, b)
        # a: one merge on each shard (fragments 0 and 1); b: one on shard 1 only (fragment 3)
        for a, b in learners.values():
            await a.heartbeat()
            await b.heartbeat()
        for shard, fragment in ((0, 0), (1, 1)):
            a = learners[shard][0]
            seq = await a.contribute(fragment, a.flat(fragment) * 0 + 0.01, base_version=0, tokens=500)
            assert (await a.wait_result(seq)).outcome == "merged"
        b = learners[1][1]
        seq = await b.contribute(3, b.flat(3) * 0 + 0.01, base_version=0, tokens=500)
        assert (await b.wait_result(seq)).outcome == "merged"
        await eventually(lambda: all(len(s.engine.membership.live(s.engine.clock())) == 2 for s in (s0, s1)),
                         what="both learners live on both shards")
        spec = f"127.0.0.1:{s0.port},127.0.0.1:{s1.port}"

        code, out, err = await _status("--synchronizer", spec, "--json")
        assert code == 0, err
        got = json.loads(out)
        assert [(s["shard"], s["address"], s["reachable"], s["owned"]) for s in got["shards"]] == [
            (0, f"127.0.0.1:{s0.port}", True, [0, 2]), (1, f"127.0.0.1:{s1.port}", True, [1, 3])]
        assert [s["status"]["synchronizer_id"] for s in got["shards"]] == [s0.engine.synchronizer_id,
                                                                           s1.engine.synchronizer_id]
        fleet = got["fleet"]
        assert got["problems"] == [] and fleet["state"] == "ready" and fleet["answering"] == 2
        assert fleet["merges_total"] == 3 == s0.engine.ledger.merges_total + s1.engine.ledger.merges_total
        assert [(f["fragment_id"], f["shard"], f["version"]) for f in fleet["fragments"]] == [
            (0, 0, 1), (1, 1, 1), (2, 0, 0), (3, 1, 1)]
        by_id = {ls["learner_id"]: ls for ls in fleet["learners"]}
        assert by_id["a"]["merged"] == 2 and by_id["a"]["tokens_merged"] == 1000
        assert by_id["b"]["merged"] == 1 and by_id["b"]["tokens_merged"] == 500
        assert by_id["a"]["live"] and by_id["a"]["live_shards"] == [0, 1] and by_id["a"]["connected_shards"] == [0, 1]
        assert fleet["protocol"]["num_fragments"] == P

        code, out, err = await _status("--synchronizer", spec)
        assert code == 0, err
        assert "2 shards, 2 answering" in out and "merges=3" in out
        shard_rows = _table(out, "shard")
        # shard, address, synchronizer, state, up, merges, fragments served/owned, step, learners
        assert [r[:4] for r in shard_rows] == [["0", f"127.0.0.1:{s0.port}", s0.engine.synchronizer_id, "ready"],
                                               ["1", f"127.0.0.1:{s1.port}", s1.engine.synchronizer_id, "ready"]]
        assert [(r[5], r[6], r[8]) for r in shard_rows] == [("1", "2/2", "2/2"), ("2", "2/2", "2/2")]
        assert [r[:3] for r in _table(out, "fragment")] == [["0", "0", "1"], ["1", "1", "1"], ["2", "0", "0"],
                                                            ["3", "1", "1"]]
        assert [(r[0], r[1], r[6]) for r in _table(out, "learner")] == [("a", "yes", "2"), ("b", "yes", "1")]

        # b leaves shard 0 only: live on one shard of two
        await learners[0][1].close(goodbye="test")

        def b_gone() -> bool:
            rec = s0.engine.membership.learners.get("b")
            return rec is None or not (rec.connected or s0.engine.membership.is_live(rec, s0.engine.clock()))

        await eventually(b_gone, what="b gone from shard 0")
        code, out, err = await _status("--synchronizer", spec)
        assert code == 0, err
        b_row = next(r for r in _table(out, "learner") if r[0] == "b")
        assert b_row[1:3] == ["1/2", "1/2"], b_row
        for lr in (learners[0][0], *learners[1]):
            await lr.close()


async def test_a_shard_pattern_expands_to_one_address_per_shard(tmp_path):
    # 127.0.0.0/8 is loopback: shard s listens on 127.0.0.1s, every shard on the same port
    port = _free_port()
    cfgs = [dataclasses.replace(_shard_config(tmp_path, s), listen=f"127.0.0.1{s}:{port}") for s in (0, 1)]
    async with running_server(cfgs[0]) as s0, running_server(cfgs[1]) as s1:
        assert s0.port == s1.port == port
        code, out, err = await _status("--synchronizer", f"127.0.0.1{{shard}}:{port}", "--shards", "2",
                                       "--json")
        assert code == 0, err
        got = json.loads(out)
        assert [(s["address"], s["status"]["synchronizer_id"]) for s in got["shards"]] == [
            (f"127.0.0.10:{port}", s0.engine.synchronizer_id), (f"127.0.0.11:{port}", s1.engine.synchronizer_id)]
        assert got["fleet"]["state"] == "genesis_pending" and got["problems"] == []
        # the pattern needs the number of shards; a list must match it
        code, _, err = await _status("--synchronizer", f"127.0.0.10:{port}", "--shards", "2")
        assert code == EXIT_USAGE and "1 synchronizer address(es) given for 2 shards" in err


async def test_a_shard_that_does_not_answer_is_a_row_and_a_non_zero_exit(tmp_path):
    down = _free_port()
    async with running_server(_shard_config(tmp_path, 0)) as s0:
        spec = f"127.0.0.1:{s0.port},127.0.0.1:{down}"
        code, out, err = await _status("--synchronizer", spec)
        assert code == EXIT_UNREACHABLE
        rows = _table(out, "shard")
        assert rows[0][:4] == ["0", f"127.0.0.1:{s0.port}", s0.engine.synchronizer_id, "genesis_pending"]
        assert rows[1][:4] == ["1", f"127.0.0.1:{down}", "unreachable:", "UNAVAILABLE:"]
        assert s0.engine.synchronizer_id in out and "2 shards, 1 answering" in out and "state=partial" in out
        assert f"cannot reach shard 1 (127.0.0.1:{down})" in err
        code, out, _ = await _status("--synchronizer", spec, "--json")
        assert code == EXIT_UNREACHABLE
        shards = json.loads(out)["shards"]
        assert shards[0]["reachable"] and not shards[1]["reachable"] and "UNAVAILABLE" in shards[1]["error"]


async def test_the_shards_are_asked_at_once_each_within_the_timeout():
    # two listeners that never answer: a deadline each, waited out side by side
    holes = [socket.socket() for _ in range(2)]
    try:
        for hole in holes:
            hole.bind(("127.0.0.1", 0))
            hole.listen()
        spec = ",".join(f"127.0.0.1:{h.getsockname()[1]}" for h in holes)
        t0 = time.monotonic()
        code, out, err = await asyncio.to_thread(_run, "--timeout", "1.5", "--synchronizer", spec)
        elapsed = time.monotonic() - t0
    finally:
        for hole in holes:
            hole.close()
    assert code == EXIT_UNREACHABLE and out.count("unreachable: DEADLINE_EXCEEDED") == 2, out + err
    assert elapsed < 2.9, f"{elapsed:.1f}s: the shards were asked one after the other"


async def test_one_synchronizer_at_two_addresses_is_refused_or_reported(tmp_path):
    async with running_server(_shard_config(tmp_path, 0)) as s0:
        code, _, err = await _status("--synchronizer", f"127.0.0.1:{s0.port},127.0.0.1:{s0.port}")
        assert code == EXIT_USAGE and "given for two shards" in err
        # two names for one shard: only its answer tells
        code, out, err = await _status("--synchronizer", f"127.0.0.1:{s0.port},localhost:{s0.port}")
        assert code == EXIT_INCONSISTENT, out + err
        assert "two addresses for the same shard" in out and "inconsistent shards" in err
        assert out.startswith("!! INCONSISTENT SHARDS")


async def test_one_address_prints_the_unsharded_view(tmp_path):
    async with running_server(sync_config(tmp_path)) as server:
        code, out, err = await _status("--synchronizer", f"127.0.0.1:{server.port}", "--json")
        assert code == 0, err
        got = json.loads(out)
        assert "shards" not in got and got["synchronizer_id"] == server.engine.synchronizer_id
        assert set(got) == {f for f in wire.StatusReply.__dataclass_fields__}
        code, out, err = await _status("--synchronizer", f"127.0.0.1:{server.port}")
        assert code == 0 and out.startswith(f"synchronizer {server.engine.synchronizer_id}  mode=")


# -- the rules, on hand-made replies ------------------------------------------------------------


def _reply(shard: int, fragments: list[int], *, sid: str | None = None, p: int = P, h: int = 4, state="ready",
           goodput: float = 1.0, merges: int = 0, learners=()) -> ShardReply:
    protocol = wire.ProtocolParams(num_fragments=p, sync_every=h, overlap=1, max_chunk_bytes=4096,
                                   mode="decoupled")
    status = wire.StatusReply(synchronizer_id=sid or f"sync-{shard}", mode="decoupled", uptime_s=1.0, state=state,
                              protocol=protocol, fragments=tuple(wire.FragmentStatus(fragment_id=f, version=1)
                                                                 for f in fragments),
                              token_goodput=goodput, merges_total=merges, learners=tuple(learners))
    return ShardReply(shard, f"host-{shard}:7000", status)


def test_consistent_shards_have_no_problem():
    assert fleet_problems([_reply(0, [0, 2]), _reply(1, [1, 3])]) == []
    # before genesis a shard serves nothing yet: not a problem
    assert fleet_problems([_reply(0, [], state="genesis_pending"), _reply(1, [1, 3])]) == []
    # a shard that did not answer is not checked
    assert fleet_problems([_reply(0, [0, 2]), ShardReply(1, "host-1:7000", error="UNAVAILABLE: x")]) == []


def test_unsharded_synchronizers_in_a_list_serve_fragments_twice():
    problems = fleet_problems([_reply(0, [0, 1, 2, 3]), _reply(1, [0, 1, 2, 3])])
    text = "\n".join(problems)
    assert "shard 0 (host-0:7000) serves fragment(s) 1, 3, which are not its own" in text
    assert "shard 1 (host-1:7000) serves fragment(s) 0, 2" in text
    assert "fragment 0 is served by shards 0 and 1" in text and "fragment 3 is served by shards 0 and 1" in text


def test_shards_in_the_wrong_order_missing_fragments_and_protocol_disagreement():
    swapped = "\n".join(fleet_problems([_reply(0, [1, 3]), _reply(1, [0, 2])]))
    assert "is the address list in shard order?" in swapped
    assert "shard 0 (host-0:7000) is ready but does not serve its fragment(s) 0, 2" in swapped
    protocol = fleet_problems([_reply(0, [0, 2]), _reply(1, [1, 3], h=8)])
    assert len(protocol) == 1 and "disagree on the protocol" in protocol[0] and "H=8" in protocol[0]
    same = fleet_problems([_reply(0, [], sid="sync-x", state="genesis_pending"),
                           _reply(1, [], sid="sync-x", state="genesis_pending")])
    assert same == ["one synchronizer (sync-x) answers for shards 0 and 1 at host-0:7000 and host-1:7000: "
                    "two addresses for the same shard"]


def test_the_merged_view_sums_merges_takes_the_highest_step_and_weights_goodput_by_fragments():
    def ls(lid: str, *, live: bool, merged: int) -> wire.LearnerStatus:
        return wire.LearnerStatus(learner_id=lid, connected=True, live=live, last_seen_s=0.5 if live else 9.0,
                                  step=10 if live else 7, tokens_per_s=100.0, merged=merged, tokens_merged=merged * 10)

    # P = 5 over 2 shards: shard 0 owns 3 fragments (0, 2, 4), shard 1 owns 2
    replies = [_reply(0, [0, 2, 4], p=5, goodput=1.0, merges=4, learners=[ls("a", live=True, merged=3)]),
               _reply(1, [1, 3], p=5, goodput=0.5, merges=2,
                      learners=[ls("a", live=False, merged=1), ls("b", live=True, merged=2)])]
    view = fleet_view(replies)
    assert view["merges_total"] == 6
    assert view["token_goodput"] == pytest.approx((3 * 1.0 + 2 * 0.5) / 5)
    a, b = view["learners"]
    assert (a["learner_id"], a["live"], a["live_shards"], a["merged"], a["tokens_merged"]) == ("a", False, [0], 4, 40)
    assert a["last_seen_s"] == 9.0 and a["step"] == 10 and a["tokens_per_s"] == 100.0
    # b is known to shard 1 only: not live on every shard that answered
    assert (b["live"], b["known_shards"]) == (False, [1])
    assert view["state"] == "ready"
