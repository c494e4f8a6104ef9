"""The synchronizer over real gRPC on 127.0.0.1:0, driven by scripted learners.

Covers genesis and FetchState, quorum K of M, merging as soon as every live learner contributed,
the grace window admitting a late learner and excluding a later one, re-anchoring of a stale
contribution (checked against hand-computed Nesterov/RDA numbers), and supersession.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import pytest
import torch

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.protocol.client import StreamClosed
from tests.scripted import ScriptedLearner, eventually, running_server, sync_config, toy_protocol


async def _ready(server, *learner_ids, step_time_s=0.1, protocol=None):
    """Connect learners; the first uploads genesis; all pump messages and heartbeat once."""
    learners = []
    for i, lid in enumerate(learner_ids):
        learner = ScriptedLearner(server.port, lid, protocol=protocol)
        welcome = await learner.connect()
        if i == 0:
            assert welcome.state == "genesis_requested"
            await learner.upload_genesis()
            await eventually(lambda: server.engine.ready, what="genesis commit")
        else:
            assert welcome.state == "ready"
        learner.start_pump()
        await learner.heartbeat(step_time_s=step_time_s)
        learners.append(learner)
    await eventually(lambda: len(server.engine.membership.live(server.engine.clock())) == len(learner_ids),
                     what="all learners live")
    return learners


def _delta(seed: int, learner: ScriptedLearner, fragment: int, scale: float = 0.01) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(learner.layout[fragment].numel, generator=g) * scale


async def test_genesis_then_fetch_state_returns_the_uploaded_parameters(tmp_path):
    async with running_server(sync_config(tmp_path)) as server:
        first = ScriptedLearner(server.port, "a")
        assert (await first.connect()).state == "genesis_requested"
        second = ScriptedLearner(server.port, "b")
        assert (await second.connect()).state == "genesis_pending"
        await first.upload_genesis()
        await eventually(lambda: server.engine.ready, what="genesis commit")
        fetched = await second.stream.fetch_state("b")
        assert sorted(t.header.fragment_id for t in fetched) == [0, 1]
        for t in fetched:
            assert t.header.version == 0
            torch.testing.assert_close(second.decode(t), first.flat(t.header.fragment_id), rtol=0, atol=0)
        assert (tmp_path / "meta.json").exists()
        for lr in (first, second):
            await lr.close()


async def test_fetch_state_before_genesis_is_failed_precondition(tmp_path):
    import grpc

    from ddiloco.protocol.client import StreamClosed

    async with running_server(sync_config(tmp_path)) as server:
        learner = ScriptedLearner(server.port, "a")
        with pytest.raises(StreamClosed) as info:
            await learner.stream.fetch_state("a")
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        await learner.close()


async def test_merges_at_once_when_every_live_learner_contributed(tmp_path):
    # Huge grace (step time 10 s) so only the "all contributed" rule can explain a fast merge.
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=1, grace_gamma=0.9, max_grace_s=30.0))
    async with running_server(cfg) as server:
        a, b = await _ready(server, "a", "b", step_time_s=10.0)
        t0 = asyncio.get_running_loop().time()
        round_no = _request(server)
        assert (await a.wait_request(0)).round == (await b.wait_request(0)).round == round_no
        sa = await a.contribute(0, _delta(1, a, 0), base_version=0, tokens=1000, steps=4)
        sb = await b.contribute(0, _delta(2, b, 0), base_version=0, tokens=3000, steps=4)
        ra, rb = await a.wait_result(sa), await b.wait_result(sb)
        assert asyncio.get_running_loop().time() - t0 < 5.0
        assert ra.outcome == rb.outcome == "merged" and ra.version == rb.version == 1
        # w = tok * tok/steps: 1000^2/4 : 3000^2/4 = 1 : 9
        assert math.isclose(ra.weight, 0.1, rel_tol=1e-9) and math.isclose(rb.weight, 0.9, rel_tol=1e-9)
        await eventually(lambda: a.latest_global(0) is not None and b.latest_global(0) is not None,
                         what="broadcast of version 1")
        assert a.latest_global(0).header.version == 1
        assert server.engine.fragments[0].version == 1 and server.engine.fragments[1].version == 0
        for lr in (a, b):
            await lr.close()


def _request(server, fragment: int = 0) -> int:
    """Fragment ``fragment`` falls due now (what the fleet's clock does at its due step): its
    round opens and every live learner is asked for it. Returns the round number."""
    r = server.engine.rounds[fragment]
    round_no = r.state.round + 1
    r.request(server.engine.clock(), round_no)
    return round_no


async def _decided(server, reason: str, fragment: int = 0) -> None:
    """Wait until the fragment's round has decided, with this reason, not to merge (yet)."""
    r = server.engine.rounds[fragment]
    await eventually(lambda: r.last_decision is not None and not r.last_decision.merge
                     and r.last_decision.reason.startswith(reason), what=f"round decision {reason!r}")


async def test_quorum_k_of_m_waits_for_k_then_grace(tmp_path):
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=2, grace_gamma=0.5, max_grace_s=0.3))
    async with running_server(cfg) as server:
        a, b, c = await _ready(server, "a", "b", "c", step_time_s=1.0)
        sa = await a.contribute(0, _delta(1, a, 0), base_version=0)
        await _decided(server, "waiting for quorum: 1/2")  # the round saw it and holds for the quorum
        assert server.engine.fragments[0].version == 0 and a.result_for(sa) is None
        sb = await b.contribute(0, _delta(2, b, 0), base_version=0)
        ra, rb = await a.wait_result(sa), await b.wait_result(sb)
        assert ra.outcome == rb.outcome == "merged" and ra.version == 1
        assert server.engine.fragments[0].last_quorum_size == 2
        for lr in (a, b, c):
            await lr.close()


