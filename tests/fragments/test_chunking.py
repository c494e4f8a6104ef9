"""Chunked transfers and the payload gate: every malformed stream raises its own typed error.

Covers ``ddiloco.fragments.chunking`` (split, strict reassembly, the CRC-32C older peers need, xxh3-128
digest per payload) and ``ddiloco.fragments.payload`` (layout checks, decode, non-finite refusal).
The reassembler must also recover: after any rejected transfer the next good one goes through.
"""

from __future__ import annotations

import dataclasses
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.fragments.chunking import (
    Chunk,
    Reassembler,
    Transfer,
    TransferHeader,
    crc32c,
    split,
)
from ddiloco.fragments.codec import CODEC_NAMES, Int2BlockCodec, make_codec
from ddiloco.fragments.errors import (
    ChecksumError,
    ChunkError,
    CodecError,
    DTypeMismatchError,
    DuplicateChunkError,
    FragmentError,
    HeaderError,
    MissingChunkError,
    NonFiniteError,
    OversizedChunkError,
    ReorderedChunkError,
    ShapeMismatchError,
)
from ddiloco.fragments.partition import TensorSpec, partition
from ddiloco.fragments.payload import check_header, decode_fragment, encode_fragment

CHUNK = 64


def _header(n: int = 16, **kw) -> TransferHeader:  # type: ignore[no-untyped-def]
    return TransferHeader(kind="contribution", fragment_id=0, version=3, codec="fp32",
                          tensors=(TensorSpec("w", (n,)),), num_values=n, **kw)


def _chunks(payload: bytes, transfer_id: int = 7, chunk: int = CHUNK) -> list[Chunk]:
    return split(_header(), payload, transfer_id=transfer_id, max_chunk_bytes=chunk)


def _feed_all(reassembler: Reassembler, chunks: list[Chunk]) -> Transfer | None:
    result = None
    for c in chunks:
        result = reassembler.feed(c)
    return result


