"""The fuzz input format of ``fuzz_decode.py``, its target logic, and seed builders.

Kept apart from the atheris entry point so that ``make_corpus.py`` (and anyone reading a crash
file) can build and explain inputs without atheris. An input is interpreted in one of two modes,
chosen by its first byte:

``mode 0, "frames"`` (first byte even): a transfer built from the input and cut into chunks::

    [0]      mode
    [1]      codec: the byte mod 6 -> fp32, bf16_zstd, int8_block, an unknown name, int4_block,
             int2_block
    [2]      header faults: bits 0-1 fragment id (0, 1, 2 = unknown, 2**32-1); bit 2 one value too
             many; bit 3 first tensor flattened; bit 4 first tensor bfloat16; bit 5 last tensor
             dropped; bit 6 kind "global"; bit 7 first tensor renamed
    [3]      chunk fault: low 3 bits the operation (none, swap, duplicate, drop, bad CRC (not read),
             header moved, other transfer id, bit flip with CRC fixed), high 5 bits the chunk
    [4:6]    chunk size, u16 little-endian (0: one chunk)
    [6:10]   the header's block_size, u32 little-endian
    [10]     declared-field faults: bit 0 digest flipped, bit 1 one byte more declared, bit 2 one
             byte fewer, bit 3 one chunk more, bit 4 one chunk fewer, bit 5 the last chunk never
             sent (the stream ends), bit 6 a short digest, bit 7 a huge declared size
    [11:]    the encoded payload

``mode 1, "wire"`` (first byte odd): ``[u16 LE length][serialized ddiloco.v1.FragmentChunk]``
records, parsed as the synchronizer's gRPC layer would hand them to ``wire.chunk_from_pb``
(a record protobuf cannot parse ends the stream: gRPC refuses such a message itself).

Either way the chunks go through a ``Reassembler`` with the synchronizer's limits and every
completed transfer through ``decode_fragment`` against a fixed two-fragment layout. The only
acceptable outcomes are a decoded tensor or a ``FragmentError`` (``ChunkError``, ``CodecError``,
...); anything else escapes ``run_one`` and is a crash. A decoded tensor must also be what the
gate promises: flat fp32, the fragment's value count, finite; an fp32 payload decodes to its
own bytes; a bf16_zstd payload to bf16-exact values that re-encode to the same values.
"""

from __future__ import annotations

import dataclasses
import struct

import torch
from google.protobuf.message import DecodeError

from ddiloco.fragments.chunking import Chunk, Reassembler, TransferHeader, crc32c, split
from ddiloco.fragments.codec import make_codec
from ddiloco.fragments.errors import FragmentError
from ddiloco.fragments.partition import TensorSpec, partition
from ddiloco.fragments.payload import decode_fragment
from ddiloco.protocol import wire
from ddiloco.protocol.wire.convert import pb

LAYOUT = partition([
    TensorSpec("tok_emb.weight", (16, 8)),
    TensorSpec("blocks.0.attn.weight", (8, 8)),
    TensorSpec("blocks.0.mlp.bias", (15,)),  # an odd value count: bf16 codes end in a padding nibble
    TensorSpec("head.weight", (8, 12)),
], 2)
CODECS = ("fp32", "bf16_zstd", "int8_block", "zstd9", "int4_block", "int2_block")
MAX_CHUNK_BYTES = 1024
"""The reassembler's chunk limit: below libFuzzer's 4 KiB inputs, so oversized chunks are reachable."""
MAX_PAYLOAD_BYTES = 1 << 20
MAX_CHUNKS = 256
MAX_RECORDS = 64
FRAMES, WIRE = 0, 1
HEAD = struct.Struct("<BBBBHIB")  # mode, codec, header faults, chunk fault, chunk size, block size, declared faults


@dataclasses.dataclass
class Outcome:
    """What one input did (for tests of the target and for reading crash files)."""

    transfers: int = 0
    decoded: int = 0
    refused: list[str] = dataclasses.field(default_factory=list)


