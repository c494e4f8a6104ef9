"""Per-learner outboxes: how merged fragments and control messages reach each learner.

A slow receiver must never slow the others, and must never make the synchronizer buffer without
bound. Each learner has an outbox with two parts:

- globals: at most one pending transfer per fragment. A newer version of a fragment replaces an
  older one that has not started sending, so a slow learner gets only the newest version of each
  fragment, and the outbox never holds more than P transfers. Transfers are encoded once per
  merge and shared (the same chunk objects) by every outbox.
- control: results, resync and drain messages in order, bounded; beyond the bound the oldest
  *result* messages are dropped and counted (resync and drain are never dropped).

The outbox outlives a stream: results for a learner that reconnects are delivered on its new
stream.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass

from ddiloco.fragments.chunking import Chunk
from ddiloco.protocol.wire import ContributionResult, SynchronizerMessage


@dataclass(frozen=True)
class GlobalTransfer:
    fragment: int
    version: int
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(c.data) for c in self.chunks)


class Outbox:
    def __init__(self, max_control: int) -> None:
        self.max_control = max_control
        self._globals: OrderedDict[int, GlobalTransfer] = OrderedDict()
        self._control: deque[SynchronizerMessage] = deque()
        self._wake = asyncio.Event()
        self.dropped = 0
        self.replaced = 0

    def put_global(self, transfer: GlobalTransfer) -> None:
        old = self._globals.pop(transfer.fragment, None)
        if old is not None:
            if old.version >= transfer.version:
                self._globals[transfer.fragment] = old
                return
            self.replaced += 1
        self._globals[transfer.fragment] = transfer
        self._wake.set()

    def put_control(self, message: SynchronizerMessage) -> None:
        self._control.append(message)
        while len(self._control) > self.max_control:
            for i, m in enumerate(self._control):
                if isinstance(m, ContributionResult):
                    del self._control[i]
                    self.dropped += 1
                    break
            else:
                break
        self._wake.set()

    def drop_results(self) -> int:
        """Forget queued results (their learner process is gone; a new one must not get them)."""
        kept = deque(m for m in self._control if not isinstance(m, ContributionResult))
        dropped = len(self._control) - len(kept)
        self._control = kept
        return dropped

    def pending(self) -> int:
        return len(self._globals) + len(self._control)

    def pop_nowait(self) -> SynchronizerMessage | GlobalTransfer | None:
        if self._control:
            return self._control.popleft()
        if self._globals:
            _, transfer = self._globals.popitem(last=False)
            return transfer
        self._wake.clear()
        return None

    async def pop(self) -> SynchronizerMessage | GlobalTransfer:
        while True:
            item = self.pop_nowait()
            if item is not None:
                return item
            await self._wake.wait()

    def wake(self) -> None:
        """Wake a waiting ``pop`` (e.g. so its stream can notice it is closing)."""
        self._wake.set()