@pytest.mark.parametrize("anchor,scaled", [("point", False), ("delta", True)])
async def test_grace_admits_a_late_learner_and_excludes_a_later_one_which_is_anchored(tmp_path, anchor, scaled):
    # grace = clamp(0.9 * (tau=1 * step 1.5 s - quorum time ~0 - sync), 0, 5) ~ 1.35 s
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=1, grace_gamma=0.9, max_grace_s=5.0),
                      outer_lr=0.7, outer_momentum=0.9, outer_momentum_warmup=0, stale_anchor=anchor,
                      scale_by_participation=scaled, event_log=str(tmp_path / "synchronizer.jsonl"))
    async with running_server(cfg) as server:
        a, b, c = await _ready(server, "a", "b", "c", step_time_s=1.5)
        theta0 = server.engine.fragments[0].params.clone()
        da, db, dc = _delta(1, a, 0), _delta(2, b, 0), _delta(3, c, 0)
        _request(server)
        sa = await a.contribute(0, da, base_version=0)
        await _decided(server, "quorum 1/1; in grace")  # b arrives inside the grace window
        sb = await b.contribute(0, db, base_version=0)
        ra = await a.wait_result(sa, timeout_s=10)
        rb = await b.wait_result(sb)
        assert ra.version == rb.version == 1 and server.engine.fragments[0].last_quorum_size == 2
        theta1 = server.engine.fragments[0].params.clone()
        # c was computed against version 0 and answers round 1 after it merged: staleness 1. It
        # waits for the next round, where it is a leftover: it does not make that round's quorum
        # (all three are live, so c's merge is 1 of 3 learners) ...
        sc = await c.contribute(0, dc, base_version=0, round=1)
        await _decided(server, "1 stale contributions; round not open yet")
        round_2 = _request(server)
        await _decided(server, "waiting for quorum: 0/1 answers (1 leftover)")
        # ... until c answers round 2, still from version 0 (it has not applied version 1): the
        # answer holds the leftover's progress and replaces it
        sc2 = await c.contribute(0, dc, base_version=0, round=round_2)
        rc = await c.wait_result(sc2)
        assert rc.outcome == "merged" and rc.version == 2 and rc.staleness == 1
        assert (await c.wait_result(sc)).outcome == "superseded"
        # Hand-computed: merge of A,B (RDA per tensor, equal weights; 2 of 3 live learners, so a
        # 2/3 step when scaled by participation), Nesterov, then C alone (1/3): re-anchored to its
        # model ("point") or its Delta as is ("delta").
        from ddiloco.algorithm.merge import embedding_mask, merge_deltas

        spec = server.engine.fragments[0].spec
        segs = [(s, e) for _, s, e in spec.segments()]
        emb = embedding_mask(spec, cfg.embedding_patterns)
        d1 = merge_deltas(torch.stack([da, db]), [0.5, 0.5], segs, emb, "rda") * (2 / 3 if scaled else 1.0)
        buf = d1.clone()
        expect1 = theta0 - 0.7 * (d1 + 0.9 * buf)
        torch.testing.assert_close(theta1, expect1, rtol=1e-5, atol=1e-7)
        anchored = dc + (theta1 - theta0) if anchor == "point" else dc
        d2 = merge_deltas(anchored[None], [1.0], segs, emb, "rda") * (1 / 3 if scaled else 1.0)
        buf = 0.9 * buf + d2
        expect2 = theta1 - 0.7 * (d2 + 0.9 * buf)
        torch.testing.assert_close(server.engine.fragments[0].params, expect2, rtol=1e-5, atol=1e-7)
        merges = [json.loads(line) for line in (tmp_path / "synchronizer.jsonl").read_text().splitlines()]
        assert [m["scale"] for m in merges if m["event"] == "merge"] == (
            [pytest.approx(2 / 3), pytest.approx(1 / 3)] if scaled else [1.0, 1.0])
        for lr in (a, b, c):
            await lr.close()