def run_one(data: bytes) -> Outcome:
    """Interpret ``data``; raise only if the code under test misbehaves."""
    out = Outcome()
    if not data:
        return out
    try:
        if data[0] % 2 == FRAMES:
            _frames(data, out)
        else:
            _wire(data, out)
    except FragmentError as exc:
        out.refused.append(type(exc).__name__)
    return out


# -- mode 0 -------------------------------------------------------------------------------------


def _header_faults(header: TransferHeader, flags: int) -> TransferHeader:
    tensors = list(header.tensors)
    fields: dict = {"fragment_id": (0, 1, 2, (1 << 32) - 1)[flags & 3] if flags & 3 else header.fragment_id}
    if flags & 4:
        fields["num_values"] = header.num_values + 1
    if flags & 8:
        tensors[0] = TensorSpec(tensors[0].name, (tensors[0].numel,), tensors[0].dtype)
    if flags & 16:
        tensors[0] = dataclasses.replace(tensors[0], dtype="bfloat16")
    if flags & 32:
        tensors.pop()
    if flags & 64:
        fields["kind"] = "global"
    if flags & 128:
        tensors[0] = dataclasses.replace(tensors[0], name=tensors[0].name + "_")
    return dataclasses.replace(header, tensors=tuple(tensors), **fields)


def _chunk_fault(chunks: list[Chunk], op: int, target: int) -> list[Chunk]:
    t = target % len(chunks)
    c = chunks[t]
    if op == 1 and t + 1 < len(chunks):
        chunks[t], chunks[t + 1] = chunks[t + 1], chunks[t]
    elif op == 2:
        chunks.insert(t, c)
    elif op == 3:
        del chunks[t]
    elif op == 4:
        chunks[t] = dataclasses.replace(c, crc32c=c.crc32c ^ 1)
    elif op == 5:
        chunks[t] = dataclasses.replace(c, header=None if t == 0 else chunks[0].header)
    elif op == 6:
        chunks[t] = dataclasses.replace(c, transfer_id=c.transfer_id + 1)
    elif op == 7 and len(c.data):
        raw = bytearray(bytes(c.data))
        raw[target % len(raw)] ^= 1 << (target % 8)
        chunks[t] = dataclasses.replace(c, data=bytes(raw), crc32c=crc32c(bytes(raw)))
    return chunks


def _declared_faults(header: TransferHeader, flags: int) -> TransferHeader:
    fields: dict = {}
    if flags & 1:
        fields["digest"] = bytes([header.digest[0] ^ 1]) + header.digest[1:]
    if flags & 2:
        fields["encoded_bytes"] = header.encoded_bytes + 1
    if flags & 4:
        fields["encoded_bytes"] = max(0, header.encoded_bytes - 1)
    if flags & 8:
        fields["chunk_count"] = header.chunk_count + 1
    if flags & 16:
        fields["chunk_count"] = max(0, header.chunk_count - 1)
    if flags & 64:
        fields["digest"] = header.digest[:8]
    if flags & 128:
        fields["encoded_bytes"] = 1 << 40
    return dataclasses.replace(header, **fields) if fields else header


