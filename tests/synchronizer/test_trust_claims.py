"""What a learner's counters may claim, against a real synchronizer on loopback.

The steps and tokens of a contribution are the learner's word. These tests are the hostile
learners of the security review, scripted over real gRPC: one that claims 1000x the steps (and
the tokens, keeping its tokens per step honest) with a 1000x update, which used to pass the norm
guard (it judges the norm per claimed step) and move a fragment 1,500 times as far as an honest
merge; and one that answers many times just under the weight guard's bound, or with payloads
that are refused, to drag the bound up after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import torch

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.algorithm.weight_guard import WeightGuardPolicy
from ddiloco.synchronizer.store import StateStore
from tests.scripted import ScriptedLearner, eventually, genesis_learner, running_server, sync_config


def _config(tmp_path, **kw):  # type: ignore[no-untyped-def]
    return sync_config(tmp_path, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0), **kw)


def _snapshot(server) -> dict[int, tuple[torch.Tensor, int]]:  # type: ignore[no-untyped-def]
    return {p: (f.params.clone(), f.version) for p, f in server.engine.fragments.items()}


def _counted(server, outcome: str, reason: str) -> float:  # type: ignore[no-untyped-def]
    return server.engine.metrics.contributions.labels(outcome=outcome, reason=reason)._value.get()


async def _joined(server, learner_id: str) -> ScriptedLearner:  # type: ignore[no-untyped-def]
    learner = ScriptedLearner(server.port, learner_id)
    await learner.connect()
    learner.start_pump()
    return learner


async def test_a_learner_claiming_1000x_the_steps_cannot_move_a_fragment(tmp_path) -> None:
    async with running_server(_config(tmp_path)) as server:
        a = await genesis_learner(server)
        liar = await _joined(server, "liar")
        numel = a.layout[0].numel
        honest = torch.full((numel,), 0.01)
        version = 0
        for i in range(10):  # both answer honestly: the fragment's norms and the liar's own record
            who = a if i % 2 == 0 else liar
            seq = await who.contribute(0, honest, base_version=version, tokens=1000, steps=4)
            assert (await who.wait_result(seq)).outcome == "merged"
            version += 1
        before = _snapshot(server)
        seq = await liar.contribute(0, honest * 1000, base_version=version, tokens=1000 * 1000, steps=4 * 1000)
        result = await liar.wait_result(seq)
        assert (result.outcome, result.reason) == ("rejected", "norm_outlier"), result
        assert "over" in result.detail and "4000 steps" not in result.detail, "judged per admitted step"
        for p, (params, v) in before.items():
            assert server.engine.fragments[p].version == v and torch.equal(server.engine.fragments[p].params, params)
        # An honest answer right after is merged as it claims.
        seq = await a.contribute(0, honest, base_version=version, tokens=1000, steps=4)
        merged = await a.wait_result(seq)
        assert merged.outcome == "merged"
        assert server.engine.metrics.claims_bounded._value.get() == 0, "counted only where it merged bounded"
        await liar.close()
        await a.close()


async def test_claimed_steps_beyond_the_bound_are_merged_as_the_bound(tmp_path) -> None:
    """An update of honest size over inflated counters: merged, with the steps (and tokens, in
    proportion) the synchronizer can account for, so its weight beside an honest learner's is not
    1000x."""
    async with running_server(_config(tmp_path)) as server:
        a = await genesis_learner(server)
        numel = a.layout[0].numel
        seq = await a.contribute(0, torch.full((numel,), 0.01), base_version=0, tokens=250 * 4000, steps=4000)
        result = await a.wait_result(seq)
        assert result.outcome == "merged"
        assert server.engine.metrics.claims_bounded._value.get() == 1
        bound = server.engine.admission.claim_guard.policy.first_periods * server.engine.cfg.protocol.sync_every
        merged = server.engine.membership.learners["a"].tokens_merged
        assert merged == 250 * bound, "a first answer: first_periods periods, tokens per step kept"
        await a.close()


async def test_a_newcomers_first_answer_is_timed_from_when_it_joined(tmp_path) -> None:
    """A learner that joined 1 s before its first answer, in a fleet whose pace is known: its
    counters may cover that second, though the fragment's last commit is a moment old (timed from
    that commit, as before, the honest claim was cut to ``first_periods`` periods)."""
    async with running_server(_config(tmp_path)) as server:
        a = await genesis_learner(server)
        H = server.engine.cfg.protocol.sync_every
        numel = a.layout[0].numel
        b = await _joined(server, "b")
        await asyncio.sleep(1.0)
        version = 0
        for _ in range(4):  # a's pace: H steps per ~0.05 s
            await asyncio.sleep(0.05)
            seq = await a.contribute(0, torch.full((numel,), 0.01), base_version=version, tokens=H * 100, steps=H)
            assert (await a.wait_result(seq)).outcome == "merged"
            version += 1
        seq = await b.contribute(0, torch.full((numel,), 0.05), base_version=version, tokens=5 * H * 100, steps=5 * H)
        result = await b.wait_result(seq)
        assert result.outcome == "merged", result
        assert server.engine.metrics.claims_bounded._value.get() == 0
        assert server.engine.membership.learners["b"].tokens_merged == 5 * H * 100
        await b.close()
        await a.close()


async def test_a_learners_pace_outlives_a_synchronizer_restart(tmp_path) -> None:
    """The paces the claim guard measured ride with each commit: after a restart, learners that
    trained on while the synchronizer was away (at 90% of the pace it measured) are admitted as
    they claim, where a synchronizer that knew no pace cut them to ``first_periods`` periods. The
    second one's counters are timed from when its base was committed, before the restart, not
    from the merge the first one's answer made meanwhile. A state without paces (written before
    they were kept) still loads."""
    cfg = _config(tmp_path)
    H = cfg.protocol.sync_every
    async with running_server(cfg) as server:
        a = await genesis_learner(server)
        b = await _joined(server, "b")
        a.step_time_s = b.step_time_s = 0.025  # the fleet clock asks for fragment 0 every 0.1 s
        numel = a.layout[0].numel
        version = 0
        for i in range(50):  # half the pace window each, and one
            who = a if i % 2 == 0 else b
            seq = await who.contribute(0, torch.full((numel,), 0.01), base_version=version, tokens=H * 100, steps=H)
            assert (await who.wait_result(seq)).outcome == "merged"
            version += 1
        committed = time.monotonic()
        measured = server.engine.claims.paces()
        assert set(measured) == {"a", "b"}, measured
        await b.close()
        await a.close()

    def honest(who: str) -> int:  # what it trained since its base was committed, at 90% of its pace
        return int(0.9 * measured[who] * (time.monotonic() - committed))

    await asyncio.sleep(max(1.0, (3 * H + 2) / (0.9 * min(measured.values()))))  # beyond first_periods
    async with running_server(_config(tmp_path, rejoin_window_s=0.0)) as server:  # merge a's answer at once
        assert server.engine.claims.paces() == measured
        a = await _joined(server, "a")
        steps = honest("a")
        seq = await a.contribute(0, torch.full((numel,), 0.01), base_version=version, tokens=steps * 100, steps=steps)
        assert (await a.wait_result(seq, timeout_s=30.0)).outcome == "merged"
        assert server.engine.fragments[0].version == version + 1
        b = await _joined(server, "b")  # joins only now: its join does not cover its counters either
        steps = honest("b")
        assert steps > 3 * H
        await b.contribute(0, torch.full((numel,), 0.01), base_version=version, tokens=steps * 100, steps=steps)
        await eventually(lambda: any(c.learner_id == "b" for c in server.engine.rounds[0].inbox.entries),
                         what="b's answer admitted")
        assert server.engine.metrics.claims_bounded._value.get() == 0
        await b.close()
        await a.close()
    store = StateStore(tmp_path)  # a state from before paces were kept: none known
    for p in range(cfg.protocol.num_fragments):
        latest, _ = store.load_latest(p, a.layout[p].numel)
        assert latest is not None
        store.commit(dataclasses.replace(latest, paces=None))
    store.close()
    async with running_server(_config(tmp_path)) as server:
        assert server.engine.claims.paces() == {} and server.engine.state is not None


async def test_one_learner_answering_just_under_the_weight_bound_cannot_raise_it(tmp_path) -> None:
    """The review's reproduction: 120 answers of one learner, each just under the bound, raised the
    weight bound from 2,000 to 986,072, after which a 60x claim merged."""
    async with running_server(_config(tmp_path, weight_guard=WeightGuardPolicy(action="reject", min_history=3))) as server:
        a = await genesis_learner(server)
        liar = await _joined(server, "liar")
        numel = a.layout[0].numel
        small = torch.full((numel,), 1e-4)
        small_1 = torch.full((a.layout[1].numel,), 1e-4)
        guard = server.engine.admission.weight_guard
        for v in range(3):
            seq = await a.contribute(0, small, base_version=v, tokens=1000, steps=4)
            assert (await a.wait_result(seq)).outcome == "merged"
        assert guard.bound() == 8 * 250
        version = 3
        for _ in range(120):
            bound = guard.bound()
            assert bound is not None
            seq = await liar.contribute(1, small_1, base_version=server.engine.fragments[1].version,
                                        tokens=int(bound * 0.99), steps=1)
            assert (await liar.wait_result(seq)).outcome == "merged"
        assert guard.bound() == 8 * 250, "one identity counts once: the honest learner's figure stands"
        seq = await liar.contribute(0, small, base_version=version, tokens=60 * 1000, steps=4)
        result = await liar.wait_result(seq)
        assert (result.outcome, result.reason) == ("rejected", "weight_outlier")
        await liar.close()
        await a.close()


async def test_refused_answers_never_enter_the_weight_guards_history(tmp_path) -> None:
    """80 answers, each refused as non_finite after the weight guard judged it, raised the bound
    62x: the guard recorded every answer it judged, before the payload was decoded."""
    async with running_server(_config(tmp_path, weight_guard=WeightGuardPolicy(action="reject", min_history=3))) as server:
        a = await genesis_learner(server)
        liar = await _joined(server, "liar")
        numel = a.layout[0].numel
        guard = server.engine.admission.weight_guard
        for v in range(3):
            seq = await a.contribute(0, torch.full((numel,), 1e-4), base_version=v, tokens=1000, steps=4)
            assert (await a.wait_result(seq)).outcome == "merged"
        poisoned = torch.full((numel,), float("nan"))
        for _ in range(80):
            bound = guard.bound()
            assert bound is not None
            seq = await liar.contribute(0, poisoned, base_version=3, tokens=int(bound * 0.99), steps=1)
            assert (await liar.wait_result(seq)).reason == "non_finite"
        assert guard.bound() == 8 * 250
        assert _counted(server, "rejected", "non_finite") == 80
        await liar.close()
        await a.close()


async def test_with_action_bound_a_tokens_liar_is_merged_at_a_typical_learners_weight(tmp_path) -> None:
    """``weight_guard: {action: bound}``: an answer claiming 100x the tokens it trained is merged
    (its update counts) with the fleet's typical tokens per step, logged and counted as bounded."""
    cfg = _config(tmp_path, weight_guard=WeightGuardPolicy(action="bound"))
    async with running_server(cfg) as server:
        a = await genesis_learner(server)
        liar = await _joined(server, "liar")
        numel = a.layout[0].numel
        for v in range(3):
            seq = await a.contribute(0, torch.full((numel,), 1e-3), base_version=v, tokens=1000, steps=4)
            assert (await a.wait_result(seq)).outcome == "merged"
        before = server.engine.fragments[0].params.clone()
        seq = await liar.contribute(0, torch.full((numel,), 1e-3), base_version=3, tokens=100 * 1000, steps=4)
        result = await liar.wait_result(seq)
        assert result.outcome == "merged", result
        assert not torch.equal(server.engine.fragments[0].params, before), "its update was merged"
        assert server.engine.membership.learners["liar"].tokens_merged == 1000
        assert server.engine.metrics.claims_bounded._value.get() == 1
        await liar.close()
        await a.close()
