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
- ``int8_block``: symmetric int8 with one fp32 scale per block of values (lossy, 3.9x smaller
  than fp32); pair it with ``ErrorFeedback`` so quantisation error is carried, not lost.
- ``int4_block``: symmetric levels -7..7 (4 bits, two a byte) with one fp32 scale per block of 64
  values (lossy, 0.5625 bytes a value, 7.1x smaller than fp32); only with ``ErrorFeedback``.
- ``int2_block``: the four Lloyd-Max levels of a Gaussian (+-0.4528, +-1.510 times the block's RMS;
  2 bits, four a byte) with one fp32 scale per block of 64 values (lossy, 0.3125 bytes a value,
  12.8x smaller than fp32); only with ``ErrorFeedback``, which carries the clipped outliers.

Lossy codecs never see anything but fp32 outer gradients or parameters; the codec is chosen per
transfer and named in its header.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, Protocol, get_args

import numpy as np
import torch
import zstandard

from ddiloco.fragments.errors import CodecError


class Codec(Protocol):
    name: ClassVar[str]
    lossless: ClassVar[bool]

    def encode(self, values: torch.Tensor) -> bytes: ...

    def decode(self, payload: bytes | memoryview, num_values: int) -> torch.Tensor: ...

    def max_encoded_bytes(self, num_values: int) -> int:
        """Upper bound of the payload size for ``num_values`` values (oversize checks)."""
        ...


def _as_flat_fp32(values: torch.Tensor) -> torch.Tensor:
    if values.dtype != torch.float32:
        raise CodecError(f"codecs take fp32 values, got {values.dtype}")
    return values.detach().reshape(-1).contiguous().cpu()


@dataclass(frozen=True)
class Fp32Codec:
    """Raw little-endian fp32."""

    name: ClassVar[str] = "fp32"
    lossless: ClassVar[bool] = True

    def encode(self, values: torch.Tensor) -> bytes:
        return _as_flat_fp32(values).numpy().astype("<f4", copy=False).tobytes()

    def decode(self, payload: bytes | memoryview, num_values: int) -> torch.Tensor:
        if len(payload) != 4 * num_values:
            raise CodecError(f"fp32 payload has {len(payload)} bytes, expected {4 * num_values}")
        arr = np.frombuffer(payload, dtype="<f4").copy()
        return torch.from_numpy(arr)

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
        flat = _as_flat_fp32(values)
        n = flat.numel()
        # The raw sign/mantissa planes go straight into one per-caller-thread buffer that the
        # final join copies from (nothing returned aliases it).
        planes = _thread_scratch().get("sign_mantissa", n, np.uint8)
        starts = list(range(0, n, self.block_values))
        blocks = self._map(lambda s: self._encode_block(flat, planes[s:s + self.block_values], s), starts)
        return b"".join([_BZ_HEAD.pack(_BZ_MAGIC, self.block_values, len(blocks))]
                        + [part for block in blocks for part in block])

    def decode(self, payload: bytes | memoryview, num_values: int) -> torch.Tensor:
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


_I8_HEAD = struct.Struct("<2sI")
_I8_MIN_BLOCK, _I8_MAX_BLOCK = 8, 1 << 20
_I8_CHUNK_VALUES = 1 << 16


def _quantize(blocks: np.ndarray, scales: np.ndarray, q: np.ndarray) -> None:
    """Rows of ``blocks`` -> their scales (max|x|/127) and int8 levels round(x/scale), in place.

    numpy, one slice at a time in the caller's thread: torch's intra-op threads on slices this
    small spend more time waking up than working, and stall outright when the cores are busy.
    """
    work = np.abs(blocks)
    np.max(work, axis=1, out=scales)
    scales /= np.float32(127.0)
    safe = np.where(scales > 0, scales, np.float32(1.0))
    with np.errstate(invalid="ignore"):  # non-finite inputs give non-finite scales, refused on decode
        np.divide(blocks, safe[:, None], out=work)
        np.rint(work, out=work)  # half to even, like torch.round; |x/scale| <= 127 by construction
        np.copyto(q, work, casting="unsafe")


