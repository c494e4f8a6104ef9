"""Payload codecs: flat fp32 values in, bytes out, and back.

Five codecs behind one interface (``encode(values) -> bytes``, ``decode(payload, n) -> values``):

- ``fp32``: raw little-endian fp32, lossless, the baseline. (All of them assume a little-endian
  host, as every platform torch ships for does.)
- ``bf16_zstd``: round to bfloat16 exactly as torch does (round-to-nearest-even), then code the
  8 exponent bits and the sign+7 mantissa bits of each value separately. The mantissa bits are
  close to uniform noise: compressing them costs time and gains nothing, so that byte plane is
  kept raw unless a sample of it compresses. Parameters and outer gradients span a narrow range of
  magnitudes, so nearly every exponent of a block lies within 14 binades below the block's largest
  one: each becomes a 4-bit code (``emax - e``; 15 means zero/subnormal, or an *escape* whose
  exponent is listed beside the codes), two codes a byte, which zstd's entropy stage shrinks
  a further ~1.5x. Halving the bytes zstd sees (and leaving it almost no matches to hunt for)
  made the exponent stage ~5x faster than zstd on the plain exponent byte plane, and smaller:
  measured on N(0, 0.02) weights and on AdamW outer gradients, ~1.51x over bf16 bytes (3.0x over
  fp32) at over 1 GB/s of fp32 input with 2 threads. Blocks with too many escapes (over 1/32 of
  their values) fall back to the plain exponent plane. The payload is cut into independent blocks
  of 256 Ki values that a thread pool encodes and decodes in parallel (numpy, torch and zstd
  release the GIL), each thread in its own reused scratch buffers.

  Layout (little-endian): header ``<3sII`` = b"BZ\\x02", values per block, blocks; per block
  ``<BBBBIII`` = exponent mode (0 raw plane, 1 zstd plane, 2 raw codes, 3 zstd codes),
  sign/mantissa mode (0 raw, 1 zstd), emax, 0, escapes k, exponent bytes, sign/mantissa bytes;
  then the exponent data, k uint32 indices (increasing), k exponent bytes, the sign/mantissa data
  (sign in bit 7). A zstd plane is exactly one frame that declares its size. Decoding is strict:
  anything malformed raises ``CodecError``; ``tests/fragments/test_codec.py`` pins the layout with an
  independent decoder.
- ``int8_block``, ``int4_block``, ``int2_block``: lossy blockwise quantisers (8, 4 and 2 bits a
  value and one fp32 scale per block), in ``ddiloco.fragments.quantized``; only with
  ``ErrorFeedback``, so quantisation error is carried, not lost.

Lossy codecs never see anything but fp32 outer gradients or parameters; the codec is chosen per
transfer and named in its header.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

import numpy as np
import torch
import zstandard

from ddiloco.fragments.codec_names import CODEC_NAMES, CodecName
from ddiloco.fragments.errors import CodecError
from ddiloco.fragments.quantized import Int2BlockCodec, Int4BlockCodec, Int8BlockCodec, flat_fp32

__all__ = ["CODEC_NAMES", "Bf16ZstdCodec", "Codec", "CodecName", "Fp32Codec", "Int2BlockCodec",
           "Int4BlockCodec", "Int8BlockCodec", "lend_or_encode", "make_codec"]


class Codec(Protocol):
    name: ClassVar[str]
    lossless: ClassVar[bool]

    def encode(self, values: torch.Tensor) -> bytes: ...

    def decode(self, payload: bytes | bytearray | memoryview, num_values: int) -> torch.Tensor: ...

    def max_encoded_bytes(self, num_values: int) -> int:
        """Upper bound of the payload size for ``num_values`` values (oversize checks)."""
        ...


@dataclass(frozen=True)
class Fp32Codec:
    """Raw little-endian fp32."""

    name: ClassVar[str] = "fp32"
    lossless: ClassVar[bool] = True

    def encode(self, values: torch.Tensor) -> bytes:
        return flat_fp32(values).numpy().astype("<f4", copy=False).tobytes()

    def borrow(self, values: torch.Tensor) -> memoryview | None:
        """The encoded bytes without a copy: a view of ``values``' own memory (None where that is
        not possible: a big-endian machine, or values that are not flat contiguous fp32 on the
        CPU). Valid only while ``values`` is unchanged: for a caller that copies the bytes at once
        (``encode_fragment`` with ``frame``)."""
        if sys.byteorder != "little" or values.dtype != torch.float32 or values.device.type != "cpu" or (
                not values.is_contiguous()) or values.requires_grad:
            return None
        return memoryview(values.detach().reshape(-1).numpy().data).cast("B")

    def decode(self, payload: bytes | bytearray | memoryview, num_values: int) -> torch.Tensor:
        """The values as a tensor of their own. A ``bytearray`` payload is taken over (``take``)."""
        if isinstance(payload, bytearray):
            return self.take(payload, num_values)
        self._check(payload, num_values)
        return torch.from_numpy(np.frombuffer(payload, dtype="<f4").copy())

    def take(self, payload: bytes | bytearray | memoryview, num_values: int) -> torch.Tensor:
        """The values in ``payload``'s own memory, not copied (on a little-endian machine): a
        writable buffer the caller gives up and must not reuse, such as a reassembled transfer's
        (64 MiB copied into a fresh buffer costs 15-40 ms on 2 cores). Read-only bytes are copied."""
        self._check(payload, num_values)
        if sys.byteorder == "little" and num_values and not isinstance(payload, bytes) and (
                not memoryview(payload).readonly):
            return torch.frombuffer(payload, dtype=torch.float32)
        return torch.from_numpy(np.frombuffer(payload, dtype="<f4").copy())

    @staticmethod
    def _check(payload: bytes | bytearray | memoryview, num_values: int) -> None:
        if len(payload) != 4 * num_values:
            raise CodecError(f"fp32 payload has {len(payload)} bytes, expected {4 * num_values}")

    def max_encoded_bytes(self, num_values: int) -> int:
        return 4 * num_values


_BZ_MAGIC = b"BZ\x02"
_BZ_HEAD = struct.Struct("<3sII")  # magic+version, values per block, number of blocks
# Per block: exponent mode, sign/mantissa mode, reference exponent, reserved (0), number of escapes,
# encoded exponent length, encoded sign/mantissa length.
_BZ_BLOCK = struct.Struct("<BBBBIII")
_RAW, _ZSTD, _NIBBLE_RAW, _NIBBLE_ZSTD = 0, 1, 2, 3
_ESCAPE = 15
_SAMPLE = 16 * 1024
_MIN_BLOCK_VALUES = 1024
_MAX_BLOCK_VALUES = 1 << 22  # 16 MiB of fp32; also bounds what a forged header makes us allocate
_CONVERT_SLICE = 1 << 15  # torch's intra-op grain size: copy_ of at most this many runs inline
_NO_ESCAPES = np.empty(0, dtype=np.int64)
_BYTE_LANES = np.arange(8, dtype=np.int64)


_THREAD = threading.local()  # per-thread scratch buffers and zstd contexts, shared by all codecs
_POOLS: dict[int, tuple[int, ThreadPoolExecutor]] = {}
_POOLS_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """One process-wide pool per thread count: codecs are cheap to make (``decode_fragment``
    makes one per transfer), so they share workers and the workers' warm scratch buffers."""
    pid = os.getpid()
    with _POOLS_LOCK:
        entry = _POOLS.get(threads)
        if entry is None or entry[0] != pid:  # a forked child inherits the dict, not the threads
            entry = _POOLS[threads] = (pid, ThreadPoolExecutor(threads, thread_name_prefix="ddiloco-codec"))
        return entry[1]