def _frames(data: bytes, out: Outcome) -> None:
    head = data[:HEAD.size].ljust(HEAD.size, b"\x00")
    _, codec_sel, header_flags, chunk_op, chunk_size, block_size, declared = HEAD.unpack(head)
    payload = data[HEAD.size:]
    fragment = LAYOUT[(header_flags & 3) % 2]
    header = TransferHeader(kind="contribution", fragment_id=fragment.index, version=1, codec=CODECS[codec_sel % len(CODECS)],
                            tensors=fragment.tensors, num_values=fragment.numel, sequence=1, tokens=1, steps=1,
                            block_size=block_size, layout_hash="layout-fuzz")
    header = _header_faults(header, header_flags)
    size = max(chunk_size or len(payload) or 1, -(-len(payload) // MAX_CHUNKS), 1)
    chunks = split(header, payload, transfer_id=7, max_chunk_bytes=size)
    chunks[0] = dataclasses.replace(chunks[0], header=_declared_faults(chunks[0].header, declared))
    chunks = _chunk_fault(chunks, chunk_op & 7, chunk_op >> 3)
    if declared & 32 and len(chunks) > 1:
        chunks.pop()
    _reassemble(chunks, out)


# -- mode 1 -------------------------------------------------------------------------------------


def _wire(data: bytes, out: Outcome) -> None:
    chunks: list[Chunk] = []
    pos = 1
    while pos + 2 <= len(data) and len(chunks) < MAX_RECORDS:
        (size,) = struct.unpack_from("<H", data, pos)
        record = data[pos + 2:pos + 2 + size]
        pos += 2 + size
        try:
            msg = pb.FragmentChunk.FromString(record)
        except DecodeError:
            break
        chunks.append(wire.chunk_from_pb(msg))
    _reassemble(chunks, out)


# -- both ---------------------------------------------------------------------------------------


def _reassemble(chunks: list[Chunk], out: Outcome) -> None:
    reassembler = Reassembler(max_chunk_bytes=MAX_CHUNK_BYTES, max_payload_bytes=MAX_PAYLOAD_BYTES)
    for chunk in chunks:
        transfer = reassembler.feed(chunk)
        if transfer is None:
            continue
        out.transfers += 1
        sent = bytes(transfer.payload)  # decoding fp32 takes the payload's memory over
        try:
            values = decode_fragment(transfer, LAYOUT, zstd_threads=1)
        except FragmentError as exc:
            out.refused.append(type(exc).__name__)
            continue
        _check_decoded(transfer.header, sent, values)
        out.decoded += 1
    reassembler.finish()


def _check_decoded(header: TransferHeader, payload: bytes, values: torch.Tensor) -> None:
    fragment = LAYOUT[header.fragment_id]
    assert values.dtype == torch.float32 and values.dim() == 1, (values.dtype, values.shape)
    assert values.numel() == fragment.numel, (values.numel(), fragment.numel)
    assert bool(torch.isfinite(values).all()), "decode_fragment let a non-finite value through"
    if header.codec == "fp32":
        assert values.numpy().tobytes() == payload, "fp32 is lossless: the payload's own bytes come back"
    elif header.codec == "bf16_zstd":
        bits = values.view(torch.int32)
        assert not bool((bits & 0xFFFF).any()), "bf16_zstd decoded values that are not bf16"
        codec = make_codec("bf16_zstd", threads=1)
        again = codec.decode(codec.encode(values), fragment.numel)
        assert torch.equal(again.view(torch.int32), bits), "bf16 values changed on re-encoding"


# -- seeds --------------------------------------------------------------------------------------


def frames_input(payload: bytes, *, codec: str, fragment: int = 0, header_flags: int = 0, chunk_op: int = 0,
                 chunk_target: int = 0, chunk_size: int = 64, block_size: int = 0, declared: int = 0) -> bytes:
    """A mode-0 input (see the module doc)."""
    assert fragment in (0, 1) and not header_flags & 3
    flags = header_flags | fragment  # fragment 1 is selector 1; selector 0 is fragment 0
    return HEAD.pack(FRAMES, CODECS.index(codec), flags, (chunk_target << 3) | chunk_op, chunk_size, block_size,
                     declared) + payload


def wire_input(chunks: list[Chunk]) -> bytes:
    """A mode-1 input: the chunks as serialized FragmentChunk records."""
    records = [wire.chunk_to_pb(c).SerializeToString() for c in chunks]
    return bytes([WIRE]) + b"".join(struct.pack("<H", len(r)) + r for r in records)
