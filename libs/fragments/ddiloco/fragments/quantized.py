"""The quantising codecs: fp32 values in, a few bits a value out, one fp32 scale per block.

- ``int8_block``: symmetric int8 with one fp32 scale (max|x|/127) per block of values (lossy,
  3.9x smaller than fp32); pair it with ``ErrorFeedback`` so quantisation error is carried, not
  lost.
- ``int4_block``: symmetric levels -7..7 (4 bits, two a byte) with one fp32 scale per block of 64
  values (lossy, 0.5625 bytes a value, 7.1x smaller than fp32); only with ``ErrorFeedback``.
- ``int2_block``: the four Lloyd-Max levels of a Gaussian (+-0.4528, +-1.510 times the block's RMS;
  J. Max, "Quantizing for minimum distortion", 1960; 2 bits, four a byte) with one fp32 scale per
  block of 64 values (lossy, 0.3125 bytes a value, 12.8x smaller than fp32); only with
  ``ErrorFeedback``, which carries the clipped outliers.

They share the ``Codec`` interface of ``ddiloco.fragments.codec`` (which builds them by name) and
its strictness: a payload of the wrong length, a bad header or non-zero padding raises
``CodecError``; non-finite scales decode as non-finite values, which the receiver refuses.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ddiloco.fragments.errors import CodecError


def flat_fp32(values: torch.Tensor) -> torch.Tensor:
    """``values`` as one contiguous CPU fp32 vector; anything but fp32 is refused."""
    if values.dtype != torch.float32:
        raise CodecError(f"codecs take fp32 values, got {values.dtype}")
    return values.detach().reshape(-1).contiguous().cpu()


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
    flat = flat_fp32(values)
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
        flat = flat_fp32(values).numpy()
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

    def decode(self, payload: bytes | bytearray | memoryview, num_values: int) -> torch.Tensor:
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


def _read_packed(name: str, magic: bytes, per_byte: int, payload: bytes | bytearray | memoryview,
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
        flat = flat_fp32(values).numpy()
        scales, packed = _encode_packed(flat, self.block_size, 2, _quantize4, _pack_nibbles)
        return b"".join([_PACKED_HEAD.pack(b"I4", self.block_size), scales.data, packed.data])

    def quantization_step(self, values: torch.Tensor) -> torch.Tensor:
        """Per-value quantisation step (the block's scale) for ``values``."""
        return _block_steps(values, self.block_size, float(_I4_LEVELS))

    def decode(self, payload: bytes | bytearray | memoryview, num_values: int) -> torch.Tensor:
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
        flat = flat_fp32(values).numpy()
        scales, packed = _encode_packed(flat, self.block_size, 4, _quantize2, _pack_crumbs)
        return b"".join([_PACKED_HEAD.pack(b"I2", self.block_size), scales.data, packed.data])

    def sigma(self, values: torch.Tensor) -> torch.Tensor:
        """Per-value scale sigma (the RMS of the value's block) for ``values``, as ``encode`` sets it."""
        flat = flat_fp32(values).numpy()
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

    def decode(self, payload: bytes | bytearray | memoryview, num_values: int) -> torch.Tensor:
        size, scales, packed = _read_packed(self.name, b"I2", 4, payload, num_values)
        if num_values % 4 and packed[-1] >> (2 * (num_values % 4)):
            raise CodecError("int2_block payload has non-zero padding bits in its last code byte")
        return _decode_packed(packed, scales, size, num_values, _I2_BYTE_LEVELS)

    def max_encoded_bytes(self, num_values: int) -> int:
        # As for int4_block: the smallest block size a sender may pick has the most scales.
        return _PACKED_HEAD.size + 4 * (-(-num_values // _PACKED_MIN_BLOCK)) + (num_values + 3) // 4