def _assert_recovers(reassembler: Reassembler) -> None:
    """After a rejected transfer, the next well-formed one is accepted."""
    payload = os.urandom(3 * CHUNK + 5)
    transfer = _feed_all(reassembler, _chunks(payload, transfer_id=99))
    assert transfer is not None and transfer.payload == payload
    assert reassembler.in_progress is None


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 2000), chunk=st.integers(1, 700))
def test_split_and_reassemble_round_trip(size: int, chunk: int) -> None:
    payload = os.urandom(size)
    chunks = split(_header(), payload, transfer_id=5, max_chunk_bytes=chunk)
    assert len(chunks) == max(1, -(-size // chunk))
    assert all(len(c.data) <= chunk for c in chunks)
    assert chunks[0].header is not None and all(c.header is None for c in chunks[1:])
    header = chunks[0].header
    assert (header.encoded_bytes, header.chunk_count, len(header.digest)) == (size, len(chunks), 16)
    reassembler = Reassembler(max_chunk_bytes=chunk)
    for c in chunks[:-1]:
        assert reassembler.feed(c) is None
        assert reassembler.in_progress == header
    transfer = reassembler.feed(chunks[-1])
    assert transfer is not None and transfer.payload == payload and transfer.header == header
    reassembler.finish()  # nothing pending


def test_several_transfers_on_one_stream() -> None:
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    for tid in range(5):
        payload = os.urandom(tid * 50)
        transfer = _feed_all(reassembler, _chunks(payload, transfer_id=tid))
        assert transfer is not None and transfer.payload == payload


# ---------------------------------------------------------------------------------------------
# Corruption
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_one_corrupted_byte_in_any_chunk_fails_the_payload_digest(codec_name: str) -> None:
    # Enough values for at least three chunks with every codec (int2_block: 0.31 bytes a value).
    values = torch.randn(10000, generator=torch.Generator().manual_seed(0)) * 0.02
    payload = make_codec(codec_name, threads=1).encode(values)
    chunks = _chunks(payload, chunk=997)
    assert len(chunks) >= 3
    gen = torch.Generator().manual_seed(1)
    for index, chunk in enumerate(chunks):
        for pos in {0, len(chunk.data) - 1, int(torch.randint(len(chunk.data), (1,), generator=gen))}:
            data = bytearray(chunk.data)
            data[pos] ^= 1 << int(torch.randint(8, (1,), generator=gen))
            bad = list(chunks)
            bad[index] = dataclasses.replace(chunk, data=bytes(data))
            reassembler = Reassembler(max_chunk_bytes=997)
            with pytest.raises(ChecksumError, match="fails its payload digest") as info:
                _feed_all(reassembler, bad)
            assert info.value.reason == "CHECKSUM"
            assert reassembler.in_progress is None
            _assert_recovers(reassembler)


def test_fp32_payload_corruption_decodes_silently_without_the_crc() -> None:
    """Why transfers carry a digest: a flipped fp32 byte is still a valid fp32 payload."""
    values = torch.randn(100)
    payload = bytearray(make_codec("fp32").encode(values))
    payload[41] ^= 0x10
    decoded = make_codec("fp32").decode(bytes(payload), 100)
    assert not torch.equal(decoded, values)


def test_chunks_leave_their_crc_unset_and_with_crc32c_fills_it_for_older_receivers() -> None:
    payload = os.urandom(3 * CHUNK + 5)
    chunks = _chunks(payload)
    assert [c.crc32c for c in chunks] == [0] * 4
    filled = [c.with_crc32c() for c in chunks]
    assert [c.crc32c for c in filled] == [crc32c(c.data) for c in chunks]
    assert all(c.crc32c for c in filled)  # none of these random chunks has a CRC of 0
    assert [(c.transfer_id, c.index, bytes(c.data), c.header) for c in filled] == [
        (c.transfer_id, c.index, bytes(c.data), c.header) for c in chunks]


def test_a_chunk_crc_is_not_read_the_digest_decides() -> None:
    """A wrong CRC-32C on intact data goes through: the payload digest covers every byte."""
    payload = os.urandom(3 * CHUNK)
    chunks = [c.with_crc32c() for c in _chunks(payload)]
    chunks[1] = dataclasses.replace(chunks[1], crc32c=chunks[1].crc32c ^ 1)
    transfer = _feed_all(Reassembler(max_chunk_bytes=CHUNK), chunks)
    assert transfer is not None and bytes(transfer.payload) == payload


def test_digest_mismatch_is_detected_when_chunk_crcs_are_consistent() -> None:
    payload = os.urandom(5 * CHUNK)
    chunks = _chunks(payload)
    forged = bytes(reversed(chunks[2].data))  # well-formed chunk, wrong content
    chunks[2] = dataclasses.replace(chunks[2], data=forged, crc32c=crc32c(forged))
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    with pytest.raises(ChecksumError, match="digest"):
        _feed_all(reassembler, chunks)
    _assert_recovers(reassembler)


def test_chunk_of_another_transfer_with_matching_crc_fails_the_digest() -> None:
    a, b = os.urandom(3 * CHUNK), os.urandom(3 * CHUNK)
    chunks_a, chunks_b = _chunks(a, transfer_id=1), _chunks(b, transfer_id=1)
    with pytest.raises(ChecksumError):
        _feed_all(Reassembler(max_chunk_bytes=CHUNK), [chunks_a[0], chunks_b[1], chunks_a[2]])


# ---------------------------------------------------------------------------------------------
# Stream structure
# ---------------------------------------------------------------------------------------------


def test_truncated_stream_raises_on_finish() -> None:
    chunks = _chunks(os.urandom(4 * CHUNK))
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    _feed_all(reassembler, chunks[:-1])
    with pytest.raises(MissingChunkError, match="3 of 4"):
        reassembler.finish()
    assert reassembler.in_progress is None
    reassembler.finish()  # the cut transfer was discarded: finishing again is clean
    _assert_recovers(reassembler)


def test_new_transfer_starting_early_raises_missing_chunk() -> None:
    first, second = _chunks(os.urandom(4 * CHUNK), transfer_id=1), _chunks(os.urandom(10), transfer_id=2)
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    _feed_all(reassembler, first[:2])
    with pytest.raises(MissingChunkError, match="new transfer"):
        reassembler.feed(second[0])
    _assert_recovers(reassembler)


@pytest.mark.parametrize("order", [[0, 2, 1, 3], [0, 1, 3], [1, 0, 2, 3]])
def test_reordered_chunks_raise(order: list[int]) -> None:
    chunks = _chunks(os.urandom(4 * CHUNK))
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    with pytest.raises(ReorderedChunkError):
        _feed_all(reassembler, [chunks[i] for i in order])
    _assert_recovers(reassembler)


def test_interleaved_transfer_raises_reordered() -> None:
    a, b = _chunks(os.urandom(3 * CHUNK), transfer_id=1), _chunks(os.urandom(3 * CHUNK), transfer_id=2)
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    with pytest.raises(ReorderedChunkError, match="interleaved"):
        _feed_all(reassembler, [a[0], b[1]])
    _assert_recovers(reassembler)


@pytest.mark.parametrize("order", [[0, 1, 1, 2], [0, 1, 2, 1]])
def test_duplicated_chunk_raises(order: list[int]) -> None:
    chunks = _chunks(os.urandom(4 * CHUNK))
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    with pytest.raises(DuplicateChunkError):
        _feed_all(reassembler, [chunks[i] for i in order])
    _assert_recovers(reassembler)


def test_duplicated_header_chunk_raises_missing() -> None:
    chunks = _chunks(os.urandom(4 * CHUNK))
    with pytest.raises(MissingChunkError):
        _feed_all(Reassembler(max_chunk_bytes=CHUNK), [chunks[0], chunks[0]])


def test_oversized_chunk_raises() -> None:
    chunks = _chunks(os.urandom(3 * CHUNK), chunk=CHUNK)
    reassembler = Reassembler(max_chunk_bytes=CHUNK - 1)
    with pytest.raises(OversizedChunkError) as info:
        reassembler.feed(chunks[0])
    assert info.value.reason == "OVERSIZED"


def test_oversized_payload_declared_in_header_raises() -> None:
    chunks = _chunks(os.urandom(3 * CHUNK))
    with pytest.raises(OversizedChunkError, match="declares"):
        Reassembler(max_chunk_bytes=CHUNK, max_payload_bytes=3 * CHUNK - 1).feed(chunks[0])


def test_more_bytes_than_declared_raises() -> None:
    chunks = _chunks(os.urandom(2 * CHUNK))
    grown = bytes(chunks[1].data) + b"x"
    chunks[1] = dataclasses.replace(chunks[1], data=grown, crc32c=crc32c(grown))
    with pytest.raises(OversizedChunkError, match="more than"):
        _feed_all(Reassembler(max_chunk_bytes=2 * CHUNK), chunks)


def test_fewer_bytes_than_declared_raises_missing() -> None:
    chunks = _chunks(os.urandom(2 * CHUNK))
    short = chunks[1].data[:-1]
    chunks[1] = dataclasses.replace(chunks[1], data=short, crc32c=crc32c(short))
    with pytest.raises(MissingChunkError):
        _feed_all(Reassembler(max_chunk_bytes=CHUNK), chunks)


def test_missing_header_raises() -> None:
    chunks = _chunks(os.urandom(2 * CHUNK))
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    with pytest.raises(HeaderError, match="no header"):
        reassembler.feed(dataclasses.replace(chunks[0], header=None))
    with pytest.raises(ReorderedChunkError, match="without its header"):
        reassembler.feed(chunks[1])
    _assert_recovers(reassembler)


def test_repeated_header_raises() -> None:
    chunks = _chunks(os.urandom(2 * CHUNK))
    with pytest.raises(HeaderError, match="repeats"):
        _feed_all(Reassembler(max_chunk_bytes=CHUNK), [chunks[0], dataclasses.replace(chunks[1], header=_header())])


@pytest.mark.parametrize("change", [{"chunk_count": 0}, {"chunk_count": 129}, {"chunk_count": 1},
                                    {"digest": b"x" * 15}, {"digest": b"x" * 17}])
def test_inconsistent_header_raises(change: dict) -> None:
    chunks = _chunks(os.urandom(2 * CHUNK))  # 2 chunks for 128 bytes
    header = dataclasses.replace(chunks[0].header, **change)
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    with pytest.raises(HeaderError):
        reassembler.feed(dataclasses.replace(chunks[0], header=header))
    _assert_recovers(reassembler)


def test_unknown_payload_kind_raises() -> None:
    with pytest.raises(HeaderError):
        TransferHeader(kind="gossip", fragment_id=0, version=0, codec="fp32", tensors=(), num_values=0)


def test_chunk_errors_are_typed() -> None:
    for cls in (MissingChunkError, DuplicateChunkError, ReorderedChunkError, HeaderError):
        assert issubclass(cls, ChunkError) and cls.reason == "PROTOCOL"
    assert issubclass(ChunkError, FragmentError)


def test_split_rejects_bad_chunk_size() -> None:
    with pytest.raises(ValueError):
        split(_header(), b"abc", transfer_id=1, max_chunk_bytes=0)


# ---------------------------------------------------------------------------------------------
# Payload gate: encode_fragment -> Reassembler -> decode_fragment
# ---------------------------------------------------------------------------------------------

SPECS = [TensorSpec("embed.weight", (50, 16)), TensorSpec("block.w", (16, 16)), TensorSpec("block.b", (16,)),
         TensorSpec("norm.scale", (16,), "bfloat16"), TensorSpec("head.weight", (16, 33))]
LAYOUT = partition(SPECS, 2)


def _transfer(values: torch.Tensor, fragment_id: int = 0, codec_name: str = "bf16_zstd",
              max_chunk_bytes: int = 256) -> Transfer:
    chunks = encode_fragment(values, LAYOUT[fragment_id], codec=make_codec(codec_name, threads=1),
                             kind="contribution", version=4, transfer_id=11, layout_hash=LAYOUT.fingerprint,
                             sequence=2, tokens=1000, steps=5, max_chunk_bytes=max_chunk_bytes)
    transfer = _feed_all(Reassembler(max_chunk_bytes=max_chunk_bytes), chunks)
    assert transfer is not None
    return transfer


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("fragment_id", [0, 1])
def test_fragment_round_trip(codec_name: str, fragment_id: int) -> None:
    fragment = LAYOUT[fragment_id]
    values = torch.randn(fragment.numel, generator=torch.Generator().manual_seed(fragment_id)) * 0.02
    transfer = _transfer(values, fragment_id, codec_name)
    header = transfer.header
    assert (header.fragment_id, header.version, header.codec, header.tensors, header.num_values) == (
        fragment_id, 4, codec_name, fragment.tensors, fragment.numel)
    assert (header.sequence, header.tokens, header.steps, header.layout_hash) == (2, 1000, 5, LAYOUT.fingerprint)
    assert header.chunk_count > 1  # payload larger than one chunk
    decoded = decode_fragment(transfer, LAYOUT, zstd_threads=1)
    if codec_name == "fp32":
        assert torch.equal(decoded, values)
    elif codec_name == "bf16_zstd":
        assert torch.equal(decoded, values.to(torch.bfloat16).float())
    elif codec_name == "int4_block":
        assert (decoded - values).abs().max() <= values.abs().max() / 7 / 2 * (1 + 1e-5)
    elif codec_name == "int2_block":
        # Half a step within +-1.5104 sigma of the block; beyond, clipped to the outer level.
        codec = Int2BlockCodec()
        clipped = values.abs() - 1.5104 * codec.sigma(values)
        bound = torch.maximum(codec.quantization_step(values) / 2, clipped) * (1 + 1e-5)
        assert bool(((decoded - values).abs() <= bound).all())
    else:
        assert (decoded - values).abs().max() <= values.abs().max() / 127
    assert check_header(header, LAYOUT) is fragment


def test_encode_fragment_rejects_wrong_buffer_size() -> None:
    with pytest.raises(ShapeMismatchError):
        encode_fragment(torch.zeros(LAYOUT[0].numel + 1), LAYOUT[0], codec=make_codec("fp32"),
                        kind="contribution", version=0, transfer_id=1)


def _with_header(transfer: Transfer, **change) -> Transfer:  # type: ignore[no-untyped-def]
    return Transfer(dataclasses.replace(transfer.header, **change), transfer.payload)


def test_decode_rejects_unknown_fragment_id() -> None:
    transfer = _transfer(torch.zeros(LAYOUT[0].numel))
    for bad_id in (2, 1000):
        with pytest.raises(FragmentError) as info:
            decode_fragment(_with_header(transfer, fragment_id=bad_id), LAYOUT)
        assert info.value.reason == "UNKNOWN_FRAGMENT"


def test_decode_rejects_a_fragment_id_that_names_other_tensors() -> None:
    transfer = _transfer(torch.zeros(LAYOUT[0].numel), fragment_id=0)
    with pytest.raises(ShapeMismatchError):
        decode_fragment(_with_header(transfer, fragment_id=1), LAYOUT)


def test_decode_rejects_wrong_shape() -> None:
    transfer = _transfer(torch.zeros(LAYOUT[0].numel))
    tensors = list(transfer.header.tensors)
    t = tensors[0]
    reshaped = (t.shape[0] * 2, t.shape[1] // 2) if len(t.shape) == 2 and t.shape[1] % 2 == 0 else (t.numel,)
    cases = [
        {"tensors": (dataclasses.replace(t, shape=reshaped), *tensors[1:])},  # same count, other shape
        {"tensors": (dataclasses.replace(t, name="x"), *tensors[1:])},
        {"tensors": tuple(tensors[:-1])},
        {"num_values": transfer.header.num_values + 1},
    ]
    for change in cases:
        with pytest.raises(ShapeMismatchError) as info:
            decode_fragment(_with_header(transfer, **change), LAYOUT)
        assert info.value.reason == "BAD_SHAPE"


def test_decode_rejects_wrong_dtype() -> None:
    transfer = _transfer(torch.zeros(LAYOUT[0].numel))
    tensors = list(transfer.header.tensors)
    wrong = "float16" if tensors[0].dtype != "float16" else "float32"
    with pytest.raises(DTypeMismatchError) as info:
        decode_fragment(_with_header(transfer, tensors=(dataclasses.replace(tensors[0], dtype=wrong),
                                                        *tensors[1:])), LAYOUT)
    assert info.value.reason == "BAD_DTYPE"


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_decode_rejects_non_finite(codec_name: str, bad: float) -> None:
    values = torch.randn(LAYOUT[0].numel)
    values[17] = bad
    with pytest.raises(NonFiniteError) as info:
        decode_fragment(_transfer(values, codec_name=codec_name), LAYOUT)
    assert info.value.reason == "NON_FINITE"


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_decode_rejects_payload_above_the_codec_bound(codec_name: str) -> None:
    transfer = _transfer(torch.zeros(LAYOUT[0].numel), codec_name=codec_name)
    bound = make_codec(codec_name).max_encoded_bytes(LAYOUT[0].numel)
    big = Transfer(transfer.header, bytes(transfer.payload) + bytes(bound + 1 - len(transfer.payload)))
    with pytest.raises(OversizedChunkError):
        decode_fragment(big, LAYOUT)


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_decode_rejects_undecodable_payload(codec_name: str) -> None:
    transfer = _transfer(torch.zeros(LAYOUT[0].numel), codec_name=codec_name)
    with pytest.raises(CodecError) as info:
        decode_fragment(Transfer(transfer.header, transfer.payload[:-3]), LAYOUT)
    assert info.value.reason == "UNSUPPORTED_CODEC"


def test_decode_rejects_codec_mismatch() -> None:
    transfer = _transfer(torch.zeros(LAYOUT[0].numel), codec_name="bf16_zstd")
    with pytest.raises(CodecError):
        decode_fragment(_with_header(transfer, codec="fp32"), LAYOUT)
    with pytest.raises(CodecError):
        decode_fragment(_with_header(transfer, codec="lz4"), LAYOUT)


def test_decode_rejects_invalid_int8_block_size_in_header() -> None:
    transfer = _transfer(torch.zeros(LAYOUT[0].numel), codec_name="int8_block")
    with pytest.raises(CodecError):
        decode_fragment(_with_header(transfer, block_size=5), LAYOUT)


def test_a_reassembled_fp32_transfer_is_decoded_without_a_copy_and_a_lent_payload_is_copied() -> None:
    values = torch.randn(LAYOUT[0].numel)
    transfer = _transfer(values, codec_name="fp32")
    assert transfer.owned, "reassembly hands over a buffer of its own"
    assert hash(transfer) == hash(Transfer(transfer.header, bytes(transfer.payload), transfer.received_at))
    decoded = decode_fragment(transfer, LAYOUT)
    assert torch.equal(decoded, values)
    decoded[0] = 123.0  # the tensor took the transfer's buffer over
    assert struct.unpack_from("<f", transfer.payload)[0] == 123.0
    for lent in (bytes(transfer.payload), memoryview(bytearray(transfer.payload))):
        frozen = Transfer(transfer.header, lent)
        assert not frozen.owned
        copied = decode_fragment(frozen, LAYOUT)
        copied[0] = 7.0  # bytes or a view it was lent are never written through
        assert struct.unpack_from("<f", frozen.payload)[0] == 123.0
    # the same payload under another header is still the transfer's own: taken over, not copied
    moved = transfer.under(dataclasses.replace(transfer.header, version=9))
    assert moved.owned and moved.header.version == 9
    decode_fragment(moved, LAYOUT)[0] = 5.0
    assert struct.unpack_from("<f", transfer.payload)[0] == 5.0


def test_a_reassembled_transfer_copies_each_chunk_as_it_arrives_and_keeps_none() -> None:
    payload = os.urandom(4 * CHUNK + 3)
    sources = [bytearray(c.data) for c in _chunks(payload)]
    reassembler = Reassembler(max_chunk_bytes=CHUNK)
    transfer = None
    for chunk, source in zip(_chunks(payload), sources, strict=True):
        transfer = reassembler.feed(dataclasses.replace(chunk, data=memoryview(source), frame=None))
        source[:] = b"\0" * len(source)  # the chunk's message is gone once read: its bytes were copied
    assert transfer is not None and transfer.owned
    assert transfer.size == len(payload) and transfer.payload == payload
    assert transfer == Transfer(transfer.header, payload, transfer.received_at)
    assert transfer != Transfer(transfer.header, payload[:-1] + bytes([payload[-1] ^ 1]), transfer.received_at)


def test_a_transfer_of_parts_joins_them_once_and_only_when_its_payload_is_read() -> None:
    payload = os.urandom(4 * CHUNK + 3)
    transfer = Transfer(_header(), [payload[:CHUNK], memoryview(payload)[CHUNK:]])
    assert transfer.size == len(payload) and transfer.owned
    assert isinstance(transfer._body, tuple), "not joined before it is read"
    joined = transfer.payload
    assert isinstance(joined, bytearray) and joined == payload
    assert transfer.payload is joined


def test_a_header_that_declares_much_and_sends_little_takes_little_memory() -> None:
    """The payload buffer is allocated at the declared size when a transfer starts, but memory is
    only taken as chunks are copied in: a sender that declares 512 MiB and sends one chunk costs
    about a chunk (the synchronizer also bounds what a transfer may declare)."""
    def resident_mib() -> float:  # now, not the high-water mark
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)

    declared = 512 << 20
    chunk_bytes = 1 << 20
    header = dataclasses.replace(_header(), encoded_bytes=declared, chunk_count=declared // chunk_bytes,
                                 digest=bytes(16))
    reassembler = Reassembler(max_chunk_bytes=chunk_bytes, max_payload_bytes=1 << 34)
    before = resident_mib()
    assert reassembler.feed(Chunk(3, 0, os.urandom(chunk_bytes), 0, header)) is None
    assert reassembler.in_progress is not None
    grown_mib = resident_mib() - before
    assert grown_mib < 64, f"a 512 MiB declaration took {grown_mib:.0f} MiB"
    with pytest.raises(MissingChunkError):
        reassembler.finish()


def test_receiving_a_transfer_holds_its_payload_once_not_its_chunks_and_a_join() -> None:
    """Each chunk is copied into the payload as it arrives and its message can go at once: a
    transfer received and read whole peaks at its payload plus a chunk (traced allocations), where
    keeping the chunks and joining them at the end held twice the payload."""
    import tracemalloc

    size, chunk_bytes = 16 << 20, 1 << 20
    source = os.urandom(size)
    chunks = split(_header(), source, transfer_id=5, max_chunk_bytes=chunk_bytes)
    header = chunks[0].header
    reassembler = Reassembler(max_chunk_bytes=chunk_bytes)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        transfer = None
        for c in chunks:  # each chunk in a message of its own, gone once read (as gRPC hands them over)
            message = bytes(c.data)
            transfer = reassembler.feed(Chunk(c.transfer_id, c.index, message, 0, header if c.index == 0 else None))
            del message
        assert transfer is not None
        assert len(transfer.payload) == size
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert bytes(transfer.payload) == source
    assert peak < size + 4 * chunk_bytes, f"receiving {size >> 20} MiB peaked at {peak / (1 << 20):.1f} MiB"


def test_a_relay_verifies_each_transfer_and_keeps_its_chunks_as_they_came() -> None:
    """``relay=True``: order, sizes and the digest are checked as for any receiver, but the chunks
    are kept as views of their messages (a relay forwards those), not copied into a payload; the
    payload is joined only if read."""
    payload = os.urandom(4 * CHUNK + 3)
    sources = [bytearray(c.data) for c in _chunks(payload)]
    relay = Reassembler(max_chunk_bytes=CHUNK, relay=True)
    transfer = None
    for chunk, source in zip(_chunks(payload), sources, strict=True):
        transfer = relay.feed(dataclasses.replace(chunk, data=memoryview(source), frame=None))
    assert transfer is not None and isinstance(transfer._body, tuple), "kept, not copied"
    sources[0][0] ^= 0xFF  # a view of the message: what it holds is what the transfer holds
    assert transfer.payload[0] == sources[0][0] and transfer.size == len(payload)
    bad = _chunks(payload)
    bad[2] = dataclasses.replace(bad[2], data=b"x" * len(bad[2].data), frame=None)
    with pytest.raises(ChecksumError):
        _feed_all(Reassembler(max_chunk_bytes=CHUNK, relay=True), bad)
    with pytest.raises(ReorderedChunkError):
        _feed_all(Reassembler(max_chunk_bytes=CHUNK, relay=True), [_chunks(payload)[i] for i in (0, 2, 1, 3, 4)])


def test_a_transfer_larger_than_the_machine_can_map_is_refused_as_oversized_and_nothing_is_kept() -> None:
    """A declaration within ``max_payload_bytes`` but beyond what can be allocated (here 2^60 bytes,
    beyond any address space) is refused as oversized when it starts; the reassembler is left
    with no transfer in progress and takes the next one."""
    declared, chunk_bytes = 1 << 60, 1 << 20
    header = dataclasses.replace(_header(), encoded_bytes=declared, chunk_count=declared // chunk_bytes,
                                 digest=bytes(16))
    reassembler = Reassembler(max_chunk_bytes=chunk_bytes, max_payload_bytes=1 << 61)
    with pytest.raises(OversizedChunkError, match="cannot be allocated"):
        reassembler.feed(Chunk(3, 0, os.urandom(16), 0, header))
    assert reassembler.in_progress is None
    payload = os.urandom(3 * CHUNK)
    transfer = _feed_all(reassembler, split(_header(), payload, transfer_id=4, max_chunk_bytes=chunk_bytes))
    assert transfer is not None and transfer.payload == payload


def test_chunks_that_are_views_of_any_format_are_counted_and_copied_as_bytes() -> None:
    values = torch.arange(40, dtype=torch.float32)
    payload = values.numpy().tobytes()
    chunks = split(_header(), payload, transfer_id=6, max_chunk_bytes=CHUNK)
    floats = [dataclasses.replace(c, data=memoryview(bytearray(c.data)).cast("f"), frame=None) for c in chunks]
    transfer = _feed_all(Reassembler(max_chunk_bytes=CHUNK), floats)
    assert transfer is not None and transfer.payload == payload
