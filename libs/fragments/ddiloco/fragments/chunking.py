"""Chunked transfers: an encoded payload cut into bounded chunks, and strict reassembly.

gRPC refuses messages above its configured maximum (4 MiB by default), and one huge message
holds the whole payload in memory twice on each side, so every payload travels as chunks of at
most ``max_chunk_bytes``. The first chunk carries the transfer header, including an xxh3-128
digest of the whole payload: the one integrity check of a transfer, computed once when it is cut
and once, chunk by chunk as they arrive, when it is reassembled. A receiver copies each chunk into
the transfer's payload buffer as it arrives, so a complete transfer is whole at once (no join after
the last chunk) and each chunk's message can be freed as soon as it is read. Chunks may also carry a CRC-32C
of their bytes, for receivers of older versions that check every chunk: ``split`` leaves it unset
(0) and ``Chunk.with_crc32c`` fills it in for a peer that did not say it checks by digest alone
(``digest_only`` on the wire). This version's ``Reassembler`` does not read it.

The digest may also trail: a header may leave it empty and the transfer's last chunk carry it
(``split(..., trailing=True)``, then ``sealed`` as the chunks are written). The sender then hashes
each chunk as it writes it, while the chunk is still in its caches, and the first chunk leaves
before the whole payload was read. Only a receiver that said it reads a trailing digest gets one
(``trailing_digest`` on the wire); this version's ``Reassembler`` reads either form.

Reassembly is strict and typed: a missing, duplicated, reordered, oversized or corrupt chunk
raises the matching ``ChunkError`` subclass and the partial transfer is discarded; the caller
decides whether the stream survives. Nothing half-received is ever handed on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import crc32c as _crc32c
import numpy as np
import xxhash

from ddiloco.fragments.errors import (
    ChecksumError,
    DuplicateChunkError,
    HeaderError,
    MissingChunkError,
    OversizedChunkError,
    ReorderedChunkError,
)
from ddiloco.fragments.partition import TensorSpec

DEFAULT_MAX_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024
"""Default chunk size: just under gRPC's default 4 MiB message limit, leaving room for framing."""

PAYLOAD_KINDS = ("contribution", "genesis", "global")


def crc32c(data: bytes | bytearray | memoryview) -> int:
    return _crc32c.crc32c(data)