async def test_newer_contribution_supersedes_the_older_one(tmp_path):
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=2, grace_gamma=0.0, max_grace_s=0.0))
    async with running_server(cfg) as server:
        a, b, _c = await _ready(server, "a", "b", "c")
        s1 = await a.contribute(0, _delta(1, a, 0), base_version=0, tokens=100)
        s2 = await a.contribute(0, _delta(2, a, 0), base_version=0, tokens=200)
        r1 = await a.wait_result(s1)
        assert r1.outcome == "superseded"
        sb = await b.contribute(0, _delta(3, b, 0), base_version=0)
        r2, rb = await a.wait_result(s2), await b.wait_result(sb)
        assert r2.outcome == rb.outcome == "merged"
        status = server.engine.status()
        by_id = {ls.learner_id: ls for ls in status.learners}
        assert by_id["a"].superseded == 1 and by_id["a"].merged == 1
        for lr in (a, b, _c):
            await lr.close()


async def test_contribution_on_a_newer_base_is_summed_with_the_missed_one_and_both_merge(tmp_path):
    # a's first contribution misses merge 1 (b and c made it); a then applies version 1 and sends
    # its next progress against it. That one does not contain the first, so the two are summed.
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=2, grace_gamma=0.0, max_grace_s=0.0),
                      outer_lr=0.7, outer_momentum=0.0)
    async with running_server(cfg) as server:
        a, b, c = await _ready(server, "a", "b", "c", step_time_s=10.0)  # the clock's own rounds: 40 s away
        _request(server)
        theta0 = server.engine.fragments[0].params.clone()
        db, dc = _delta(2, b, 0), _delta(3, c, 0)
        sb, sc = await b.contribute(0, db, base_version=0), await c.contribute(0, dc, base_version=0)
        assert (await b.wait_result(sb)).version == (await c.wait_result(sc)).version == 1
        theta1 = server.engine.fragments[0].params.clone()
        da0, da1 = _delta(4, a, 0), _delta(5, a, 0)
        s0 = await a.contribute(0, da0, base_version=0, tokens=100, steps=4)  # stale: waits for a round
        await eventually(lambda: len(server.engine.rounds[0].inbox) == 1, what="stale contribution held")
        s1 = await a.contribute(0, da1, base_version=1, tokens=100, steps=4)
        inbox = server.engine.rounds[0].inbox
        await eventually(lambda: [p.sequence for e in inbox.entries for p in e.parts()] == [s1, s0],
                         what="the newer contribution carrying the missed one")
        assert a.result_for(s0) is None, "the older contribution must not be superseded"
        _request(server)
        sb2 = await b.contribute(0, db, base_version=1, tokens=100, steps=4)
        r0, r1, rb = await a.wait_result(s0), await a.wait_result(s1), await b.wait_result(sb2)
        assert r0.outcome == r1.outcome == rb.outcome == "merged" and r0.version == r1.version == 2
        assert (r0.staleness, r1.staleness) == (1, 0)  # each part against its own base
        status = {ls.learner_id: ls for ls in server.engine.status().learners}
        assert (status["a"].merged, status["a"].superseded) == (2, 0)
        # Hand-computed: row a = da0 re-anchored to version 1 (da0 + theta1 - theta0) + da1 (200
        # tokens / 8 steps: weight 200*25 against b's 100*25).
        from ddiloco.algorithm.merge import embedding_mask, merge_deltas

        spec = server.engine.fragments[0].spec
        segs = [(s, e) for _, s, e in spec.segments()]
        emb = embedding_mask(spec, cfg.embedding_patterns)
        d2 = merge_deltas(torch.stack([da0 + (theta1 - theta0) + da1, db]), [2 / 3, 1 / 3], segs, emb, "rda")
        torch.testing.assert_close(server.engine.fragments[0].params, theta1 - 0.7 * d2, rtol=1e-5, atol=1e-7)
        assert not torch.equal(theta0, theta1)
        for lr in (a, b, c):
            await lr.close()


