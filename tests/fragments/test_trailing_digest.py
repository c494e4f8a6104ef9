"""A trailing digest: a transfer's header leaves the payload digest empty and its last chunk carries
it, hashed as the chunks are taken to be written (``chunking.sealed``). Round trips, and every way
the digest can be wrong, missing or misplaced failing the transfer (the next one goes through).
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from ddiloco.fragments.chunking import Chunk, Reassembler, digest, sealed, split
from ddiloco.fragments.errors import ChecksumError, HeaderError
from tests.fragments.test_chunking import CHUNK, _assert_recovers, _chunks, _feed_all, _header


def _trailing(payload: bytes, transfer_id: int = 7, chunk: int = CHUNK) -> list[Chunk]:
    return list(sealed(split(_header(), payload, transfer_id=transfer_id, max_chunk_bytes=chunk, trailing=True)))


@pytest.mark.parametrize("size", [0, 10, CHUNK, 3 * CHUNK + 5])
@pytest.mark.parametrize("relay", [False, True])
def test_a_trailing_digest_is_hashed_as_the_chunks_are_taken_and_verified_on_the_last(size: int, relay: bool) -> None:
    payload = os.urandom(size)
    cut = split(_header(), payload, transfer_id=7, max_chunk_bytes=CHUNK, trailing=True)
    assert cut[0].header is not None and cut[0].header.digest == b"" and all(c.digest == b"" for c in cut)
    chunks = list(sealed(cut))
    assert [c.digest for c in chunks] == [b""] * (len(cut) - 1) + [digest(payload)]
    assert [bytes(c.data) for c in chunks] == [bytes(c.data) for c in cut] and chunks[0].header is cut[0].header
    assert list(sealed(cut)) == chunks  # a transfer sent again is sealed again, the same
    transfer = _feed_all(Reassembler(max_chunk_bytes=CHUNK, relay=relay), chunks)
    assert transfer is not None and bytes(transfer.payload) == payload and transfer.header.digest == b""


def test_sealing_chunks_whose_header_has_the_digest_changes_nothing() -> None:
    chunks = _chunks(os.urandom(3 * CHUNK))
    assert [c is s for c, s in zip(chunks, sealed(chunks), strict=True)] == [True] * 3


def _damage_byte(chunks: list[Chunk]) -> list[Chunk]:
    data = bytearray(chunks[1].data)
    data[3] ^= 1
    return [chunks[0], dataclasses.replace(chunks[1], data=bytes(data)), *chunks[2:]]


@pytest.mark.parametrize(("damage", "error"), [
    (_damage_byte, ChecksumError),
    (lambda c: [*c[:-1], dataclasses.replace(c[-1], digest=bytes(16))], ChecksumError),
    (lambda c: [*c[:-1], dataclasses.replace(c[-1], digest=b"")], HeaderError),  # not sealed
    (lambda c: [*c[:-1], dataclasses.replace(c[-1], digest=c[-1].digest[:15])], HeaderError),
    (lambda c: [c[0], dataclasses.replace(c[1], digest=c[-1].digest), *c[2:]], HeaderError),  # not the last
], ids=["a byte", "another digest", "no digest", "15 bytes", "on another chunk"])
def test_a_bad_trailing_digest_fails_the_transfer_and_the_next_one_goes_through(damage, error) -> None:  # type: ignore[no-untyped-def]
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    with pytest.raises(error):
        _feed_all(reassembler, damage(_trailing(os.urandom(3 * CHUNK + 5))))
    assert reassembler.in_progress is None
    _assert_recovers(reassembler)


def test_a_chunk_digest_on_a_transfer_whose_header_has_one_fails() -> None:
    payload = os.urandom(2 * CHUNK)
    chunks = _chunks(payload)
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    with pytest.raises(HeaderError, match="carries a digest"):
        _feed_all(reassembler, [chunks[0], dataclasses.replace(chunks[1], digest=digest(payload))])
    _assert_recovers(reassembler)


def test_sealing_needs_the_first_chunk_with_its_header() -> None:
    chunks = split(_header(), os.urandom(2 * CHUNK), transfer_id=1, max_chunk_bytes=CHUNK, trailing=True)
    with pytest.raises(HeaderError, match="no header"):
        list(sealed([dataclasses.replace(chunks[0], header=None), chunks[1]]))