def _thread_scratch() -> _Scratch:
    scratch = getattr(_THREAD, "scratch", None)
    if scratch is None:
        scratch = _THREAD.scratch = _Scratch()
    return scratch


def _thread_compressor(level: int) -> zstandard.ZstdCompressor:
    # One compression context per thread and level: a context is not safe to share between threads.
    compressors = getattr(_THREAD, "compressors", None)
    if compressors is None:
        compressors = _THREAD.compressors = {}
    if level not in compressors:
        compressors[level] = zstandard.ZstdCompressor(level=level)
    return compressors[level]


class _Scratch:
    """Per-thread numpy buffers reused across blocks and calls.

    Fresh memory costs a page fault per 4 KiB on first touch, which measured about as much as the
    arithmetic itself on these passes; reused buffers stay mapped and mostly in cache.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, count: int, dtype: type) -> np.ndarray:
        buf = self._buffers.get(name)
        if buf is None or buf.size < count:
            buf = self._buffers[name] = np.empty(count, dtype=dtype)
        return buf[:count]


def _nibble_codes(exponent: np.ndarray, emax: int, scratch: _Scratch) -> tuple[np.ndarray, np.ndarray] | None:
    """Exponent plane -> (packed 4-bit codes, escape indices), or None when too many escape.

    Code ``c < 15`` stands for exponent ``emax - c``; code 15 stands for exponent 0 (zero or
    subnormal) unless the value's index is in the escape list, which then carries its exponent.
    Two codes per byte, the first in the low nibble. The packed codes live in ``scratch``.
    """
    count = exponent.size
    padded = -(-count // 8) * 8  # whole 64-bit words, for the sparse search below
    codes = scratch.get("codes", padded, np.uint8)
    codes[count:] = 0
    np.subtract(np.uint8(emax), exponent, out=codes[:count])
    escapes = _NO_ESCAPES
    if emax >= _ESCAPE:
        far = np.greater_equal(codes, np.uint8(_ESCAPE), out=scratch.get("far", padded, np.bool_))
        words = np.flatnonzero(far.view(np.uint64) != 0)  # nonzero() is only fast on bool arrays
        if words.size:
            if words.size <= count // 64:
                # Few far values (the common case): visit only the 8-byte words that hold one.
                candidates = (words[:, None] * 8 + _BYTE_LANES).reshape(-1)
                hits = candidates[far[candidates]]
                codes[hits] = _ESCAPE
                escapes = hits[exponent[hits] != 0]
            else:
                np.copyto(codes, np.uint8(_ESCAPE), where=far)  # np.minimum is not vectorised for uint8
                far[:count] &= exponent != 0
                escapes = np.flatnonzero(far)
            if escapes.size > count // 32:
                return None
    pairs = codes[:count + (count & 1)].view(np.uint16)  # little-endian: first code in the low byte
    merged = np.right_shift(pairs, np.uint16(4), out=scratch.get("merged", pairs.size, np.uint16))
    merged |= pairs
    packed = scratch.get("packed", pairs.size, np.uint8)
    np.copyto(packed, merged, casting="unsafe")  # keeps the low byte: both codes
    return packed, escapes.astype("<u4")


@dataclass
class Bf16ZstdCodec:
    """bf16 rounding + exponent codes / sign-mantissa planes + zstd, block-parallel."""

    level: int = 1
    """zstd level; the exponent codes compress alike at levels 1..3, so 1 (fastest) is the default."""
    threads: int = 2
    """Worker threads for block-parallel encode/decode (1 = in the caller's thread)."""
    block_values: int = 1 << 18
    """Values per independently coded block (256 Ki values = 1 MiB of fp32: the working set of a
    block stays in a core's L2 cache)."""

    name: ClassVar[str] = "bf16_zstd"
    lossless: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not -7 <= self.level <= 22:
            raise ValueError(f"zstd level must be in -7..22, got {self.level}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not _MIN_BLOCK_VALUES <= self.block_values <= _MAX_BLOCK_VALUES:
            raise ValueError(
                f"block_values must be in {_MIN_BLOCK_VALUES}..{_MAX_BLOCK_VALUES}, got {self.block_values}")

    def _map(self, fn, items):  # type: ignore[no-untyped-def]
        if self.threads == 1 or len(items) <= 1:
            return [fn(i) for i in items]
        return list(_pool(self.threads).map(fn, items))

    def _maybe_compress(self, plane: np.ndarray, probe: bool) -> tuple[int, bytes | np.ndarray]:
        """(_ZSTD, compressed) when zstd shrinks ``plane``, else (_RAW, plane)."""
        if plane.size == 0:
            return _RAW, plane
        compressor = _thread_compressor(self.level)
        if probe and plane.size > 4 * _SAMPLE:
            sample = compressor.compress(plane[:_SAMPLE].data)
            if len(sample) > 0.97 * _SAMPLE:
                return _RAW, plane
        packed = compressor.compress(plane.data)
        return (_ZSTD, packed) if len(packed) < plane.size else (_RAW, plane)

    def _encode_block(self, flat: torch.Tensor, sign_mantissa: np.ndarray, start: int) -> list[bytes | memoryview]:
        """One block's parts. ``sign_mantissa`` (the caller's, alive until the final join) receives
        the raw sign/mantissa plane; every other buffer here is per-thread scratch, so what is
        returned must never alias one."""
        count = sign_mantissa.size
        scratch = _thread_scratch()
        # bf16 rounding by torch itself, in slices no larger than its intra-op grain size, so torch
        # stays in this thread: its own threads, started from every pool thread, would
        # oversubscribe the cores.
        bits = scratch.get("bf16", count, np.uint16)
        rounded = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        for dst, src in zip(rounded.split(_CONVERT_SLICE), flat[start:start + count].split(_CONVERT_SLICE),
                            strict=True):
            dst.copy_(src)
        shifted = np.right_shift(bits, np.uint16(7), out=scratch.get("u16", count, np.uint16))
        exponent = scratch.get("exponent", count, np.uint8)
        np.copyto(exponent, shifted, casting="unsafe")  # the low byte: the exponent without the sign
        emax = int(exponent.max()) if count else 0
        nibbles = _nibble_codes(exponent, emax, scratch)
        if nibbles is None:
            e_mode, e_data = self._maybe_compress(exponent, probe=False)
            escapes = _NO_ESCAPES
        else:
            packed, escapes = nibbles
            mode, e_data = self._maybe_compress(packed, probe=False)
            e_mode = _NIBBLE_ZSTD if mode == _ZSTD else _NIBBLE_RAW
        if isinstance(e_data, np.ndarray):
            e_data = e_data.tobytes()  # raw scratch: copy out before the next block reuses it
        # Sign in bit 7, mantissa in bits 0..6: (bits & 0x807F) | (bits & 0x807F) >> 8, low byte.
        masked = np.bitwise_and(bits, np.uint16(0x807F), out=shifted)
        masked |= masked >> np.uint16(8)
        np.copyto(sign_mantissa, masked, casting="unsafe")
        m_mode, m_data = self._maybe_compress(sign_mantissa, probe=True)
        head = _BZ_BLOCK.pack(e_mode, m_mode, emax, 0, escapes.size, len(e_data), _nbytes(m_data))
        parts: list[bytes | memoryview] = [head, e_data]
        if escapes.size:
            parts += [escapes.data, exponent[escapes].data]
        parts.append(m_data.data if isinstance(m_data, np.ndarray) else m_data)
        return parts

    def encode(self, values: torch.Tensor) -> bytes:
        flat = flat_fp32(values)
        n = flat.numel()
        # The raw sign/mantissa planes go straight into one per-caller-thread buffer that the
        # final join copies from (nothing returned aliases it).
        planes = _thread_scratch().get("sign_mantissa", n, np.uint8)
        starts = list(range(0, n, self.block_values))
        blocks = self._map(lambda s: self._encode_block(flat, planes[s:s + self.block_values], s), starts)
        return b"".join([_BZ_HEAD.pack(_BZ_MAGIC, self.block_values, len(blocks))]
                        + [part for block in blocks for part in block])

    def decode(self, payload: bytes | bytearray | memoryview, num_values: int) -> torch.Tensor:
        view = memoryview(payload).cast("B")
        if len(view) < _BZ_HEAD.size:
            raise CodecError("bf16_zstd payload shorter than its header")
        magic, block_values, nblocks = _BZ_HEAD.unpack_from(view, 0)
        if magic != _BZ_MAGIC:
            raise CodecError(f"bf16_zstd payload has bad magic or version {magic!r}, expected {_BZ_MAGIC!r}")
        if not _MIN_BLOCK_VALUES <= block_values <= _MAX_BLOCK_VALUES:
            raise CodecError(f"bf16_zstd payload has an invalid block size {block_values}")
        expected_blocks = -(-num_values // block_values)
        if nblocks != expected_blocks:
            raise CodecError(f"bf16_zstd payload has {nblocks} blocks, expected {expected_blocks}")
        spans = []
        pos = _BZ_HEAD.size
        for b in range(nblocks):
            if pos + _BZ_BLOCK.size > len(view):
                raise CodecError("bf16_zstd payload truncated in a block header")
            e_mode, m_mode, emax, reserved, n_esc, e_len, m_len = _BZ_BLOCK.unpack_from(view, pos)
            pos += _BZ_BLOCK.size
            count = min(block_values, num_values - b * block_values)
            if reserved or n_esc > count or (n_esc and e_mode not in (_NIBBLE_RAW, _NIBBLE_ZSTD)):
                raise CodecError(f"bf16_zstd block {b} has an invalid header")
            size = e_len + 5 * n_esc + m_len
            if pos + size > len(view):
                raise CodecError("bf16_zstd payload truncated in block data")
            e_data = view[pos:pos + e_len]
            esc_at = pos + e_len
            spans.append(_Span(b * block_values, count, e_mode, emax, e_data, view[esc_at:esc_at + 4 * n_esc],
                               view[esc_at + 4 * n_esc:esc_at + 5 * n_esc], m_mode,
                               view[pos + size - m_len:pos + size]))
            pos += size
        if pos != len(view):
            raise CodecError(f"bf16_zstd payload has {len(view) - pos} trailing bytes")
        out = np.empty(num_values, dtype=np.uint32)  # fp32 bit patterns, written block by block
        self._map(lambda span: _decode_block(span, out[span.start:span.start + span.size], _thread_scratch()),
                  spans)
        return torch.from_numpy(out.view(np.float32))

    def max_encoded_bytes(self, num_values: int) -> int:
        # A plane is stored raw whenever zstd would not shrink it, so the plain exponent plane and
        # the sign/mantissa plane take at most a byte a value each; the nibble mode, at most half
        # a byte (rounded up) plus 5 bytes per escape, with escapes capped at 1/32 of the values.
        nblocks = max(1, -(-num_values // self.block_values))
        return _BZ_HEAD.size + nblocks * (_BZ_BLOCK.size + 1) + 2 * num_values


class _Span(NamedTuple):
    """One block of a received payload, located but not yet decoded."""

    start: int
    size: int
    e_mode: int
    emax: int
    e_data: memoryview
    esc_index: memoryview
    esc_value: memoryview
    m_mode: int
    m_data: memoryview


def _nbytes(data: bytes | np.ndarray) -> int:
    return data.nbytes if isinstance(data, np.ndarray) else len(data)


def _plane(mode: int, data: memoryview, size: int) -> np.ndarray:
    raw: bytes | memoryview
    if mode == _ZSTD:
        raw = _decompress_exactly(data, size)
    elif mode == _RAW:
        raw = data
    else:
        raise CodecError(f"bf16_zstd plane has unknown mode {mode}")
    if len(raw) != size:
        raise CodecError(f"bf16_zstd plane has {len(raw)} bytes, expected {size}")
    return np.frombuffer(raw, dtype=np.uint8)


def _decompress_exactly(data: memoryview, size: int) -> bytes:
    """One zstd frame that declares and holds exactly ``size`` bytes, nothing before or after it.

    The declared size is checked first: zstd allocates what a frame declares, so a forged header
    could otherwise ask for terabytes; the decoder then refuses output that differs from it.
    """
    try:
        declared = zstandard.get_frame_parameters(data).content_size
        if declared != size:
            raise CodecError(f"bf16_zstd plane declares {declared} bytes, expected {size}")
        stream = zstandard.ZstdDecompressor().decompressobj(write_size=max(size, 1))
        raw = stream.decompress(data)
    except zstandard.ZstdError as exc:
        raise CodecError(f"bf16_zstd plane does not decompress: {exc}") from exc
    if not stream.eof or stream.unused_data:
        raise CodecError("bf16_zstd plane is not exactly one zstd frame")
    return raw


def _decode_block(span: _Span, out: np.ndarray, scratch: _Scratch) -> None:
    """Decode one block into ``out`` (its fp32 bit patterns, uint32)."""
    count, emax = span.size, span.emax
    if span.e_mode in (_RAW, _ZSTD):
        exponent = _plane(span.e_mode, span.e_data, count)
    elif span.e_mode in (_NIBBLE_RAW, _NIBBLE_ZSTD):
        packed = _plane(_RAW if span.e_mode == _NIBBLE_RAW else _ZSTD, span.e_data, (count + 1) // 2)
        if count & 1 and packed[-1] >> 4:
            raise CodecError("bf16_zstd exponent codes have a non-zero padding nibble")
        words = scratch.get("words", packed.size, np.uint16)
        np.copyto(words, packed)
        spread = np.left_shift(words, np.uint16(4), out=scratch.get("spread", packed.size, np.uint16))
        spread |= words
        spread &= np.uint16(0x0F0F)  # low byte: first code, high byte: second code
        codes = spread.view(np.uint8)[:count]
        if emax < _ESCAPE and int(codes.max(initial=0)) > emax:
            raise CodecError("bf16_zstd exponent code out of range")
        keep = np.not_equal(codes, np.uint8(_ESCAPE), out=scratch.get("keep", count, np.bool_))
        exponent = np.subtract(np.uint8(emax), codes, out=scratch.get("exponent", count, np.uint8))
        np.multiply(exponent, keep, out=exponent)  # code 15: exponent 0 (a masked store is far slower)
        if span.esc_index:
            index = np.frombuffer(span.esc_index, dtype="<u4")
            value = np.frombuffer(span.esc_value, dtype=np.uint8)
            if (int(index[-1]) >= count or (index.size > 1 and not (np.diff(index.astype(np.int64)) > 0).all())
                    or keep[index].any() or not ((value != 0) & (value.astype(np.int32) + _ESCAPE <= emax)).all()):
                raise CodecError("bf16_zstd exponent escapes are malformed")
            exponent[index] = value
    else:
        raise CodecError(f"bf16_zstd exponent plane has unknown mode {span.e_mode}")
    # Sign/mantissa byte s -> s * 0x0101 & 0x807F puts the sign in bit 15 and keeps the mantissa.
    sign_mantissa = np.multiply(_plane(span.m_mode, span.m_data, count), np.uint16(0x0101), dtype=np.uint16,
                                out=scratch.get("sign_mantissa16", count, np.uint16))
    sign_mantissa &= np.uint16(0x807F)
    bits = np.left_shift(exponent, np.uint16(7), out=scratch.get("bits", count, np.uint16), dtype=np.uint16)
    bits |= sign_mantissa
    np.left_shift(bits, np.uint32(16), out=out, dtype=np.uint32)  # bf16 -> fp32 is exact: a shift


def make_codec(name: str, *, zstd_level: int = 1, threads: int = 2, int8_block: int = 256,
               int4_block: int = 64, int2_block: int = 64) -> Codec:
    """Build a codec by its name (one of ``CODEC_NAMES``)."""
    if name == "fp32":
        return Fp32Codec()
    if name == "bf16_zstd":
        return Bf16ZstdCodec(level=zstd_level, threads=threads)
    if name == "int8_block":
        return Int8BlockCodec(block_size=int8_block)
    if name == "int4_block":
        return Int4BlockCodec(block_size=int4_block)
    if name == "int2_block":
        return Int2BlockCodec(block_size=int2_block)
    raise CodecError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}")


def lend_or_encode(codec: Codec, values: torch.Tensor) -> bytes | memoryview:
    """The payload of ``values``: fp32 values lend their own memory where they can
    (``Fp32Codec.borrow``: no copy), anything else is encoded. A lent payload reads ``values`` as
    they are when it is read: the caller keeps them unchanged for as long as it uses the payload
    (a learner: until its contribution is answered or dropped; a resend reads it again)."""
    if isinstance(codec, Fp32Codec) and (lent := codec.borrow(values)) is not None:
        return lent
    return codec.encode(values)

