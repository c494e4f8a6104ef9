"""The learner's rules on one fragment: apply policies, counters, when to answer, apply and heal."""

from __future__ import annotations

import pytest
import torch

from ddiloco.algorithm.learner_fragment import LearnerFragment, apply_global, counters_after_apply
from ddiloco.fragments.schedule import FragmentSchedule


def _setup():
    g = torch.Generator().manual_seed(0)
    base_old = torch.randn(100, generator=g)
    at_send = base_old - 0.1 * torch.randn(100, generator=g)  # local progress up to the send
    local = at_send - 0.05 * torch.randn(100, generator=g)  # more progress during the overlap
    merged = base_old - 0.08 * torch.randn(100, generator=g)  # the new global
    return base_old, at_send, local, merged


def test_overwrite_takes_the_global_and_resets_counters():
    _, at_send, local, merged = _setup()
    new = apply_global("overwrite", local=local, global_=merged, reference=at_send)
    assert torch.equal(new, merged) and new is not merged
    assert counters_after_apply("overwrite", (900, 9), (600, 6)) == (0, 0)


def test_mix_interpolates_with_alpha():
    _, at_send, local, merged = _setup()
    new = apply_global("mix", local=local, global_=merged, reference=at_send, alpha=0.25)
    torch.testing.assert_close(new, 0.25 * local + 0.75 * merged)
    assert counters_after_apply("mix", (900, 9), (600, 6)) == (300, 3)


def test_replay_keeps_exactly_the_progress_since_the_send():
    _, at_send, local, merged = _setup()
    new = apply_global("replay", local=local, global_=merged, reference=at_send)
    torch.testing.assert_close(new - merged, local - at_send)
    # the next contribution, base_new - theta, carries exactly the progress since the send ...
    torch.testing.assert_close(merged - new, at_send - local)
    # ... and so do the counters
    assert counters_after_apply("replay", (900, 9), (600, 6)) == (300, 3)


def test_replay_when_nothing_was_sent_keeps_all_unsent_progress():
    base_old, _, local, merged = _setup()
    new = apply_global("replay", local=local, global_=merged, reference=base_old)
    torch.testing.assert_close(merged - new, base_old - local)
    assert counters_after_apply("replay", (900, 9), None) == (900, 9)


def test_inputs_are_not_modified_and_bad_input_refused():
    _, at_send, local, merged = _setup()
    copies = [t.clone() for t in (local, merged, at_send)]
    for policy in ("overwrite", "mix", "replay"):
        apply_global(policy, local=local, global_=merged, reference=at_send)
    for a, b in zip(copies, (local, merged, at_send), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="unknown apply policy"):
        apply_global("average", local=local, global_=merged, reference=at_send)
    with pytest.raises(ValueError, match="shape mismatch"):
        apply_global("overwrite", local=local, global_=merged[:10], reference=at_send)


# -- LearnerFragment: the learner's rules, without a thread or a server ---------------------------


def _fragment(n: int = 8) -> LearnerFragment:
    return LearnerFragment(0, torch.zeros(n), version=3, window_start=11)


def test_counters_grow_per_step_and_a_contribution_is_base_minus_current():
    frag = _fragment()
    for _ in range(4):
        frag.trained(100)
    assert frag.counters == (400, 4)
    current = torch.full((8,), -0.5)
    assert torch.equal(frag.contribution(current), torch.full((8,), 0.5))
    current[2] = float("nan")
    assert frag.contribution(current) is None  # heal instead of sending


def test_a_request_before_the_last_answer_merged_is_held_for_at_most_one_period():
    frag = _fragment()
    assert not frag.answer_held(20, sync_every=8)  # nothing sent
    frag.trained(10)
    frag.send(20, torch.zeros(8), keep_values=False)
    assert frag.answer_held(27, sync_every=8)
    assert not frag.answer_held(28, sync_every=8)  # its merge never came: answer again


