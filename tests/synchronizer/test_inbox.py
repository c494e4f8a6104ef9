"""The fragment inbox: one slot per learner, supersession for the same base, summing otherwise."""

from __future__ import annotations

import pytest
import torch

from ddiloco.synchronizer.inbox import Contribution, Inbox


def contrib(seq: int, base: int, *, lid: str = "a", inc: int = 1, tokens: int = 100, steps: int = 4) -> Contribution:
    return Contribution(lid, seq, 0, base, tokens, steps, float(seq), 0, inc)


def vec(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_newer_contribution_for_the_same_base_replaces_the_older_one() -> None:
    box = Inbox(3)
    assert box.add(contrib(1, 0), vec(1, 1, 1)) is None
    replaced = box.add(contrib(2, 0, tokens=200, steps=8), vec(2, 2, 2))
    assert replaced is not None and replaced.sequence == 1
    sealed = box.seal()
    assert [(e.sequence, e.tokens, e.steps, e.carried) for e in sealed.entries] == [(2, 200, 8, ())]
    torch.testing.assert_close(sealed.deltas, vec(2, 2, 2)[None])


def test_newer_base_sums_with_the_older_contribution_and_carries_it() -> None:
    box = Inbox(3)
    box.add(contrib(1, 0), vec(1, 2, 3))
    assert box.add(contrib(2, 1, tokens=50, steps=2), vec(10, 20, 30)) is None
    sealed = box.seal()
    (e,) = sealed.entries
    assert (e.sequence, e.base_version, e.tokens, e.steps) == (2, 1, 150, 6)
    assert [(p.sequence, p.base_version, p.tokens, p.steps) for p in e.parts()] == [(2, 1, 50, 2), (1, 0, 100, 4)]
    torch.testing.assert_close(sealed.deltas, vec(11, 22, 33)[None])


def test_new_incarnation_sums_even_for_the_same_base() -> None:
    # A restarted learner starts from the global state: its work does not contain the dead process's.
    box = Inbox(2)
    box.add(contrib(7, 0, inc=1), vec(1, 1))
    assert box.add(contrib(1, 0, inc=2), vec(2, 3)) is None
    sealed = box.seal()
    assert [p.incarnation for p in sealed.entries[0].parts()] == [2, 1]
    torch.testing.assert_close(sealed.deltas, vec(3, 4)[None])


def test_superseding_a_summed_entry_keeps_what_it_carries() -> None:
    box = Inbox(2)
    box.add(contrib(1, 0), vec(1, 1))                       # base 0: steps 1..4
    box.add(contrib(2, 1), vec(5, 5))                       # base 1: not in it -> summed
    replaced = box.add(contrib(3, 1, tokens=300, steps=12), vec(7, 7))  # base 1 again: replaces seq 2 only
    assert replaced is not None and replaced.sequence == 2 and replaced.carried == ()
    sealed = box.seal()
    (e,) = sealed.entries
    assert [p.sequence for p in e.parts()] == [3, 1]
    assert (e.tokens, e.steps) == (400, 16)
    torch.testing.assert_close(sealed.deltas, vec(8, 8)[None])


def test_summing_a_third_time_counts_each_part_once() -> None:
    """An entry that already carried one contribution was carried whole (its tokens included what it
    carried) when a third arrived: 5, 10 and 7 tokens on bases 0, 1 and 2 made an entry of 27
    tokens and 7 steps instead of 22 and 6, and the middle part reported 15 tokens."""
    box = Inbox(3)
    box.add(contrib(1, 0, tokens=5, steps=1), vec(1, 0, 0))
    box.add(contrib(2, 1, tokens=10, steps=2), vec(0, 1, 0))
    box.add(contrib(3, 2, tokens=7, steps=3), vec(0, 0, 1))
    (e,) = box.seal().entries
    assert (e.tokens, e.steps) == (22, 6)
    assert sorted((p.sequence, p.tokens, p.steps) for p in e.parts()) == [(1, 5, 1), (2, 10, 2), (3, 7, 3)]


def test_other_learners_keep_their_own_slots() -> None:
    box = Inbox(2, capacity=1)
    box.add(contrib(1, 0, lid="a"), vec(1, 0))
    box.add(contrib(1, 1, lid="b"), vec(0, 1))
    box.add(contrib(2, 1, lid="a"), vec(2, 0))
    sealed = box.seal()
    assert [e.learner_id for e in sealed.entries] == ["a", "b"]
    torch.testing.assert_close(sealed.deltas, torch.tensor([[3.0, 0.0], [0.0, 1.0]]))


def test_a_sealed_summed_entry_can_be_put_back_and_superseded_later() -> None:
    box = Inbox(2)
    box.add(contrib(1, 0), vec(1, 1))
    box.add(contrib(2, 1), vec(5, 5))
    sealed = box.seal()
    fresh = Inbox(2)
    with pytest.raises(ValueError, match="carry"):
        fresh.add(sealed.entries[0], sealed.deltas[0])
    fresh.add(sealed.entries[0], sealed.deltas[0], sealed.carry.get(0))
    fresh.add(contrib(3, 1), vec(9, 9))  # supersedes seq 2, keeps seq 1's (1, 1)
    again = fresh.seal()
    assert [p.sequence for p in again.entries[0].parts()] == [3, 1]
    torch.testing.assert_close(again.deltas, vec(10, 10)[None])


def test_wrong_size_is_refused_and_changes_nothing() -> None:
    box = Inbox(3)
    with pytest.raises(ValueError, match="3"):
        box.add(contrib(1, 0), vec(1, 2))
    assert len(box) == 0