async def test_a_summed_part_whose_predecessor_was_merged_is_not_counted_twice(tmp_path):
    # One learner at points x1, x2, x3 of its own training. It sends A = theta0 - x1 (merged
    # alone: theta1 = x1), then A2 = theta0 - x2 on the same base before it hears of that merge
    # (A2 holds A's progress), then applies theta1 (replay: it stays at x3 + (x2 - x1)... as far as
    # the synchronizer knows, x3 relative to what it handed over) and sends C = x2 - x3 on base 1.
    # A2 and C are summed in its slot. With outer SGD lr 1 and a lone learner the global must land
    # on the learner's point x3; adding A2 as is (not re-anchored) would count A's progress twice
    # and land at x3 - A.
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0),
                      outer_lr=1.0, outer_momentum=0.0, merge_method="mean")
    async with running_server(cfg) as server:
        (a,) = await _ready(server, "a", step_time_s=10.0)
        theta0 = server.engine.fragments[0].params.clone()
        x1 = theta0 - _delta(1, a, 0)
        x2 = x1 - _delta(2, a, 0)
        x3 = x2 - _delta(3, a, 0)
        _request(server)
        s1 = await a.contribute(0, theta0 - x1, base_version=0, tokens=100, steps=4)
        assert (await a.wait_result(s1)).version == 1
        torch.testing.assert_close(server.engine.fragments[0].params, x1)
        s2 = await a.contribute(0, theta0 - x2, base_version=0, tokens=200, steps=8)
        await eventually(lambda: len(server.engine.rounds[0].inbox) == 1, what="stale contribution held")
        s3 = await a.contribute(0, x2 - x3, base_version=1, tokens=100, steps=4)
        inbox = server.engine.rounds[0].inbox
        await eventually(lambda: [p.sequence for e in inbox.entries for p in e.parts()] == [s3, s2],
                         what="the newer contribution carrying the older one")
        _request(server)
        r2, r3 = await a.wait_result(s2), await a.wait_result(s3)
        assert (r2.outcome, r2.version, r2.staleness) == ("merged", 2, 1)
        assert (r3.outcome, r3.version, r3.staleness) == ("merged", 2, 0)
        torch.testing.assert_close(server.engine.fragments[0].params, x3, rtol=1e-5, atol=1e-6)
        await a.close()


async def test_retained_versions_are_read_back_from_their_files_and_a_bad_one_rejects_what_needs_it(tmp_path):
    # The synchronizer holds only the current parameters (and momentum): older versions for
    # re-anchoring are read back from the committed files. A file that no longer verifies is
    # forgotten, and a contribution on that base is rejected as stale (with a resync), once.
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0),
                      outer_lr=1.0, outer_momentum=0.0, merge_method="mean")
    async with running_server(cfg) as server:
        a, b = await _ready(server, "a", "b", step_time_s=10.0)
        frag = server.engine.fragments[0]
        theta0 = frag.params.clone()
        _request(server)
        s1 = await a.contribute(0, _delta(1, a, 0), base_version=0)
        assert (await a.wait_result(s1)).version == 1
        assert list(frag.history) == [0, 1] and all(v is None for v in frag.history.values())
        torch.testing.assert_close(frag.params_at(0), theta0)
        assert frag.params_at(1) is frag.params
        # a stale contribution re-anchored against version 0 read back from its file
        theta1 = frag.params.clone()
        d3 = _delta(3, b, 0)
        round_no = _request(server)
        s3 = await b.contribute(0, d3, base_version=0, round=round_no)  # b's answer, from version 0
        r3 = await b.wait_result(s3)
        assert (r3.outcome, r3.version, r3.staleness) == ("merged", 2, 1)
        torch.testing.assert_close(frag.params, theta1 - (d3 + theta1 - theta0), rtol=1e-5, atol=1e-6)
        # version 1's file goes bad on disk: a contribution on base 1 is rejected, not retried forever
        path = tmp_path / "fragments" / "p0000" / "v000000000001.frag"
        blob = bytearray(path.read_bytes())
        blob[200] ^= 0xFF
        path.write_bytes(bytes(blob))
        round_no = _request(server)
        s4 = await a.contribute(0, _delta(4, a, 0), base_version=1, round=round_no)
        await eventually(lambda: 1 not in frag.history, what="the bad version forgotten")
        # the contribution kept by the failed merge waits; a answers the next round from the same base
        round_no = _request(server)
        s5 = await a.contribute(0, _delta(4, a, 0), base_version=1, round=round_no)
        r5 = await a.wait_result(s5)
        assert (r5.outcome, r5.reason) == ("rejected", "stale") and 1 not in frag.history
        assert (await a.wait_result(s4)).outcome == "superseded"
        assert frag.version == 2
        for lr in (a, b):
            await lr.close()


