"""The fleet's typical value as the lower median of per-identity medians."""

from __future__ import annotations

import pytest

from ddiloco.algorithm.identity_median import IdentityMedians


def test_one_identity_counts_once_however_much_it_sends() -> None:
    history = IdentityMedians(window=8)
    for value, who in ((1.0, "a"), (1.2, "b"), (0.9, "c")):
        history.record(who, value)
    for _ in range(500):
        history.record("loud", 1e6)
    assert history.typical() == 1.0, "medians (1.0, 1.2, 0.9, 1e6): the lower median"
    assert history.of("loud") == 1e6 and history.count == 503 and history.identities() == 4


def test_among_two_the_lower_one_stands() -> None:
    history = IdentityMedians(window=4)
    history.record("honest", 2.0)
    history.record("liar", 2000.0)
    assert history.typical() == 2.0
    assert history.typical(exclude="honest") == 2000.0
    assert history.typical(exclude="liar") == 2.0
    assert IdentityMedians(window=4).typical() is None


def test_its_window_and_identities_are_bounded() -> None:
    history = IdentityMedians(window=3, max_identities=2)
    for v in (1.0, 1.0, 1.0, 9.0, 9.0):
        history.record("a", v)
    assert history.of("a") == 9.0, "only the last 3 values count"
    history.record("b", 2.0)
    history.record("a", 9.0)  # heard again: b is now the longest unheard
    history.record("c", 3.0)
    assert history.of("b") is None and history.of("a") == 9.0 and history.of("c") == 3.0
    with pytest.raises(ValueError):
        IdentityMedians(window=0)
