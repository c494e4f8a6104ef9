"""Payload codecs: flat fp32 values in, bytes out, and back.

Three codecs behind one interface (``encode(values) -> bytes``, ``decode(payload, n) -> values``):

- ``fp32``: raw little-endian fp32, lossless, the baseline.
- ``bf16_zstd``: round to bfloat16 (round-to-nearest-even), then split each 16-bit value into an
  *exponent* byte plane and a *sign+mantissa* byte plane. Parameters and outer gradients span a
  narrow range of magnitudes, so the exponent plane holds few distinct values and zstd shrinks it
  about 2.8x, while the mantissa bits are close to uniform noise: compressing them costs time and
  gains nothing, so a plane is kept raw unless a sample of it compresses. This bit-level split
  (rather than plain high/low byte shuffling) puts all eight exponent bits in one byte; measured
  on N(0, 0.02) weights it raises the lossless ratio over bf16 from about 1.3x to about 1.47x.
  The payload is cut into independent blocks that a thread pool encodes and decodes in parallel
  (numpy, torch and zstd release the GIL).
- ``int8_block``: symmetric int8 with one fp32 scale per block of values (lossy, 3.9x smaller
  than fp32); pair it with ``ErrorFeedback`` so quantisation error is carried, not lost.

Lossy codecs never see anything but fp32 outer gradients or parameters; the codec is chosen per
transfer and named in its header.
"""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

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


_BZ_MAGIC = b"BZ\x01"
_BZ_HEAD = struct.Struct("<3sII")  # magic+version, values per block, number of blocks
_BZ_BLOCK = struct.Struct("<BBII")  # exponent mode, sign/mantissa mode, their encoded lengths
_RAW, _ZSTD = 0, 1
_SAMPLE = 64 * 1024