def test_a_merge_applies_tau_steps_after_the_send_and_never_before_the_own_send():
    schedule = FragmentSchedule(num_fragments=4, sync_every=8, overlap=2)
    frag = _fragment()
    assert not frag.due(30, schedule, resync=False)  # others' merge, ours unsent: hold it
    assert frag.due(30, schedule, resync=True)  # a resync applies at once
    frag.trained(10)
    frag.send(20, torch.zeros(8), keep_values=False)
    apply_at = schedule.apply_step(20)
    assert not frag.due(apply_at, schedule, resync=False)
    assert frag.due(apply_at + 1, schedule, resync=False)


@pytest.mark.parametrize("policy", ["overwrite", "mix", "replay"])
def test_apply_moves_base_version_counters_and_window_by_the_policy(policy):
    frag = _fragment()
    for _ in range(3):
        frag.trained(10)
    at_send = torch.full((8,), -1.0)
    frag.send(20, at_send.clone(), keep_values=policy == "replay")
    frag.trained(10)  # one more step during the overlap
    local = torch.full((8,), -1.25)
    merged = torch.full((8,), -0.75)
    assert frag.apply(policy, local=local, values=merged, version=3, step=23) is None  # not newer
    new = frag.apply(policy, local=local, values=merged, version=4, step=23)
    assert new is not None and frag.version == 4 and torch.equal(frag.base, merged) and frag.sent is None
    if policy == "overwrite":
        assert torch.equal(new, merged) and frag.counters == (0, 0) and frag.window_start == 23
    else:
        assert frag.counters == (10, 1) and frag.window_start == 21  # the progress since the send
    if policy == "replay":
        assert torch.equal(new, merged + (local - at_send))


def test_a_resync_overwrites_even_an_older_version():
    frag = _fragment()
    frag.trained(10)
    new = frag.apply("replay", local=torch.ones(8), values=torch.full((8,), 2.0), version=1, step=30, resync=True)
    assert torch.equal(new, torch.full((8,), 2.0)) and frag.version == 1 and frag.counters == (0, 0)


def test_a_hand_over_counts_the_steps_its_outer_gradient_holds():
    frag = _fragment()
    assert frag.hand_over(40)  # nothing sent: everything goes
    for _ in range(5):
        frag.trained(10)
    frag.send(40, torch.zeros(8), keep_values=False)
    assert not frag.hand_over(40)  # sent at the last step already
    frag.trained(10)
    # an answer awaits its merge: the hand-over's base - current holds its 5 steps and the one
    # since, and so do its counters (it replaces that answer at the synchronizer, or is re-anchored)
    assert frag.hand_over(41) and frag.counters == (60, 6)


def test_heal_returns_the_base_and_starts_over():
    frag = _fragment()
    frag.trained(10)
    frag.send(20, torch.zeros(8), keep_values=False)
    assert frag.heal(25) is frag.base
    assert frag.counters == (0, 0) and frag.window_start == 26 and frag.sent is None


@pytest.mark.parametrize("policy", ["mix", "replay", "average"])
def test_an_apply_that_fails_changes_no_state(policy):
    f = LearnerFragment(0, torch.zeros(4), version=2)
    for _ in range(3):
        f.trained(10)
    f.send(3, torch.ones(4), keep_values=True)
    before = (f.version, f.counters, f.window_start, f.sent, f.base)
    bad = torch.zeros(2, 2) if policy != "average" else torch.zeros(4)  # a shape, or an unknown policy
    with pytest.raises(ValueError):
        f.apply(policy, local=torch.zeros(4), values=bad, version=3, step=5)
    assert (f.version, f.counters, f.window_start, f.sent, f.base) == before
    with pytest.raises(ValueError, match="unknown apply policy"):
        f.accept("average", values=torch.zeros(4), version=3, step=5)
    assert (f.version, f.counters, f.window_start, f.sent, f.base) == before
