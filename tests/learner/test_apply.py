"""Apply policies do what they say, and counters always match the progress the next Delta carries."""

from __future__ import annotations

import pytest
import torch

from ddiloco.learner.apply import apply_global, counters_after_apply


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