def _exponent_and_mantissa_planes(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bit patterns (uint16) -> (exponent byte plane, sign|mantissa byte plane)."""
    exponent = (bits >> 7).astype(np.uint8)  # drops the sign bit: uint8 keeps the low 8 bits
    sign_mantissa = ((bits >> 8) & 0x80).astype(np.uint8)
    sign_mantissa |= (bits & 0x7F).astype(np.uint8)
    return exponent, sign_mantissa


def _join_planes(exponent: np.ndarray, sign_mantissa: np.ndarray) -> np.ndarray:
    bits = exponent.astype(np.uint16) << 7
    sm = sign_mantissa.astype(np.uint16)
    bits |= sm & 0x7F
    bits |= (sm & 0x80) << 8
    return bits


@dataclass
class Bf16ZstdCodec:
    """bf16 rounding + exponent/mantissa byte planes + zstd, block-parallel."""

    level: int = 1
    """zstd level; 1 is the fastest level that keeps the exponent plane's full ratio."""
    threads: int = 2
    """Worker threads for block-parallel encode/decode (1 = in the caller's thread)."""
    block_values: int = 1 << 21
    """Values per independently coded block (2 Mi values = 8 MiB of fp32)."""

    name: ClassVar[str] = "bf16_zstd"
    lossless: ClassVar[bool] = False
    _pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not -7 <= self.level <= 22:
            raise ValueError(f"zstd level must be in -7..22, got {self.level}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.block_values < 1024:
            raise ValueError(f"block_values must be >= 1024, got {self.block_values}")

    def _map(self, fn, items):  # type: ignore[no-untyped-def]
        if self.threads == 1 or len(items) == 1:
            return [fn(i) for i in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ddiloco-codec")
        return list(self._pool.map(fn, items))

    def _compress_plane(self, plane: np.ndarray, always_try: bool) -> tuple[int, bytes]:
        raw = plane.tobytes()
        if not raw:
            return _RAW, raw
        compressor = zstandard.ZstdCompressor(level=self.level)
        if not always_try and len(raw) > 4 * _SAMPLE:
            probe = compressor.compress(raw[:_SAMPLE])
            if len(probe) > 0.97 * _SAMPLE:
                return _RAW, raw
        packed = compressor.compress(raw)
        return (_ZSTD, packed) if len(packed) < len(raw) else (_RAW, raw)

    def encode(self, values: torch.Tensor) -> bytes:
        flat = _as_flat_fp32(values)
        n = flat.numel()
        bits = flat.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        bounds = [(s, min(s + self.block_values, n)) for s in range(0, n, self.block_values)]

        def one(bound: tuple[int, int]) -> bytes:
            exponent, sign_mantissa = _exponent_and_mantissa_planes(bits[bound[0]:bound[1]])
            e_mode, e_bytes = self._compress_plane(exponent, always_try=True)
            m_mode, m_bytes = self._compress_plane(sign_mantissa, always_try=False)
            return _BZ_BLOCK.pack(e_mode, m_mode, len(e_bytes), len(m_bytes)) + e_bytes + m_bytes

        blocks = self._map(one, bounds)
        return b"".join([_BZ_HEAD.pack(_BZ_MAGIC, self.block_values, len(blocks)), *blocks])

    def decode(self, payload: bytes | memoryview, num_values: int) -> torch.Tensor:
        view = memoryview(payload)
        if len(view) < _BZ_HEAD.size:
            raise CodecError("bf16_zstd payload shorter than its header")
        magic, block_values, nblocks = _BZ_HEAD.unpack_from(view, 0)
        if magic != _BZ_MAGIC:
            raise CodecError(f"bf16_zstd payload has bad magic {magic!r}")
        expected_blocks = -(-num_values // block_values) if block_values else -1
        if block_values < 1 or nblocks != expected_blocks:
            raise CodecError(f"bf16_zstd payload has {nblocks} blocks, expected {expected_blocks}")
        spans = []
        pos = _BZ_HEAD.size
        for b in range(nblocks):
            if pos + _BZ_BLOCK.size > len(view):
                raise CodecError("bf16_zstd payload truncated in a block header")
            e_mode, m_mode, e_len, m_len = _BZ_BLOCK.unpack_from(view, pos)
            pos += _BZ_BLOCK.size
            count = min(block_values, num_values - b * block_values)
            if pos + e_len + m_len > len(view):
                raise CodecError("bf16_zstd payload truncated in block data")
            spans.append((b * block_values, count, e_mode, view[pos:pos + e_len], m_mode,
                          view[pos + e_len:pos + e_len + m_len]))
            pos += e_len + m_len
        if pos != len(view):
            raise CodecError(f"bf16_zstd payload has {len(view) - pos} trailing bytes")
        bits = np.empty(num_values, dtype=np.uint16)

        def plane(mode: int, data: memoryview, count: int) -> np.ndarray:
            try:
                raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=count) if mode == _ZSTD else data
            except zstandard.ZstdError as exc:
                raise CodecError(f"bf16_zstd block does not decompress: {exc}") from exc
            if mode not in (_RAW, _ZSTD) or len(raw) != count:
                raise CodecError("bf16_zstd block has a wrong plane size or mode")
            return np.frombuffer(raw, dtype=np.uint8)

        def one(span) -> None:  # type: ignore[no-untyped-def]
            start, count, e_mode, e_data, m_mode, m_data = span
            bits[start:start + count] = _join_planes(plane(e_mode, e_data, count), plane(m_mode, m_data, count))

        self._map(one, spans)
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()

    def max_encoded_bytes(self, num_values: int) -> int:
        # A plane is stored raw whenever zstd would not shrink it, so it never exceeds 1 byte/value.
        nblocks = max(1, -(-num_values // self.block_values))
        return _BZ_HEAD.size + nblocks * _BZ_BLOCK.size + 2 * num_values


_I8_HEAD = struct.Struct("<2sI")


@dataclass(frozen=True)
class Int8BlockCodec:
    """Symmetric int8 per block of ``block_size`` values, one fp32 scale (max|x|/127) per block."""

    block_size: int = 256

    name: ClassVar[str] = "int8_block"
    lossless: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not 8 <= self.block_size <= 1 << 20:
            raise ValueError(f"block_size must be in 8..{1 << 20}, got {self.block_size}")

    def encode(self, values: torch.Tensor) -> bytes:
        flat = _as_flat_fp32(values)
        n = flat.numel()
        nblocks = -(-n // self.block_size)
        padded = torch.zeros(nblocks * self.block_size, dtype=torch.float32)
        padded[:n] = flat
        blocks = padded.view(nblocks, self.block_size)
        scales = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
        return _I8_HEAD.pack(b"I8", self.block_size) + scales.numpy().astype("<f4").tobytes() + q.numpy().tobytes()

    def quantization_step(self, values: torch.Tensor) -> torch.Tensor:
        """Per-value quantisation step (the block's scale) for ``values``."""
        flat = _as_flat_fp32(values)
        n = flat.numel()
        nblocks = -(-n // self.block_size)
        padded = torch.zeros(nblocks * self.block_size, dtype=torch.float32)
        padded[:n] = flat.abs()
        scales = padded.view(nblocks, self.block_size).amax(dim=1) / 127.0
        return scales.repeat_interleave(self.block_size)[:n]

    def decode(self, payload: bytes | memoryview, num_values: int) -> torch.Tensor:
        view = memoryview(payload)
        if len(view) < _I8_HEAD.size:
            raise CodecError("int8_block payload shorter than its header")
        magic, block_size = _I8_HEAD.unpack_from(view, 0)
        if magic != b"I8" or block_size < 1:
            raise CodecError("int8_block payload has a bad header")
        nblocks = -(-num_values // block_size)
        expected = _I8_HEAD.size + 4 * nblocks + num_values
        if len(view) != expected:
            raise CodecError(f"int8_block payload has {len(view)} bytes, expected {expected}")
        scales = torch.from_numpy(np.frombuffer(view, dtype="<f4", count=nblocks, offset=_I8_HEAD.size).copy())
        q = torch.from_numpy(np.frombuffer(view, dtype=np.int8, offset=_I8_HEAD.size + 4 * nblocks).copy())
        padded = torch.zeros(nblocks * block_size, dtype=torch.float32)
        padded[:num_values] = q.float()
        return (padded.view(nblocks, block_size) * scales[:, None]).reshape(-1)[:num_values].contiguous()

    def max_encoded_bytes(self, num_values: int) -> int:
        return _I8_HEAD.size + 4 * (-(-num_values // self.block_size)) + num_values


CODEC_NAMES = ("fp32", "bf16_zstd", "int8_block")


def make_codec(name: str, *, zstd_level: int = 1, threads: int = 2, int8_block: int = 256) -> Codec:
    """Build a codec by its name (one of ``CODEC_NAMES``)."""
    if name == "fp32":
        return Fp32Codec()
    if name == "bf16_zstd":
        return Bf16ZstdCodec(level=zstd_level, threads=threads)
    if name == "int8_block":
        return Int8BlockCodec(block_size=int8_block)
    raise CodecError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}")