async def test_dropped_stream_leaves_the_quorum_at_once(tmp_path):
    # K=0 (all live): with b gone, a alone is "all live" and merges immediately.
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=0, grace_gamma=0.0, max_grace_s=0.0, timeout_s=60))
    async with running_server(cfg) as server:
        a, b = await _ready(server, "a", "b")
        sa = await a.contribute(0, _delta(1, a, 0), base_version=0)
        await _decided(server, "waiting for quorum: 1/2")
        assert a.result_for(sa) is None
        await b.close()
        ra = await a.wait_result(sa, timeout_s=5)
        assert ra.outcome == "merged"
        await a.close()


async def test_reconnect_with_same_id_replaces_old_stream_and_gets_results(tmp_path):
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=2, grace_gamma=0.0, max_grace_s=0.0))
    async with running_server(cfg) as server:
        a, b = await _ready(server, "a", "b")
        sa = await a.contribute(0, _delta(1, a, 0), base_version=0)
        # (bytes still unread on a replaced stream are dropped with it; the learner re-sends them)
        await eventually(lambda: len(server.engine.rounds[0].inbox) == 1, what="a's contribution received")
        # a's process reconnects (same incarnation) on a new stream; the old one is ended.
        a2 = ScriptedLearner(server.port, "a")
        a2.incarnation = a.incarnation
        await a2.connect()
        a2.start_pump()
        await a2.heartbeat()
        await eventually(lambda: a.closed is not None, what="old stream ended")
        sb = await b.contribute(0, _delta(2, b, 0), base_version=0)
        assert (await b.wait_result(sb)).outcome == "merged"
        r = await a2.wait_result(sa)
        assert r.outcome == "merged"
        for lr in (a, a2, b):
            await lr.close()


async def test_slow_receiver_only_gets_newest_version_and_does_not_slow_others(tmp_path):
    from ddiloco.synchronizer.broadcast import GlobalTransfer, Outbox

    box = Outbox(max_control=16)
    for v in range(1, 6):
        box.put_global(GlobalTransfer(0, v, ()))
    box.put_global(GlobalTransfer(1, 1, ()))
    assert box.pending() == 2 and box.replaced == 4
    first = box.pop_nowait()
    assert isinstance(first, GlobalTransfer) and (first.fragment, first.version) == (0, 5)
    # control queue is bounded: oldest results dropped beyond the bound
    from ddiloco.protocol.wire import ContributionResult, Resync

    box.put_control(Resync(fragment_ids=(0,)))
    for i in range(40):
        box.put_control(ContributionResult(sequence=i, fragment_id=0, outcome="merged"))
    assert box.dropped == 40 + 1 - 16
    assert isinstance(box.pop_nowait(), Resync)  # resync is never dropped


async def test_status_reports_learners_fragments_and_rejections(tmp_path):
    from ddiloco.protocol.status import render

    cfg = sync_config(tmp_path)
    async with running_server(cfg) as server:
        a, = await _ready(server, "a")
        bad = torch.full((a.layout[1].numel,), float("nan"))
        s = await a.contribute(1, bad, base_version=0)
        assert (await a.wait_result(s)).reason == "non_finite"
        status = await a.stream.status()
        assert status.state == "ready" and status.learners[0].learner_id == "a"
        assert status.rejected_by_reason == {"non_finite": 1}
        assert [f.version for f in status.fragments] == [0, 0]
        text = render(status)
        assert "non_finite=1" in text and "a" in text
        await a.close()


