"""Peers of this version and of earlier wire contracts work together, over real gRPC.

The oldest contract: every chunk carries the CRC-32C of its data, and a receiver checks each
chunk's CRC-32C as well as the payload digest (a mismatch ends the stream with DATA_LOSS). Its
peers do not send ``digest_only`` (Hello, Welcome, FetchStateRequest), which reads as false. An
older peer is played here by the real learner stream or the real synchronizer with exactly those
two differences: its hello or welcome leaves ``digest_only`` unset, and its reassembler checks
every chunk's CRC-32C (``_StrictReassembler``, the previous version's rule).

The contract before the trailing digest: every transfer's header carries its 16-byte digest, and a
chunk's ``digest`` field is unknown (protobuf drops it). Its synchronizer's Welcome leaves
``trailing_digest`` unset; it is played by the real synchronizer with that welcome and a
reassembler that refuses a header without a digest and never sees a chunk's (``_HeaderDigestOnly``).
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from ddiloco.fragments.chunking import Chunk, Reassembler, Transfer, crc32c, digest
from ddiloco.fragments.errors import ChecksumError, HeaderError
from ddiloco.protocol import wire
from ddiloco.protocol.client import StreamClosed
from ddiloco.synchronizer import server as server_module
from tests.scripted import (
    ScriptedLearner,
    eventually,
    genesis_learner,
    older_welcome,
    running_server,
    sync_config,
)


class _StrictReassembler(Reassembler):
    """The previous version's receiver: every chunk's CRC-32C is checked as it arrives."""

    chunks_checked = 0

    def feed(self, chunk: Chunk) -> Transfer | None:
        if crc32c(chunk.data) != chunk.crc32c:
            raise self._fail(ChecksumError(f"chunk {chunk.index} of transfer {chunk.transfer_id} fails its CRC-32C"))
        type(self).chunks_checked += 1
        return super().feed(chunk)


class _HeaderDigestOnly(Reassembler):
    """The receiver before the trailing digest: a chunk's digest field is unknown to it (dropped, as
    protobuf drops an unknown field), and a header without a 16-byte digest is refused."""

    transfers = 0

    def feed(self, chunk: Chunk) -> Transfer | None:
        if chunk.header is not None and len(chunk.header.digest) != 16:
            raise self._fail(HeaderError(f"transfer {chunk.transfer_id} has no 16-byte digest"))
        transfer = super().feed(dataclasses.replace(chunk, digest=b"", frame=None))
        type(self).transfers += transfer is not None
        return transfer


class _Recording(Reassembler):
    """This version's receiver, recording the digest of every transfer it completes: (header's,
    last chunk's)."""

    seen: list[tuple[str, bytes, bytes]] = []

    def feed(self, chunk: Chunk) -> Transfer | None:
        transfer = super().feed(chunk)
        if transfer is not None:
            type(self).seen.append((transfer.header.kind, transfer.header.digest, chunk.digest))
        return transfer


@pytest.fixture
def strict() -> type[_StrictReassembler]:
    class Strict(_StrictReassembler):
        chunks_checked = 0
    return Strict


async def _merged_global(learner: ScriptedLearner, fragment: int, version: int) -> Transfer:
    await eventually(lambda: (t := learner.latest_global(fragment)) is not None and t.header.version >= version,
                     what=f"global fragment {fragment} at version {version}")
    transfer = learner.latest_global(fragment)
    assert transfer is not None
    return transfer


async def test_an_older_learner_gets_a_crc_on_every_chunk_and_its_own_crcs_are_accepted(tmp_path, strict):
    """New synchronizer, older learner: the learner's hello leaves digest_only unset, so every
    chunk sent to it, on Sync and on FetchState, carries its CRC-32C; its contributions (with
    CRCs) merge. A learner of this version, beside it, gets the same chunks without CRCs."""
    async with running_server(sync_config(tmp_path)) as server:
        new = await genesis_learner(server, "new")
        old = ScriptedLearner(server.port, "old")
        old.stream._reassembler = strict(max_chunk_bytes=old.protocol.max_chunk_bytes)
        welcome = await old.connect(digest_only=False)
        assert welcome.digest_only  # the synchronizer says what it accepts; the old learner ignores it
        old.stream.peer_digest_only = False  # it always sends CRCs, as the previous version did
        old.start_pump()
        version = server.engine.fragments[0].version
        seq = await old.contribute(0, torch.full((old.layout[0].numel,), 0.01), base_version=version)
        assert (await old.wait_result(seq)).outcome == "merged"
        got = await _merged_global(old, 0, version + 1)
        assert old.closed is None, old.closed
        assert strict.chunks_checked >= got.header.chunk_count
        assert torch.equal(old.decode(got), server.engine.fragments[0].params)
        # the learner of this version: the same merge, chunks without a CRC, the same values
        await _merged_global(new, 0, version + 1)
        raw = [c async for c in new.stream.stub.FetchState(wire.fetch_request_to_pb(
            wire.FetchStateRequest(learner_id="new", fragment_ids=(0,))))]
        assert raw and all(wire.chunk_from_pb(c).crc32c == 0 for c in raw)
        # FetchState for an older learner: its request leaves digest_only unset
        older = wire.fetch_request_to_pb(wire.FetchStateRequest(learner_id="old", fragment_ids=(0,),
                                                                digest_only=False))
        check = strict(max_chunk_bytes=old.protocol.max_chunk_bytes)
        fetched = [t for c in [c async for c in old.stream.stub.FetchState(older)]
                   if (t := check.feed(wire.chunk_from_pb(c))) is not None]
        assert [t.header.fragment_id for t in fetched] == [0]
        assert torch.equal(old.decode(fetched[0]), server.engine.fragments[0].params)
        await old.close("done")
        await new.close("done")


