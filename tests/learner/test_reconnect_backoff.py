"""The learner's reconnection backoff, driven through tenacity's own retry loop (sleeps recorded)."""

from __future__ import annotations

import asyncio
import random

import pytest
from tenacity import AsyncRetrying, retry_if_exception_type

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.session import ReconnectBackoff


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _waits(backoff: ReconnectBackoff, outcomes: str, clock: Clock | None = None) -> list[float]:
    """Run a retry loop whose attempts go as ``outcomes`` says: F = failed to connect, C =
    connected and held for 10 s before the stream broke, c = connected and broke at once.
    Returns the waits before each next attempt."""
    waits: list[float] = []
    clock = clock or Clock()

    async def sleep(s: float) -> None:
        waits.append(s)
        clock.now += s

    async def run() -> None:
        steps = iter(outcomes)
        async for attempt in AsyncRetrying(wait=backoff, sleep=sleep, retry=retry_if_exception_type(OSError),
                                           stop=lambda state: state.attempt_number >= len(outcomes), reraise=True):
            with attempt:
                step = next(steps)
                if step in "Cc":
                    backoff.connected()
                    clock.now += 10.0 if step == "C" else 0.01
                raise OSError("stream broke")

    with pytest.raises(OSError):
        asyncio.run(run())
    return waits


def test_backoff_doubles_to_the_cap_with_bounded_jitter():
    waits = _waits(ReconnectBackoff(initial_s=0.1, max_s=2.0, jitter_s=0.5, rng=random.Random(3)), "F" * 9)
    bases = [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    assert len(waits) == len(bases)
    for w, b in zip(waits, bases, strict=True):
        assert b <= w <= b + 0.5


def test_a_session_that_held_restarts_the_sequence():
    # Seven failures reach the cap; a session connects, runs 10 s and breaks: the next wait is
    # short again, and the sequence doubles from there.
    clock = Clock()
    waits = _waits(ReconnectBackoff(initial_s=0.1, max_s=2.0, jitter_s=0.0, clock=clock), "FFFFFFFCFFF", clock)
    assert waits[:7] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert waits[7:] == pytest.approx([0.1, 0.2, 0.4])


def test_a_session_that_breaks_at_once_keeps_backing_off():
    # Connected but dropped within max_s (e.g. two processes with one id replacing each other):
    # no restart, or they would reconnect every 0.1 s forever.
    clock = Clock()
    waits = _waits(ReconnectBackoff(initial_s=0.1, max_s=2.0, jitter_s=0.0, clock=clock), "FFFFcFcF", clock)
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])


def test_attempt_counts_from_the_last_connected_session():
    clock = Clock()
    backoff = ReconnectBackoff(jitter_s=0.0, clock=clock)
    seen: list[int] = []

    async def sleep(s: float) -> None:
        clock.now += 10.0

    async def run() -> None:
        steps = iter("FFCFF")
        async for attempt in AsyncRetrying(wait=backoff, sleep=sleep, retry=retry_if_exception_type(OSError),
                                           before_sleep=lambda st: seen.append(backoff.attempt(st)),
                                           stop=lambda st: st.attempt_number >= 5, reraise=True):
            with attempt:
                if next(steps) == "C":
                    backoff.connected()
                    clock.now += 10.0
                raise OSError("x")

    with pytest.raises(OSError):
        asyncio.run(run())
    assert seen == [1, 2, 1, 2]


@pytest.mark.parametrize("kw", [dict(initial_s=0.0), dict(initial_s=1.0, max_s=0.5), dict(jitter_s=-1.0)])
def test_bad_backoff_settings_are_refused(kw):
    with pytest.raises(ValueError):
        ReconnectBackoff(**kw)


def test_reconnect_max_below_the_initial_wait_is_refused():
    with pytest.raises(ValueError, match="reconnect_max_s"):
        LearnerConfig(reconnect_max_s=0.05)