async def test_contribution_sent_again_is_answered_but_never_merged_twice(tmp_path):
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0))
    async with running_server(cfg) as server:
        a, = await _ready(server, "a")
        delta = _delta(1, a, 0)
        s = await a.contribute(0, delta, base_version=0)
        assert (await a.wait_result(s)).version == 1
        params = server.engine.fragments[0].params.clone()
        # the same process re-sends it under the same sequence (its stream broke before the result came)
        a2 = ScriptedLearner(server.port, "a")
        a2.incarnation = a.incarnation
        a2.sequence = iter([s])
        await a2.connect()
        a2.start_pump()
        await a2.contribute(0, delta, base_version=0)
        r = await a2.wait_result(s)
        assert (r.outcome, r.version) == ("merged", 1) and "duplicate" in r.detail
        assert len(server.engine.rounds[0].inbox) == 0, "answered at admission, never queued for a merge"
        assert server.engine.fragments[0].version == 1 and torch.equal(server.engine.fragments[0].params, params)
        for lr in (a, a2):
            await lr.close()


async def test_prometheus_metrics_and_health_are_served(tmp_path):
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cfg = sync_config(tmp_path, metrics_port=0, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0))
    async with running_server(cfg) as server:
        a, = await _ready(server, "a")
        s = await a.contribute(0, _delta(1, a, 0), base_version=0)
        await a.wait_result(s)
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode())
        assert 'ddiloco_sync_merges_total{fragment="0"} 1.0' in body
        assert 'ddiloco_sync_fragment_version{fragment="0"} 1.0' in body
        assert 'ddiloco_sync_contributions_total{outcome="merged",reason=""} 1.0' in body
        # Prometheus naming: counters end in _total, the unit before it
        received = next(line for line in body.splitlines() if line.startswith("ddiloco_sync_received_bytes_total "))
        assert float(received.split()[1]) > 0
        assert "# TYPE ddiloco_sync_sent_bytes_total counter" in body and "\nddiloco_sync_sent_bytes_total " in body
        assert 'ddiloco_sync_learner_up{learner="a"} 1.0' in body
        assert 'ddiloco_build_info{python="' in body and 'service="synchronizer"' in body and 'version="0.1.0"' in body
        await a.close()
        await eventually(lambda: not server.engine.membership.connected(), what="the stream's end reached it")
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode())
        assert 'ddiloco_sync_learner_up{learner="a"} 0.0' in body
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="ddiloco.v1.Synchronizer"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_after_a_restart_merges_wait_for_the_last_merges_learners_to_rejoin(tmp_path):
    first = sync_config(tmp_path, policy=QuorumPolicy(quorum=2, grace_gamma=0.0, max_grace_s=0.0))
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0),
                      rejoin_window_s=2.5)
    async with running_server(first) as server:
        a, b = await _ready(server, "a", "b")
        sa, sb = await a.contribute(0, _delta(1, a, 0), base_version=0), await b.contribute(0, _delta(2, b, 0),
                                                                                           base_version=0)
        assert (await a.wait_result(sa)).version == (await b.wait_result(sb)).version == 1
        for lr in (a, b):
            await lr.close()
    version = None
    # Restarted on the same state: a comes back first. Its contribution waits for b (in the last
    # merge) instead of being merged alone; when b's arrives, both merge at once.
    async with running_server(cfg) as server:
        assert server.engine.rejoin.expected == {"a", "b"}
        version = server.engine.fragments[0].version
        a = ScriptedLearner(server.port, "a")
        await a.connect()
        a.start_pump()
        await a.heartbeat()
        sa = await a.contribute(0, _delta(3, a, 0), base_version=version)
        await _decided(server, "rejoin hold: waiting for ['a', 'b']")
        assert a.result_for(sa) is None and server.engine.fragments[0].version == version
        b = ScriptedLearner(server.port, "b")
        await b.connect()
        b.start_pump()
        await b.heartbeat()
        sb = await b.contribute(0, _delta(4, b, 0), base_version=version)
        ra, rb = await a.wait_result(sa, timeout_s=5), await b.wait_result(sb, timeout_s=5)
        assert ra.version == rb.version == version + 1 and server.engine.fragments[0].last_quorum_size == 2
        for lr in (a, b):
            await lr.close()
    # Restarted again, and b never comes back: a is merged alone once the window has passed.
    async with running_server(cfg) as server:
        version = server.engine.fragments[0].version
        a = ScriptedLearner(server.port, "a")
        await a.connect()
        a.start_pump()
        await a.heartbeat()
        until = server.engine.rejoin.until
        sa = await a.contribute(0, _delta(5, a, 0), base_version=version)
        ra = await a.wait_result(sa, timeout_s=30)
        merged_at = server.engine.clock()
        assert ra.outcome == "merged" and ra.version == version + 1
        # not before the window ends (it is measured on the synchronizer's own clock from the load)
        assert until is not None and merged_at >= until, (merged_at, until)
        await a.close()


