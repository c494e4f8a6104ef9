"""The publisher: a merged version is encoded once, whatever the number of learners and fetches;
the cache holds each fragment's newest version and a fetch that raced a merge does not replace it."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from ddiloco.fragments import payload
from ddiloco.fragments.codec import make_codec
from ddiloco.fragments.partition import Fragment, TensorSpec
from ddiloco.synchronizer import publisher as publisher_module
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.membership import Membership
from ddiloco.synchronizer.metrics import SynchronizerMetrics
from ddiloco.synchronizer.publisher import Publisher

SPEC = Fragment(0, (TensorSpec("w", (64, 8)),))


class Parts:
    """A publisher over ``learners`` connected learners, counting what it encodes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, codec: str, learners: int) -> None:
        self.encoded: list[tuple[int, int, str]] = []  # (fragment, version, codec)

        def counting(values: torch.Tensor, fragment: Fragment, **kw: Any) -> Any:
            self.encoded.append((fragment.index, kw["version"], kw["codec"].name))
            return payload.encode_fragment(values, fragment, **kw)

        monkeypatch.setattr(publisher_module, "encode_fragment", counting)
        self.membership = Membership(heartbeat_timeout_s=10.0, max_control=16, max_learners=64)
        self.records = [self.membership.attach(f"l{i}", 0.0, 1, {}) for i in range(learners)]
        self.metrics = SynchronizerMetrics()
        self.during_encode: list[Any] = []
        self.publisher = Publisher(codec=make_codec(codec), max_chunk_bytes=256, membership=self.membership,
                                   metrics=self.metrics, run_blocking=self.run_blocking)
        self.publisher.layout_hash = "layout"

    async def run_blocking(self, fn: Any, *args: Any) -> Any:
        out = fn(*args)
        while self.during_encode:  # what happens meanwhile on the event loop (a merge, say)
            self.during_encode.pop(0)()
        return out

    def version_gauge(self) -> float:
        return float(self.metrics.version.labels("0")._value.get())


def fragment(version: int) -> GlobalFragment:
    return GlobalFragment(SPEC, torch.randn(SPEC.numel), torch.zeros(SPEC.numel), version)


@pytest.mark.parametrize("codec", ["fp32", "int8_block"])
async def test_a_merged_version_is_encoded_once_for_every_learner_and_fetch(
        monkeypatch: pytest.MonkeyPatch, codec: str) -> None:
    parts = Parts(monkeypatch, codec, learners=12)
    frag = fragment(0)
    params = torch.randn(SPEC.numel)
    transfer = parts.publisher.encode(SPEC, params, 1)
    frag.advance(params, frag.momentum, 1, 0.0)
    parts.publisher.publish(transfer)
    assert len(transfer.chunks) > 1, "several chunks, all shared"
    for rec in parts.records:
        assert rec.outbox.pop_nowait() is transfer, "every outbox gets the same transfer, chunks and all"
    for _ in range(5):
        assert await parts.publisher.current(frag) is transfer, "a fetch of the current version is the cached one"
    assert parts.encoded == [(0, 1, codec)]
    assert {c.header.codec for c in transfer.chunks if c.header is not None} == {codec}
    assert {c.header.layout_hash for c in transfer.chunks if c.header is not None} == {"layout"}
    assert parts.version_gauge() == 1


async def test_only_connected_learners_are_sent_a_version(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = Parts(monkeypatch, "fp32", learners=3)
    gone = parts.records[1]
    assert parts.membership.detach(gone, gone.stream_id)
    transfer = parts.publisher.encode(SPEC, torch.zeros(SPEC.numel), 1)
    parts.publisher.publish(transfer)
    assert [rec.outbox.pop_nowait() is transfer for rec in parts.records] == [True, False, True]


async def test_a_version_no_merge_published_is_encoded_on_its_first_fetch_and_cached(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parts = Parts(monkeypatch, "fp32", learners=2)
    frag = fragment(7)  # loaded at start-up: nothing published it
    first = await parts.publisher.current(frag)
    assert (first.fragment, first.version) == (0, 7)
    assert await parts.publisher.current(frag) is first
    assert parts.encoded == [(0, 7, "fp32")]
    assert all(rec.outbox.pending() == 0 for rec in parts.records), "a fetch is sent to no outbox"


async def test_a_newer_version_replaces_the_cached_one(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = Parts(monkeypatch, "fp32", learners=2)
    frag = fragment(3)
    old = await parts.publisher.current(frag)
    params = torch.randn(SPEC.numel)
    new = parts.publisher.encode(SPEC, params, 4)
    frag.advance(params, frag.momentum, 4, 0.0)
    parts.publisher.publish(new)
    assert parts.publisher.cache == {0: new}
    assert await parts.publisher.current(frag) is new
    assert old.version == 3 and parts.encoded == [(0, 3, "fp32"), (0, 4, "fp32")]
    # An outbox holds one pending version per fragment: a newer one replaces the unsent older one.
    newer = parts.publisher.encode(SPEC, params, 5)
    frag.advance(params, frag.momentum, 5, 0.0)
    parts.publisher.publish(newer)
    assert parts.publisher.cache == {0: newer}
    assert [(rec.outbox.pop_nowait(), rec.outbox.replaced) for rec in parts.records] == [(newer, 1), (newer, 1)]
    assert parts.version_gauge() == 5


async def test_a_fetch_that_raced_a_merge_is_answered_but_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = Parts(monkeypatch, "fp32", learners=1)
    frag = fragment(2)
    params = torch.randn(SPEC.numel)
    merged = parts.publisher.encode(SPEC, params, 3)

    def merge() -> None:
        frag.advance(params, frag.momentum, 3, 0.0)
        parts.publisher.publish(merged)

    parts.during_encode.append(merge)
    fetched = await parts.publisher.current(frag)
    assert fetched.version == 2, "the fetch is answered with the version it asked for"
    assert parts.publisher.cache == {0: merged}, "and the merge's newer version stays cached"
    assert await parts.publisher.current(frag) is merged


def test_transfer_ids_are_unique(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = Parts(monkeypatch, "fp32", learners=0)
    encode = functools.partial(parts.publisher.encode, SPEC, torch.zeros(SPEC.numel))
    ids = {encode(v).chunks[0].transfer_id for v in range(1, 6)}
    assert len(ids) == 5