def digest(data: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


@dataclass(frozen=True, kw_only=True)
class TransferHeader:
    """Describes one transfer (mirrors ``ddiloco.v1.FragmentHeader``)."""

    kind: str
    fragment_id: int
    version: int
    codec: str
    tensors: tuple[TensorSpec, ...]
    num_values: int
    sequence: int = 0
    tokens: int = 0
    steps: int = 0
    block_size: int = 0
    encoded_bytes: int = 0
    chunk_count: int = 0
    digest: bytes = b""
    layout_hash: str = ""
    learner_step: int = 0
    sent_at_unix: float = 0.0
    round: int = 0
    """The request a contribution answers (0: unsolicited)."""
    hand_over: bool = False
    """A contribution that is its learner's last for the fragment (it finishes or drains)."""

    def __post_init__(self) -> None:
        if self.kind not in PAYLOAD_KINDS:
            raise HeaderError(f"unknown payload kind {self.kind!r}")


@dataclass(frozen=True, eq=False)
class Frame:
    """A chunk already written as a message of the wire, by the wire layer
    (``ddiloco.protocol.wire.frame_chunks``): the chunk's data is a view into ``message``, so the
    bytes are copied once, when framed, and not again when sent. Valid only for the chunk it was
    built from (``Chunk.framed``): a chunk changed with ``dataclasses.replace`` is serialized anew."""

    message: bytes
    of: tuple[int, int, int, TransferHeader | None, bytes | memoryview, bytes]
    """The chunk's transfer id, index, CRC-32C, header, data object and digest when it was framed."""


@dataclass(frozen=True)
class Chunk:
    transfer_id: int
    index: int
    data: bytes | memoryview
    crc32c: int
    """CRC-32C of ``data``, or 0 when unset (see the module's docstring)."""
    header: TransferHeader | None = None
    frame: Frame | None = field(default=None, compare=False, repr=False)
    """The chunk as a wire message, when it was framed when encoded."""
    digest: bytes = b""
    """The transfer's payload digest, on the last chunk of a transfer whose header leaves it empty
    (a trailing digest, see the module's docstring); empty otherwise."""

    def with_crc32c(self) -> Chunk:
        """This chunk with its CRC-32C filled in, for a receiver that checks every chunk."""
        return replace(self, crc32c=crc32c(self.data), frame=None)

    def framed(self) -> bytes | None:
        """The wire message framed for exactly this chunk, if there is one."""
        frame = self.frame
        if frame is None:
            return None
        transfer_id, index, crc, header, data, digest = frame.of
        if (transfer_id, index, crc, digest) != (self.transfer_id, self.index, self.crc32c, self.digest) or (
                header is not self.header or data is not self.data):
            return None
        return frame.message


class Transfer:
    """A complete, verified transfer.

    A reassembled transfer's payload is one buffer of its own, filled chunk by chunk as they
    arrived (``Reassembler``). A transfer built from separate parts joins them on first use, into a
    bytearray of its own. Either way ``owned`` is true, and ``Fp32Codec.take`` decodes the payload
    without copying it: once decoded, the payload is the decoded tensor's memory and is not to be
    read again (an in-place change to the tensor changes it). A transfer refused on its header
    alone, or relayed without decoding, is never decoded."""

    __slots__ = ("_body", "header", "received_at")

    def __init__(self, header: TransferHeader,
                 payload: bytes | bytearray | memoryview | np.ndarray | Sequence[bytes | memoryview],
                 received_at: float | None = None) -> None:
        """``payload``: the bytes, a buffer of the transfer's own (a bytearray, or a uint8 array),
        or the parts to join."""
        self.header = header
        self._body: bytes | bytearray | memoryview | np.ndarray | tuple[bytes | memoryview, ...] = (
            payload if isinstance(payload, bytes | bytearray | memoryview | np.ndarray) else tuple(payload))
        self.received_at = time.monotonic() if received_at is None else received_at

    @property
    def payload(self) -> bytes | bytearray | memoryview:
        body = self._body
        if isinstance(body, tuple):
            body = self._body = bytearray().join(body)
        return body.data if isinstance(body, np.ndarray) else body

    @property
    def owned(self) -> bool:
        """Whether the payload is memory of this transfer's own, which a decoder may take over
        (reassembled, joined, or given as a bytearray), rather than bytes it was lent."""
        return isinstance(self._body, bytearray | np.ndarray | tuple)

    def under(self, header: TransferHeader) -> Transfer:
        """The same payload (not copied, owned as this one's is) under another header."""
        return Transfer(header, self._body, self.received_at)

    @property
    def size(self) -> int:
        """The payload's length in bytes (without joining it)."""
        body = self._body
        if isinstance(body, tuple):
            return sum(len(p) for p in body)
        return body.nbytes if isinstance(body, memoryview) else len(body)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Transfer):
            return NotImplemented
        return (self.header, self.received_at, bytes(self.payload)) == (
            other.header, other.received_at, bytes(other.payload))

    def __hash__(self) -> int:
        return hash((self.header, self.received_at))

    def __repr__(self) -> str:
        return f"Transfer(header={self.header!r}, size={self.size}, received_at={self.received_at!r})"