def test_rejoin_window_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="rejoin_window_s"):
        sync_config(tmp_path, rejoin_window_s=-1)
    with pytest.raises(ValueError, match="start_learners"):
        sync_config(tmp_path, start_learners=-1)
    with pytest.raises(ValueError, match="start_window_s"):
        sync_config(tmp_path, start_window_s=0)


async def test_a_new_fleet_merges_only_once_start_learners_are_live(tmp_path):
    # A synchronous fleet starting: a's first contribution is not merged alone while b is not
    # there yet (a would run ahead of b and both would wait on rounds the other cannot reach).
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0),
                      start_learners=2, start_window_s=30.0)
    async with running_server(cfg) as server:
        (a,) = await _ready(server, "a")
        _request(server)
        sa = await a.contribute(0, _delta(1, a, 0), base_version=0)
        await _decided(server, "start hold: waiting for 2 learners (1 live)")
        assert a.result_for(sa) is None and server.engine.fragments[0].version == 0
        b = ScriptedLearner(server.port, "b")
        await b.connect()
        b.start_pump()
        await b.heartbeat()
        assert (await a.wait_result(sa, timeout_s=10)).version == 1
        for lr in (a, b):
            await lr.close()


async def test_concurrent_writers_on_one_stream_are_serialised(tmp_path):
    """The learner's sender, heartbeat and goodbye paths write to one stream from separate tasks.

    gRPC allows one write in flight per call; a second concurrent write failed the whole stream
    with INTERNAL (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS), seen as spurious reconnects in long runs.
    """
    async with running_server(sync_config(tmp_path, policy=QuorumPolicy(quorum=1, max_grace_s=0.0))) as server:
        (a,) = await _ready(server, "a")
        delta = _delta(1, a, 0)
        done = await asyncio.gather(
            *(a.heartbeat(step=i) for i in range(1, 101)),
            a.contribute(0, delta, base_version=0),
            *(a.heartbeat(step=i) for i in range(101, 201)),
        )
        result = await a.wait_result(done[100])
        assert result.outcome == "merged", result
        assert server.engine.membership.live(server.engine.clock()), "the learner's stream broke"
        await a.close()


async def test_goodbye_reaches_the_synchronizer_while_other_writes_are_in_flight(tmp_path):
    """A learner that stops says goodbye and half-closes; the synchronizer reads it and ends the
    call itself. Before, the stream was cancelled right after the goodbye (and by cancelling a
    task mid-write), so the goodbye was lost and the close raised 'RPC already finished'."""
    async with running_server(sync_config(tmp_path)) as server:
        (a,) = await _ready(server, "a")

        async def flood() -> None:
            for i in itertools.count(1):
                await a.heartbeat(step=i)

        writer = asyncio.create_task(flood())
        await eventually(lambda: server.engine.membership.learners["a"].step >= 20, what="heartbeats in flight")
        await a.close("finished")
        with pytest.raises(StreamClosed):  # its next write found the stream half-closed
            await asyncio.wait_for(writer, 5.0)
        await eventually(lambda: not server.engine.membership.connected(), what="the learner detached")
        assert server.engine.membership.learners["a"].left == "said goodbye (finished)"


async def test_the_fleet_clock_asks_every_live_learner_at_the_fastest_pace(tmp_path):
    """K=1: the clock runs at the fastest live learner's pace. With P=2, H=4 (offsets 0 and 2)
    fragment 1 falls due at fleet step 2 and fragment 0 at step 4, then every 4 steps."""
    async with running_server(sync_config(tmp_path, policy=QuorumPolicy(quorum=1, max_grace_s=0.0))) as server:
        a, b = await _ready(server, "a", "b", step_time_s=0.2)
        b.step_time_s = 0.6  # b is slower; a paces the clock
        await b.heartbeat()
        await a.wait_request(0, timeout_s=5)
        first = [(r.fragment_id, r.round) for r in a.requests[:4]]
        assert first == [(1, 1), (0, 1), (1, 2), (0, 2)] or first[:2] == [(1, 1), (0, 1)], first
        await eventually(lambda: len(a.requests) >= 6, timeout_s=15, what="more requests")
        assert [(r.fragment_id, r.round) for r in b.requests[:2]] == [(1, 1), (0, 1)], "every live learner is asked"
        status = server.engine.status()
        assert status.fleet_step >= 4 and {f.fragment_id: f.round for f in status.fragments}[0] >= 1
        # the pace is the fastest learner's: a fleet step per 0.2 s (5 a second), not per 0.6 s;
        # read from the clock itself, so the wall time it took to get here does not enter
        assert server.engine.fleet.pace_s == pytest.approx(0.2), server.engine.fleet.pace_s
        for lr in (a, b):
            await lr.close()