async def test_a_learner_sends_crcs_to_an_older_synchronizer(tmp_path, monkeypatch, strict):
    """Older synchronizer, new learner: its welcome leaves digest_only unset, so the learner's
    stream adds the CRC-32C to every chunk, and the strict synchronizer merges genesis and a
    contribution. Without the CRCs the same synchronizer ends the stream (the control)."""
    monkeypatch.setattr(server_module, "Reassembler", strict)
    async with running_server(sync_config(tmp_path)) as server:
        older_welcome(monkeypatch, server, digest_only=False)
        learner = await genesis_learner(server, "a")
        assert learner.welcome is not None and not learner.welcome.digest_only
        assert not learner.stream.peer_digest_only
        version = server.engine.fragments[1].version
        seq = await learner.contribute(1, torch.full((learner.layout[1].numel,), 0.02), base_version=version)
        assert (await learner.wait_result(seq)).outcome == "merged"
        assert server.engine.fragments[1].version == version + 1
        checked = strict.chunks_checked
        assert checked >= 3  # genesis of both fragments and the contribution, every chunk checked
        await learner.close("done")

        # the control: chunks without their CRC fail the older synchronizer's check
        bare = ScriptedLearner(server.port, "b")
        await bare.connect()
        bare.stream.peer_digest_only = True  # as if the welcome had said so
        bare.start_pump(heartbeat_s=0)
        await bare.contribute(1, torch.full((bare.layout[1].numel,), 0.02), base_version=version + 1)
        await eventually(lambda: bare.closed is not None, what="the strict synchronizer ending the stream")
        assert isinstance(bare.closed, StreamClosed) and bare.closed.code == grpc.StatusCode.DATA_LOSS, bare.closed
        assert server.engine.fragments[1].version == version + 1
        await bare.close()


async def test_a_learner_hashes_its_contributions_as_it_writes_them_for_a_synchronizer_that_reads_a_trailing_digest(
        tmp_path, monkeypatch):
    """New learner, new synchronizer: the welcome says ``trailing_digest``; a contribution's header
    leaves the digest empty and its last chunk carries it; it merges. Genesis, cut before the
    welcome is read, keeps the digest in its header."""
    class Recording(_Recording):
        seen = []
    monkeypatch.setattr(server_module, "Reassembler", Recording)
    async with running_server(sync_config(tmp_path)) as server:
        learner = await genesis_learner(server, "a")
        assert learner.welcome is not None and learner.welcome.trailing_digest and learner.stream.peer_trailing_digest
        version = server.engine.fragments[0].version
        delta = torch.full((learner.layout[0].numel,), 0.01)
        seq = await learner.contribute(0, delta, base_version=version)
        assert (await learner.wait_result(seq)).outcome == "merged"
        contributions = [(h, c) for kind, h, c in Recording.seen if kind == "contribution"]
        assert contributions == [(b"", digest(delta.numpy().tobytes()))]  # fp32: the payload is the values
        assert all(len(h) == 16 and c == b"" for kind, h, c in Recording.seen if kind == "genesis")
        await learner.close("done")


async def test_a_learner_puts_the_digest_in_the_header_for_a_synchronizer_that_reads_no_trailing_digest(
        tmp_path, monkeypatch):
    """New learner, synchronizer before the trailing digest: its welcome leaves ``trailing_digest``
    unset, so the learner's contributions carry the digest in their header, and they merge on a
    receiver that knows no other. Sent a trailing digest anyway, the same synchronizer ends the
    stream (the control)."""
    class Previous(_HeaderDigestOnly):
        transfers = 0
    monkeypatch.setattr(server_module, "Reassembler", Previous)
    async with running_server(sync_config(tmp_path)) as server:
        older_welcome(monkeypatch, server, trailing_digest=False)
        learner = await genesis_learner(server, "a")
        assert learner.welcome is not None and not learner.welcome.trailing_digest
        assert not learner.stream.peer_trailing_digest
        version = server.engine.fragments[1].version
        seq = await learner.contribute(1, torch.full((learner.layout[1].numel,), 0.02), base_version=version)
        assert (await learner.wait_result(seq)).outcome == "merged"
        assert server.engine.fragments[1].version == version + 1 and Previous.transfers >= 3
        await learner.close("done")

        # the control: a trailing digest fails the older synchronizer's check
        bare = ScriptedLearner(server.port, "b")
        await bare.connect()
        bare.start_pump(heartbeat_s=0)
        await bare.contribute(1, torch.full((bare.layout[1].numel,), 0.02), base_version=version + 1,
                              trailing_digest=True)
        await eventually(lambda: bare.closed is not None, what="the older synchronizer ending the stream")
        assert isinstance(bare.closed, StreamClosed), bare.closed
        assert server.engine.fragments[1].version == version + 1
        await bare.close()
