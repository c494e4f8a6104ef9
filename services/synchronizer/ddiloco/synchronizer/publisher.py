"""Merged fragments on their way out: encoded once, cached for FetchState, fanned out to outboxes.

A committed version is encoded once, with the protocol's global codec, into one
``broadcast.GlobalTransfer`` whose chunks every learner's outbox shares (``publish``); the newest
transfer of each fragment stays cached, so a FetchState for a version that is current costs no
encoding either (``current``). A version no merge published (the one loaded at start-up) is encoded
on its first fetch and cached unless a merge made it old meanwhile.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import torch

from ddiloco.fragments.codec import Codec
from ddiloco.fragments.partition import Fragment
from ddiloco.fragments.payload import encode_fragment
from ddiloco.protocol import wire
from ddiloco.synchronizer.broadcast import GlobalTransfer
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.membership import Membership
from ddiloco.synchronizer.metrics import SynchronizerMetrics


class Publisher:
    def __init__(self, *, codec: Codec, max_chunk_bytes: int, membership: Membership,
                 metrics: SynchronizerMetrics, run_blocking: Callable[..., Awaitable[Any]]) -> None:
        self.codec, self.max_chunk_bytes = codec, max_chunk_bytes
        self.membership, self.metrics, self.run_blocking = membership, metrics, run_blocking
        self.layout_hash = ""
        """The global state's layout, stamped on every transfer (set when the state is installed)."""
        self.cache: dict[int, GlobalTransfer] = {}
        """Per fragment, the transfer of its newest version published or fetched."""
        self._transfer_id = 0

    def encode(self, spec: Fragment, params: torch.Tensor, version: int) -> GlobalTransfer:
        """A committed version as one transfer, encoded once and shared by every outbox."""
        self._transfer_id += 1
        chunks = encode_fragment(params, spec, codec=self.codec, kind="global", version=version,
                                 transfer_id=self._transfer_id, layout_hash=self.layout_hash,
                                 max_chunk_bytes=self.max_chunk_bytes, frame=wire.frame_chunks)
        return GlobalTransfer(spec.index, version, tuple(chunks))

    def publish(self, transfer: GlobalTransfer) -> None:
        """A committed version: cache it for FetchState and queue it to every connected learner."""
        self.cache[transfer.fragment] = transfer
        self.metrics.version.labels(str(transfer.fragment)).set(transfer.version)
        for rec in self.membership.connected():
            rec.outbox.put_global(transfer)

    async def current(self, frag: GlobalFragment) -> GlobalTransfer:
        """The fragment's current version as a transfer: the cached one, or encoded (in the thread
        pool) and cached unless a merge moved the fragment on while it was encoded."""
        p = frag.spec.index
        cached = self.cache.get(p)
        if cached is None or cached.version != frag.version:
            version = frag.version
            cached = await self.run_blocking(self.encode, frag.spec, frag.params, version)
            if frag.version == version:
                self.cache[p] = cached
        return cached