def split(header: TransferHeader, payload: bytes | memoryview, *, transfer_id: int,
          max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, trailing: bool = False) -> list[Chunk]:
    """Cut ``payload`` into chunks; fills the header's size, count and digest fields. The chunks'
    CRC-32C is left unset (``Chunk.with_crc32c`` adds it where a peer needs it). ``trailing``: the
    header's digest is left empty and nothing is hashed here; ``sealed`` hashes the chunks as they
    are written and puts the digest on the last one."""
    if max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
    view = memoryview(payload)
    n = len(view)
    count = max(1, -(-n // max_chunk_bytes))
    full = replace(header, encoded_bytes=n, chunk_count=count, digest=b"" if trailing else digest(view),
                   sent_at_unix=header.sent_at_unix or time.time())
    chunks = []
    for i in range(count):
        part = view[i * max_chunk_bytes:(i + 1) * max_chunk_bytes]
        chunks.append(Chunk(transfer_id, i, part, 0, full if i == 0 else None))
    return chunks


def sealed(chunks: Iterable[Chunk]) -> Iterator[Chunk]:
    """The chunks of one transfer, in order, as they are to be written: when its header leaves the
    digest empty (``split(..., trailing=True)``), each chunk is hashed as it is taken (taken just
    before it is written, its bytes are still in the caches when they are copied into its message)
    and the last one comes with the payload's digest. Chunks whose header carries the digest pass
    unchanged. Every call hashes afresh, so a transfer sent again is sealed again."""
    hasher, count = None, 0
    for chunk in chunks:
        if chunk.index == 0:
            if chunk.header is None:
                raise HeaderError(f"first chunk of transfer {chunk.transfer_id} has no header")
            count = chunk.header.chunk_count
            hasher = None if chunk.header.digest else xxhash.xxh3_128()
        if hasher is None:
            yield chunk
            continue
        hasher.update(chunk.data)
        yield replace(chunk, digest=hasher.digest(), frame=None) if chunk.index == count - 1 else chunk


class Reassembler:
    """Rebuilds transfers from the chunks of one stream, in order, verifying everything: order,
    sizes, and the payload digest, hashed chunk by chunk as they arrive (a chunk's CRC-32C, which
    older senders add, is not read: the digest covers every byte it would)."""

    def __init__(self, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 max_payload_bytes: int = 1 << 34, relay: bool = False) -> None:
        """``relay``: for a receiver that forwards the chunks' messages as they came and does not
        read the payload: each chunk is verified and kept as it came (a view of its message), not
        copied into a payload buffer; the transfer joins them only if its payload is read."""
        self.max_chunk_bytes = max_chunk_bytes
        self.max_payload_bytes = max_payload_bytes
        self.relay = relay
        self._parts: list[bytes | memoryview] = []
        self._header: TransferHeader | None = None
        self._transfer_id = 0
        self._next = 0
        self._buf: np.ndarray | None = None
        """The payload of the transfer in progress: its declared size, allocated when it starts
        (memory the kernel hands out as each chunk is copied in: a header that declares much and
        sends little takes little), filled chunk by chunk."""
        self._size = 0
        self._hash = xxhash.xxh3_128()

    @property
    def in_progress(self) -> TransferHeader | None:
        """The header of the transfer being received, if any."""
        return self._header

    def _fail(self, exc: Exception) -> Exception:
        self._header, self._next, self._buf, self._parts, self._size = None, 0, None, [], 0
        return exc

    def feed(self, chunk: Chunk) -> Transfer | None:
        """Add one chunk; return the transfer when it completes. Raises ``ChunkError``."""
        data = chunk.data if isinstance(chunk.data, bytes) else memoryview(chunk.data).cast("B")
        n = len(data)  # bytes, whatever the view's format
        if n > self.max_chunk_bytes:
            raise self._fail(OversizedChunkError(
                f"chunk {chunk.index} of transfer {chunk.transfer_id} has {n} bytes; "
                f"limit {self.max_chunk_bytes}"))
        if chunk.index == 0:
            if self._header is not None:
                raise self._fail(MissingChunkError(
                    f"transfer {self._transfer_id} ended after {self._next} of "
                    f"{self._header.chunk_count} chunks: a new transfer started"))
            self._start(chunk)
        elif self._header is None:
            raise self._fail(ReorderedChunkError(
                f"chunk {chunk.index} of transfer {chunk.transfer_id} arrived without its header chunk"))
        elif chunk.transfer_id != self._transfer_id:
            raise self._fail(ReorderedChunkError(
                f"chunk of transfer {chunk.transfer_id} interleaved into transfer {self._transfer_id}"))
        elif chunk.header is not None:
            raise self._fail(HeaderError(f"chunk {chunk.index} repeats the transfer header"))
        elif chunk.index < self._next:
            raise self._fail(DuplicateChunkError(
                f"chunk {chunk.index} of transfer {chunk.transfer_id} arrived twice"))
        elif chunk.index > self._next:
            raise self._fail(ReorderedChunkError(
                f"expected chunk {self._next} of transfer {chunk.transfer_id}, got {chunk.index}"))
        header = self._header
        assert header is not None
        last = self._next + 1 == header.chunk_count
        if chunk.digest and (header.digest or not last):
            raise self._fail(HeaderError(
                f"chunk {chunk.index} of transfer {chunk.transfer_id} carries a digest: only the last chunk of a "
                "transfer whose header has none may"))
        if last and not header.digest and len(chunk.digest) != 16:
            raise self._fail(HeaderError(
                f"transfer {chunk.transfer_id} has no digest: its header leaves it to the last chunk, which carries "
                f"{len(chunk.digest)} bytes of one"))
        if self._size + n > header.encoded_bytes:
            raise self._fail(OversizedChunkError(
                f"transfer {chunk.transfer_id} carries more than its declared {header.encoded_bytes} bytes"))
        if self._buf is not None:
            self._buf.data[self._size:self._size + n] = data  # one copy, into the payload
        else:
            self._parts.append(data)
        self._hash.update(data)
        self._size += n
        self._next += 1
        if self._next < header.chunk_count:
            return None
        size, got = self._size, self._hash.digest()
        payload = self._buf if self._buf is not None else self._parts
        self._header, self._next, self._buf, self._parts, self._size = None, 0, None, [], 0
        if size != header.encoded_bytes:
            raise MissingChunkError(
                f"transfer {chunk.transfer_id} has {size} of {header.encoded_bytes} declared bytes")
        if got != (header.digest or chunk.digest):
            raise ChecksumError(f"transfer {chunk.transfer_id} fails its payload digest")
        return Transfer(header, payload)

    def _start(self, chunk: Chunk) -> None:
        header = chunk.header
        if header is None:
            raise self._fail(HeaderError(f"first chunk of transfer {chunk.transfer_id} has no header"))
        if header.chunk_count < 1:
            raise self._fail(HeaderError(f"transfer {chunk.transfer_id} declares {header.chunk_count} chunks"))
        if header.encoded_bytes > self.max_payload_bytes:
            raise self._fail(OversizedChunkError(
                f"transfer {chunk.transfer_id} declares {header.encoded_bytes} bytes; "
                f"limit {self.max_payload_bytes}"))
        if header.chunk_count > max(1, header.encoded_bytes) or (
                header.encoded_bytes > header.chunk_count * self.max_chunk_bytes):
            raise self._fail(HeaderError(
                f"transfer {chunk.transfer_id} declares {header.chunk_count} chunks for {header.encoded_bytes} bytes"))
        if len(header.digest) not in (0, 16):  # empty: it trails, on the last chunk
            raise self._fail(HeaderError(f"transfer {chunk.transfer_id} has a digest of {len(header.digest)} bytes, "
                                         "not 16"))
        try:
            buf = None if self.relay else np.empty(header.encoded_bytes, dtype=np.uint8)
        except (MemoryError, ValueError) as exc:  # more than this machine can map
            raise self._fail(OversizedChunkError(
                f"transfer {chunk.transfer_id} declares {header.encoded_bytes} bytes, which cannot be "
                f"allocated here: {exc}")) from exc
        self._header = header
        self._transfer_id = chunk.transfer_id
        self._next = 0
        self._buf = buf
        self._parts, self._size = [], 0
        self._hash.reset()

    def finish(self) -> None:
        """The stream ended: raise ``MissingChunkError`` if a transfer was cut short."""
        if self._header is not None:
            header, got = self._header, self._next
            self._fail(None)  # type: ignore[arg-type]
            raise MissingChunkError(
                f"stream ended after {got} of {header.chunk_count} chunks of fragment {header.fragment_id}")