def _block_steps(values: torch.Tensor, block_size: int, levels: float) -> torch.Tensor:
    """Per-value quantisation step of a blockwise absmax codec: each block's max |x| / levels."""
    flat = _as_flat_fp32(values)
    n = flat.numel()
    nblocks = -(-n // block_size)
    padded = torch.zeros(nblocks * block_size, dtype=torch.float32)
    padded[:n] = flat.abs()
    scales = padded.view(nblocks, block_size).amax(dim=1) / levels
    return scales.repeat_interleave(block_size)[:n]


@dataclass(frozen=True)
class Int8BlockCodec:
    """Symmetric int8 per block of ``block_size`` values, one fp32 scale (max|x|/127) per block."""

    block_size: int = 256

    name: ClassVar[str] = "int8_block"
    lossless: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not _I8_MIN_BLOCK <= self.block_size <= _I8_MAX_BLOCK:
            raise ValueError(f"block_size must be in {_I8_MIN_BLOCK}..{_I8_MAX_BLOCK}, got {self.block_size}")

    def encode(self, values: torch.Tensor) -> bytes:
        flat = _as_flat_fp32(values).numpy()
        n, size = flat.size, self.block_size
        full = n // size
        scales = np.empty(-(-n // size), dtype=np.float32)
        q = np.empty(n, dtype=np.int8)
        step = max(1, _I8_CHUNK_VALUES // size)  # a cache-sized slice of blocks at a time
        for first in range(0, full, step):
            last = min(first + step, full)
            _quantize(flat[first * size:last * size].reshape(-1, size), scales[first:last],
                      q[first * size:last * size].reshape(-1, size))
        if full * size < n:
            tail = np.zeros((1, size), dtype=np.float32)
            tail[0, :n - full * size] = flat[full * size:]
            q_tail = np.empty((1, size), dtype=np.int8)
            _quantize(tail, scales[full:], q_tail)
            q[full * size:] = q_tail[0, :n - full * size]
        return b"".join([_I8_HEAD.pack(b"I8", size), scales.data, q.data])

    def quantization_step(self, values: torch.Tensor) -> torch.Tensor:
        """Per-value quantisation step (the block's scale) for ``values``."""
        return _block_steps(values, self.block_size, 127.0)

    def decode(self, payload: bytes | memoryview, num_values: int) -> torch.Tensor:
        view = memoryview(payload).cast("B")
        if len(view) < _I8_HEAD.size:
            raise CodecError("int8_block payload shorter than its header")
        magic, size = _I8_HEAD.unpack_from(view, 0)
        if magic != b"I8" or not _I8_MIN_BLOCK <= size <= _I8_MAX_BLOCK:
            raise CodecError(f"int8_block payload has a bad header (block size {size})")
        nblocks = -(-num_values // size)
        expected = _I8_HEAD.size + 4 * nblocks + num_values
        if len(view) != expected:
            raise CodecError(f"int8_block payload has {len(view)} bytes, expected {expected}")
        scales = np.frombuffer(view, dtype="<f4", count=nblocks, offset=_I8_HEAD.size)
        q = np.frombuffer(view, dtype=np.int8, offset=_I8_HEAD.size + 4 * nblocks)
        out = np.empty(num_values, dtype=np.float32)
        full = num_values // size
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite scales: refused by the caller
            np.multiply(q[:full * size].reshape(full, size), scales[:full, None],
                        out=out[:full * size].reshape(full, size))
            if full < nblocks:
                np.multiply(q[full * size:], scales[full], out=out[full * size:])
        return torch.from_numpy(out)

    def max_encoded_bytes(self, num_values: int) -> int:
        return _I8_HEAD.size + 4 * (-(-num_values // self.block_size)) + num_values


# The sub-byte codecs (int4_block, int2_block) share one layout: header ``<2sI`` = magic, block
# size; one fp32 scale per block; then the codes, packed from the lowest bits of each byte up, and
# the block size is a multiple of the codes a byte, so every block starts on a byte.
_PACKED_HEAD = struct.Struct("<2sI")
_PACKED_MIN_BLOCK, _PACKED_MAX_BLOCK = 8, 1 << 20
_PACKED_CHUNK_VALUES = 1 << 15

_Quantize = Callable[[np.ndarray, np.ndarray, np.ndarray, int], None]
_Pack = Callable[[np.ndarray, np.ndarray], None]


def _check_packed_block(block_size: int, per_byte: int) -> None:
    if not _PACKED_MIN_BLOCK <= block_size <= _PACKED_MAX_BLOCK or block_size % per_byte:
        what = "even" if per_byte == 2 else f"a multiple of {per_byte}"
        raise ValueError(
            f"block_size must be {what} and in {_PACKED_MIN_BLOCK}..{_PACKED_MAX_BLOCK}, got {block_size}")


def _padded_tail(flat: np.ndarray, full: int, size: int) -> np.ndarray:
    """The values after the ``full`` whole blocks of ``flat`` as one row of ``size``, zero-padded."""
    tail = np.zeros((1, size), dtype=np.float32)
    tail[0, :flat.size - full * size] = flat[full * size:]
    return tail


def _encode_packed(flat: np.ndarray, size: int, per_byte: int, quantize: _Quantize,
                   pack: _Pack) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of ``flat`` -> (one fp32 scale a block, codes packed ``per_byte`` a byte).

    ``quantize(rows, scales, codes, count)`` fills one scale per row of blocks and one code per
    value, ``count`` being the real values of each row (less than ``size`` only for a last, shorter
    block, which is zero-padded); ``pack(codes, out)`` packs them. A cache-sized slice of blocks at
    a time; a shorter last block's padding codes are 0.
    """
    n = flat.size
    full = n // size
    nblocks = -(-n // size)
    scales = np.empty(nblocks, dtype="<f4")
    packed = np.empty(-(-n // per_byte), dtype=np.uint8)
    step = max(1, _PACKED_CHUNK_VALUES // size)
    codes = np.empty(min(full, step) * size, dtype=np.uint8)
    for first in range(0, full, step):
        last = min(first + step, full)
        chunk = codes[:(last - first) * size]
        quantize(flat[first * size:last * size].reshape(-1, size), scales[first:last], chunk.reshape(-1, size), size)
        pack(chunk, packed[first * size // per_byte:last * size // per_byte])
    if full < nblocks:
        rest = n - full * size
        tail_codes = np.empty((1, size), dtype=np.uint8)
        quantize(_padded_tail(flat, full, size), scales[full:], tail_codes, rest)
        tail_codes[0, rest:] = 0
        tail_packed = np.empty(size // per_byte, dtype=np.uint8)
        pack(tail_codes[0], tail_packed)
        packed[full * size // per_byte:] = tail_packed[:-(-rest // per_byte)]
    return scales, packed


def _read_packed(name: str, magic: bytes, per_byte: int, payload: bytes | memoryview,
                 num_values: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Check a sub-byte codec's header, exact length and scales; -> (block size, scales, codes).

    The length is checked before anything is allocated; a negative scale (-inf included) is
    refused, NaN and +inf pass: they are an encoder's mark of a non-finite block.
    """
    view = memoryview(payload).cast("B")
    if len(view) < _PACKED_HEAD.size:
        raise CodecError(f"{name} payload shorter than its header")
    got, size = _PACKED_HEAD.unpack_from(view, 0)
    if got != magic:
        raise CodecError(f"{name} payload has bad magic {got!r}, expected {magic!r}")
    if not _PACKED_MIN_BLOCK <= size <= _PACKED_MAX_BLOCK or size % per_byte:
        raise CodecError(f"{name} payload has an invalid block size {size}")
    if num_values < 0:
        raise CodecError(f"{name} cannot decode {num_values} values")
    nblocks = -(-num_values // size)
    expected = _PACKED_HEAD.size + 4 * nblocks + -(-num_values // per_byte)
    if len(view) != expected:
        raise CodecError(f"{name} payload has {len(view)} bytes, expected {expected}")
    scales = np.frombuffer(view, dtype="<f4", count=nblocks, offset=_PACKED_HEAD.size)
    if (scales < 0).any():
        raise CodecError(f"{name} payload has a negative scale")
    packed = np.frombuffer(view, dtype=np.uint8, offset=_PACKED_HEAD.size + 4 * nblocks)
    return size, scales, packed


def _decode_packed(packed: np.ndarray, scales: np.ndarray, size: int, num_values: int,
                   byte_levels: np.ndarray) -> torch.Tensor:
    """Packed codes -> levels (``byte_levels[byte]``: the byte's levels, lowest bits first) times
    their block's scale, a cache-sized slice of blocks at a time."""
    per_byte = byte_levels.shape[1]
    out = np.empty(per_byte * packed.size, dtype=np.float32)
    full = num_values // size
    step = max(1, _PACKED_CHUNK_VALUES // size)
    # NaN or +inf scales (the encoder's mark of a non-finite block) and huge scales times a level
    # decode to non-finite values, which the caller refuses (``decode_fragment``: NON_FINITE).
    with np.errstate(over="ignore", invalid="ignore"):
        for first in range(0, full, step):
            last = min(first + step, full)
            rows = out[first * size:last * size].reshape(-1, size)
            np.take(byte_levels, packed[first * size // per_byte:last * size // per_byte], axis=0,
                    out=rows.reshape(-1, per_byte))
            rows *= scales[first:last, None]
        if full < scales.size:
            tail = out[full * size:]
            np.take(byte_levels, packed[full * size // per_byte:], axis=0, out=tail.reshape(-1, per_byte))
            tail *= scales[full]
    return torch.from_numpy(out[:num_values])


_I4_LEVELS = 7  # levels -7..7; a level q travels as the 4-bit code q + 8, so code 0 never occurs


def _int4_tables() -> np.ndarray:
    """Per packed byte: its two levels as fp32 (first value in the low nibble)."""
    byte = np.arange(256, dtype=np.int32)
    low, high = byte & 0xF, byte >> 4
    return np.stack([low - 8, high - 8], axis=1).astype(np.float32)


_I4_PAIR_LEVELS = _int4_tables()


def _quantize4(blocks: np.ndarray, scales: np.ndarray, codes: np.ndarray, count: int) -> None:
    """Rows of ``blocks`` -> their scales (max|x|/7) and 4-bit codes round(x/scale) + 8, in place.
    (``count`` is unused: a zero-padded row has the same max|x|.)"""
    work = np.abs(blocks)
    np.maximum.reduce(work, axis=1, out=scales)  # ~10x faster than np.max on rows this short
    scales /= np.float32(_I4_LEVELS)
    safe = np.where(scales > 0, scales, np.float32(1.0))
    with np.errstate(invalid="ignore"):  # non-finite inputs: see below
        np.divide(blocks, safe[:, None], out=work)
        np.rint(work, out=work)  # half to even; |x/scale| <= 7 up to rounding of a subnormal scale
        np.clip(work, -_I4_LEVELS, _I4_LEVELS, out=work)
        work += np.float32(8.0)
        np.copyto(codes, work, casting="unsafe")
    finite = np.isfinite(scales)
    if not finite.all():
        # A block holding NaN or inf keeps its non-finite scale (NaN or +inf) and level-0 codes, so
        # it decodes to non-finite values, which the receiving side refuses, like every codec's.
        codes[~finite] = 8


def _pack_nibbles(codes: np.ndarray, out: np.ndarray) -> None:
    """An even number of 4-bit codes (uint8) -> ``out``, two a byte, the first in the low nibble."""
    pairs = codes.view(np.uint16)  # little-endian: the first code in the low byte
    merged = pairs >> np.uint16(4)
    merged |= pairs
    np.copyto(out, merged, casting="unsafe")  # keeps the low byte: both codes


@dataclass(frozen=True)
class Int4BlockCodec:
    """Symmetric 4-bit levels -7..7 per block of ``block_size`` values, one fp32 scale (max|x|/7)
    per block; two codes a byte.

    Layout (little-endian): header ``<2sI`` = b"I4", block size; one fp32 scale per block; then the
    codes, ``ceil(n / 2)`` bytes, value ``2i`` in the low nibble of byte ``i`` and value ``2i + 1``
    in its high nibble. A code is the level plus 8 (1..15); 0 is never written, and an odd count's
    padding nibble is 0. Wire size: ``6 + 4 * ceil(n / B) + ceil(n / 2)`` bytes, 0.5625 bytes a value
    at the default B = 64 (7.1x smaller than fp32).

    Rounding is to the nearest level (|error| <= scale / 2, scales in fp32's normal range); what it
    drops is meant to be carried by ``ErrorFeedback``, so there is no stochastic rounding. The scale
    is fp32, not fp16: fp16 would save 2 bytes a block (6% at B = 64) but flushes the scale of a
    block of outer gradients below 6e-8 * 7 to zero and rounds the rest to 11 bits, an error that
    would then be added to every value of the block.
    """

    block_size: int = 64

    name: ClassVar[str] = "int4_block"
    lossless: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_packed_block(self.block_size, 2)

    def encode(self, values: torch.Tensor) -> bytes:
        flat = _as_flat_fp32(values).numpy()
        scales, packed = _encode_packed(flat, self.block_size, 2, _quantize4, _pack_nibbles)
        return b"".join([_PACKED_HEAD.pack(b"I4", self.block_size), scales.data, packed.data])

    def quantization_step(self, values: torch.Tensor) -> torch.Tensor:
        """Per-value quantisation step (the block's scale) for ``values``."""
        return _block_steps(values, self.block_size, float(_I4_LEVELS))

    def decode(self, payload: bytes | memoryview, num_values: int) -> torch.Tensor:
        size, scales, packed = _read_packed(self.name, b"I4", 2, payload, num_values)
        whole = num_values // 2
        pairs = packed[:whole]  # code 0 in either nibble: a low nibble of 0, or a byte below 16
        if np.bitwise_and(pairs, np.uint8(0xF)).min(initial=1) == 0 or pairs.min(initial=16) < 16:
            raise CodecError("int4_block payload holds an invalid code (0)")
        if num_values & 1 and not (packed[-1] & 0xF and packed[-1] >> 4 == 0):
            raise CodecError("int4_block payload has an invalid last code or a non-zero padding nibble")
        return _decode_packed(packed, scales, size, num_values, _I4_PAIR_LEVELS)

    def max_encoded_bytes(self, num_values: int) -> int:
        # The transfer header does not carry this codec's block size (the payload does), so the
        # bound holds for any block size a sender may pick: the smallest has the most scales.
        return _PACKED_HEAD.size + 4 * (-(-num_values // _PACKED_MIN_BLOCK)) + (num_values + 1) // 2


# Lloyd-Max quantiser of a unit Gaussian with 4 levels (J. Max, "Quantizing for minimum
# distortion", IRE Trans. Information Theory, 1960): levels +-0.4528 and +-1.510 (1.5104), decision
# thresholds 0 and +-0.9816 (the midpoints), mean squared error 0.1175.
_I2_INNER, _I2_OUTER, _I2_THRESHOLD = 0.4528, 1.5104, 0.9816
_I2_LEVELS = np.array([-_I2_OUTER, -_I2_INNER, _I2_INNER, _I2_OUTER], dtype=np.float32)
_I2_BYTE_LEVELS = _I2_LEVELS[(np.arange(256)[:, None] >> np.arange(0, 8, 2)) & 3]  # 4 levels a byte
_FP32_TINY = float(np.finfo(np.float32).tiny)


def _block_rms(blocks: np.ndarray, out: np.ndarray, count: int) -> None:
    """Root mean square of each row of ``blocks`` over ``count`` values (the rest of a row is zero
    padding) -> ``out`` (fp32).

    The sum of squares is fp32, except for rows where it overflows or falls below fp32's normal
    range (all-zero rows included): those are summed again in fp64, so a finite block never gets an
    infinite scale, nor a block of tiny values a zero one. A row holding NaN or inf gets NaN or +inf.
    """
    np.einsum("ij,ij->i", blocks, blocks, out=out)  # several times faster than square, then sum
    redo = ~((out >= _FP32_TINY) & (out < np.inf))  # NaN included
    wide = blocks[redo].astype(np.float64) if redo.any() else None
    out /= np.float32(count)
    np.sqrt(out, out=out)
    if wide is not None:
        out[redo] = np.sqrt(np.einsum("ij,ij->i", wide, wide) / count)  # <= max|x|: fits in fp32


def _quantize2(blocks: np.ndarray, scales: np.ndarray, codes: np.ndarray, count: int) -> None:
    """Rows of ``blocks`` -> their scales (RMS over ``count`` values) and 2-bit codes, in place: the
    number of thresholds -0.9816 s, 0, 0.9816 s the value lies above (0..3)."""
    _block_rms(blocks, scales, count)
    high = scales * np.float32(_I2_THRESHOLD)
    above = np.empty_like(codes)
    with np.errstate(invalid="ignore"):  # NaN scales: every comparison is false
        np.greater(blocks, -high[:, None], out=codes.view(np.bool_))
        np.greater(blocks, np.float32(0.0), out=above.view(np.bool_))
        codes += above
        np.greater(blocks, high[:, None], out=above.view(np.bool_))
        codes += above


def _pack_crumbs(codes: np.ndarray, out: np.ndarray) -> None:
    """A multiple of 4 of 2-bit codes (uint8) -> ``out``, four a byte, the first in the lowest bits."""
    quads = codes.view(np.uint32)  # little-endian: code k of four in bits 8k..8k+1
    merged = quads >> np.uint32(6)  # code 1 to bits 2..3
    merged |= quads
    moved = quads >> np.uint32(12)  # code 2 to bits 4..5
    merged |= moved
    np.right_shift(quads, np.uint32(18), out=moved)  # code 3 to bits 6..7
    merged |= moved
    np.copyto(out, merged, casting="unsafe")  # keeps the low byte: the four codes


@dataclass(frozen=True)
class Int2BlockCodec:
    """2-bit codes per block of ``block_size`` values: the four levels of the Lloyd-Max quantiser
    for a Gaussian, -1.510, -0.4528, +0.4528, +1.510 times the block's RMS sigma (one fp32 scale a
    block); four codes a byte.

    Layout (little-endian): header ``<2sI`` = b"I2", block size; one fp32 scale (sigma) per block;
    then the codes, ``ceil(n / 4)`` bytes, value ``4i + k`` in bits ``2k..2k+1`` of byte ``i`` (the
    first value in the lowest bits). Code c stands for level c of the four above; all four are
    valid. A count that is not a multiple of 4 pads the last byte with 0 codes, and decoding refuses
    non-zero padding bits. Block sizes are multiples of 4 in 8..2**20. Wire size:
    ``6 + 4 * ceil(n / B) + ceil(n / 4)`` bytes, 0.3125 bytes a value at the default B = 64
    (12.8x smaller than fp32).

    Scale and levels: sigma is the root mean square of the block's values (of its real values only
    for a last, shorter block). The code is the number of decision thresholds -0.9816 sigma, 0,
    +0.9816 sigma that the value exceeds (strictly), i.e. the nearest level. For Gaussian values
    this is the minimum mean squared error quantiser with 4 levels (J. Max, "Quantizing for minimum
    distortion", IRE Trans. Information Theory, 1960), error 0.1175 sigma^2; an absmax scale would
    spend the outer levels on the block's one extreme value. Values within +-1.5104 sigma are
    reconstructed within half of ``quantization_step`` (0.5288 sigma); outliers beyond are clipped
    to +-1.5104 sigma, an error of |x| - 1.5104 sigma (at most (sqrt(B) - 1.51) sigma). That error
    is large, so the codec is only for outer gradients with ``ErrorFeedback``, which carries what a
    round drops into the next contribution of the same fragment; a clipped value is sent at
    1.51 sigma a round until its residual is spent.

    Non-finite input: a block holding NaN or inf gets a NaN or +inf scale and decodes to non-finite
    values (whatever its codes), which the receiving side refuses, like every codec's. The scale's
    sum of squares is fp32, redone in fp64 for a block where fp32 would overflow or underflow, so a
    finite block's scale is finite; a scale above fp32's max / 1.5104 still decodes to inf.
    """

    block_size: int = 64

    name: ClassVar[str] = "int2_block"
    lossless: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_packed_block(self.block_size, 4)

    def encode(self, values: torch.Tensor) -> bytes:
        flat = _as_flat_fp32(values).numpy()
        scales, packed = _encode_packed(flat, self.block_size, 4, _quantize2, _pack_crumbs)
        return b"".join([_PACKED_HEAD.pack(b"I2", self.block_size), scales.data, packed.data])

    def sigma(self, values: torch.Tensor) -> torch.Tensor:
        """Per-value scale sigma (the RMS of the value's block) for ``values``, as ``encode`` sets it."""
        flat = _as_flat_fp32(values).numpy()
        n, size = flat.size, self.block_size
        full = n // size
        sigma = np.empty(-(-n // size), dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            _block_rms(flat[:full * size].reshape(full, size), sigma[:full], size)
            if full < sigma.size:
                _block_rms(_padded_tail(flat, full, size), sigma[full:], n - full * size)
        return torch.from_numpy(np.repeat(sigma, size)[:n])

    def quantization_step(self, values: torch.Tensor) -> torch.Tensor:
        """Per-value step (1.5104 - 0.4528) sigma = 1.0576 sigma, sigma the RMS of the value's block:
        the distance between an inner and an outer level. Every value within +-1.5104 sigma
        decodes within half of it; a value beyond is clipped to +-1.5104 sigma, so its error is
        |x| - 1.5104 sigma, not bounded by the step (``ErrorFeedback`` carries it)."""
        return self.sigma(values) * float(np.float32(_I2_OUTER) - np.float32(_I2_INNER))

    def decode(self, payload: bytes | memoryview, num_values: int) -> torch.Tensor:
        size, scales, packed = _read_packed(self.name, b"I2", 4, payload, num_values)
        if num_values % 4 and packed[-1] >> (2 * (num_values % 4)):
            raise CodecError("int2_block payload has non-zero padding bits in its last code byte")
        return _decode_packed(packed, scales, size, num_values, _I2_BYTE_LEVELS)

    def max_encoded_bytes(self, num_values: int) -> int:
        # As for int4_block: the smallest block size a sender may pick has the most scales.
        return _PACKED_HEAD.size + 4 * (-(-num_values // _PACKED_MIN_BLOCK)) + (num_values + 3) // 4


CodecName = Literal["fp32", "bf16_zstd", "int8_block", "int4_block", "int2_block"]
CODEC_NAMES: tuple[str, ...] = get_args(CodecName)


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
