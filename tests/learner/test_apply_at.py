"""``apply_at``: a merge of the learner's own contribution applied ``tau`` steps after the send (the
protocol's overlap) or at the first boundary after it arrived, one step after the send at the
earliest (``arrival``, the decoupled mode's default), against a real synchronizer on loopback."""

from __future__ import annotations

import time

import pytest
import torch

from ddiloco.algorithm.learner_fragment import LearnerFragment
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner.config import learner_config
from ddiloco.learner.sync import DecoupledSync, SyncError
from tests.learner.test_decoupled_sync import _events, _mlp, fleet


def test_a_merge_is_due_tau_steps_after_the_send_or_one_step_after_it_on_arrival():
    schedule = FragmentSchedule(num_fragments=3, sync_every=12, overlap=3)
    frag = LearnerFragment(0, torch.zeros(4), 0)
    assert not frag.due(100, schedule, resync=False) and not frag.due(100, schedule, resync=False, on_arrival=True), \
        "nothing sent yet: a merge waits until this learner's own progress is on its way"
    assert frag.due(5, schedule, resync=True), "a resync applies at once"
    frag.send(10, torch.ones(4), keep_values=True)
    # the boundary before step N is reached after inner step N - 1
    assert [n for n in range(10, 16) if frag.due(n, schedule, resync=False)] == [14, 15]
    assert [n for n in range(10, 16) if frag.due(n, schedule, resync=False, on_arrival=True)] == [12, 13, 14, 15]


def test_arrival_is_refused_where_learners_wait_for_merges_and_a_bad_value_is_named():
    for mode in ("streaming", "diloco"):
        with pytest.raises(SyncError, match="apply_at: arrival is for the decoupled mode"):
            DecoupledSync(_mlp(), synchronizer="127.0.0.1:9", fragments=1, sync_every=4, mode=mode, apply_at="arrival")
    with pytest.raises(SyncError, match="apply_at"):
        DecoupledSync(_mlp(), synchronizer="127.0.0.1:9", fragments=2, sync_every=4, apply_at="soon")
    DecoupledSync(_mlp(), synchronizer="127.0.0.1:9", fragments=2, sync_every=4, apply_at="arrival").close()


def test_the_default_is_the_modes_arrival_in_decoupled_tau_where_learners_wait():
    assert learner_config({}).apply_at is None
    assert learner_config({}).applies_on_arrival, "decoupled mode applies merges on arrival by default"
    for mode in ("streaming", "diloco"):
        assert not learner_config({"protocol": {"mode": mode}}).applies_on_arrival, mode
    assert not learner_config({"learner": {"apply_at": "tau"}}).applies_on_arrival, "a set value wins"
    assert learner_config({"learner": {"apply_at": "arrival"}}).applies_on_arrival


def _sends_and_applies(tmp_path, **settings) -> tuple[str, list[tuple[int, int]]]:
    """The start event's ``apply_at``, and (send step, apply step) of each merge of a learner's own
    contribution applied while it trained (the hand-over's at the last step comes back after training
    ended), tau = 2."""
    with fleet(tmp_path, steps=16, **settings) as (_, sync, model, opt, log):
        gen = torch.Generator().manual_seed(0)
        assert sync.join() == 0
        for _ in range(16):
            x = torch.randn(32, 8, generator=gen)
            loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.2)  # a step long enough for a merge on loopback to come back within it
            sync.step(tokens=32, loss=float(loss))
        assert sync.finish()
        events = _events(log)
    pairs = []
    for e in events:
        if e["event"] == "apply" and not e["resync"] and e["step"] <= 16:
            sent = [s["step"] for s in events if s["event"] == "send" and s["fragment"] == e["fragment"]
                    and s["step"] < e["step"]]
            pairs.append((sent[-1], e["step"]))
    return next(e for e in events if e["event"] == "start")["apply_at"], pairs


def test_on_arrival_the_default_a_merge_that_came_back_within_a_step_applies_a_step_after_the_send(tmp_path):
    rule, pairs = _sends_and_applies(tmp_path)
    assert rule == "arrival", "the start event names the rule the default resolved to"
    assert pairs, "merges were applied"
    # the apply event names the boundary before the next step: send step + 2 is one step later
    assert all(applied >= sent + 2 for sent, applied in pairs), str(pairs)
    assert any(applied == sent + 2 for sent, applied in pairs), \
        f"one-learner merges on loopback come back within a 0.2 s step, yet none applied then: {pairs}"


def test_at_tau_a_merge_waits_tau_steps_however_early_it_came_back(tmp_path):
    rule, pairs = _sends_and_applies(tmp_path, apply_at="tau")
    assert rule == "tau"
    assert pairs, "merges were applied"
    assert all(applied >= sent + 3 for sent, applied in pairs), str(pairs)  # tau = 2
