"""Where the learner's link runs a fragment's codec: on its event loop for small fragments, in a
worker thread for large ones (``session.off_loop``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ddiloco.learner.session import INLINE_VALUES, off_loop


def test_small_fragments_are_coded_on_the_loop_and_large_ones_beside_it():
    async def main() -> tuple[int, int, int, int]:
        loop_thread = threading.get_ident()
        small = await off_loop(INLINE_VALUES, threading.get_ident)
        large = await off_loop(INLINE_VALUES + 1, threading.get_ident)
        # while a large one is coded, the loop runs other tasks
        started, release = threading.Event(), threading.Event()

        def slow() -> int:
            started.set()
            assert release.wait(10)
            return 7

        task = asyncio.ensure_future(off_loop(INLINE_VALUES * 4, slow))
        while not started.is_set():
            await asyncio.sleep(0.001)
        ticks = 0
        for _ in range(3):
            await asyncio.sleep(0)
            ticks += 1
        release.set()
        return loop_thread, small, large, ticks + await task

    loop_thread, small, large, result = asyncio.run(main())
    assert small == loop_thread and large != loop_thread
    assert result == 3 + 7


@pytest.mark.parametrize("numel", [1, INLINE_VALUES + 1])
def test_a_codec_error_reaches_the_caller_either_way(numel):
    def broken(x: int, *, y: int) -> None:
        raise ValueError(f"bad payload {x} {y}")

    with pytest.raises(ValueError, match="bad payload 1 2"):
        asyncio.run(off_loop(numel, broken, 1, y=2))