async def test_a_finished_learner_stops_counting_and_what_waits_merges_when_nobody_is_left(tmp_path):
    # a and b finish (their heartbeats say so) with their last progress, unsolicited, waiting in the
    # inbox: nobody is left to ask, so it merges without waiting for a request.
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=0, grace_gamma=0.0, max_grace_s=0.0, timeout_s=60))
    async with running_server(cfg) as server:
        a, b = await _ready(server, "a", "b", step_time_s=10.0)
        sa = await a.contribute(0, _delta(1, a, 0), base_version=0)
        await a.heartbeat(training_done=True)
        await eventually(lambda: server.engine.membership.live(server.engine.clock()) == {"b"}, what="a done")
        assert a.result_for(sa) is None
        sb = await b.contribute(0, _delta(2, b, 0), base_version=0)
        await b.heartbeat(training_done=True)
        ra, rb = await a.wait_result(sa, timeout_s=5), await b.wait_result(sb, timeout_s=5)
        assert ra.outcome == rb.outcome == "merged" and ra.version == rb.version == 1
        assert server.engine.rounds[0].state.round == 0, "no request opened it: the clock is 40 s away"
        for lr in (a, b):
            await lr.close()


async def test_where_every_live_learner_must_answer_a_finished_learners_answer_stands_in_for_nobody(tmp_path):
    # Streaming: b makes its last step, sends its due fragment and finishes; a, still training, is
    # a step behind. b's answer must not count as "every live learner" (a alone is live now): the
    # round waits for a's answer and merges both in one version. Counted, it merged b's alone a
    # step early and a, finding the fleet's round ahead of its step, dropped its progress.
    protocol = toy_protocol(mode="streaming")
    cfg = sync_config(tmp_path, protocol=protocol,
                      policy=QuorumPolicy(quorum=0, grace_gamma=0.5, max_grace_s=0.5, timeout_s=60))
    async with running_server(cfg) as server:
        a, b = await _ready(server, "a", "b", step_time_s=0.03, protocol=protocol)
        sb = await b.contribute(0, _delta(2, b, 0), base_version=0)
        await b.heartbeat(training_done=True)
        await eventually(lambda: server.engine.membership.live(server.engine.clock()) == {"a"}, what="b done")
        await _decided(server, "waiting for quorum: 0/1 answers (1 from learners no longer live)")
        await asyncio.sleep(1.0)  # twice the longest grace: nothing merges without a
        assert b.result_for(sb) is None and server.engine.rounds[0].fragment.version == 0
        assert server.engine.membership.live(server.engine.clock()) == {"a"}, "b's heartbeats still say done"
        sa = await a.contribute(0, _delta(1, a, 0), base_version=0)
        ra, rb = await a.wait_result(sa, timeout_s=5), await b.wait_result(sb, timeout_s=5)
        assert ra.outcome == rb.outcome == "merged" and ra.version == rb.version == 1
        for lr in (a, b):
            await lr.close()


async def test_a_learner_sending_non_finite_values_stops_counting_until_a_good_one_arrives(tmp_path):
    # K=0: the round waits for every live learner. b's contribution is refused as non-finite, so b
    # has nothing valid to give and a's merges at once instead of waiting for the timeout.
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=0, grace_gamma=0.0, max_grace_s=0.0, timeout_s=60))
    async with running_server(cfg) as server:
        a, b = await _ready(server, "a", "b", step_time_s=10.0)
        _request(server)
        bad = _delta(2, b, 0)
        bad[3] = float("nan")
        sbad = await b.contribute(0, bad, base_version=0)
        assert (await b.wait_result(sbad)).reason == "non_finite"
        assert server.engine.membership.live(server.engine.clock()) == {"a"}
        sa = await a.contribute(0, _delta(1, a, 0), base_version=0)
        assert (await a.wait_result(sa, timeout_s=5)).version == 1
        _request(server)
        sb = await b.contribute(0, _delta(3, b, 0), base_version=1)  # healed: counts again
        await eventually(lambda: server.engine.membership.live(server.engine.clock()) == {"a", "b"},
                         what="b live again")
        await _decided(server, "waiting for quorum: 1/2")
        assert b.result_for(sb) is None
        for lr in (a, b):
            await lr.close()
