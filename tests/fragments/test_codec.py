"""Codecs: exact round trips against torch's own rounding, strict decoding, the bf16_zstd format.

References: ``fp32`` must be bit-exact; ``bf16_zstd`` must reproduce ``tensor.to(torch.bfloat16)``
(round-to-nearest-even) bit for bit, NaN, infinities, zeros and subnormals included; ``int8_block``
must land within half a quantisation step (the block's max|x|/127) of every value. The bf16_zstd
payload layout is pinned by an independent, deliberately naive decoder written from the format
description in ``ddiloco.fragments.codec`` (``_reference_decode`` below).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.fragments.codec import (
    CODEC_NAMES,
    Bf16ZstdCodec,
    Fp32Codec,
    Int8BlockCodec,
    lend_or_encode,
    make_codec,
)
from ddiloco.fragments.errors import CodecError

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SCALES = [1e-30, 1e-6, 0.02, 1.0, 1e4, 1e30]


@st.composite
def tensors(draw, *, scales=SCALES, outlier_rates=(0.0, 0.01, 0.2), max_dim=40):  # type: ignore[no-untyped-def]
    """Random tensors of random shape (0-d and empty included), dtype and layout, as fp32."""
    shape = tuple(draw(st.lists(st.integers(0, max_dim), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from(scales))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    # Exact zeros and far outliers exercise the zero code, escapes and the plain-exponent fallback.
    zeros, outliers = draw(st.sampled_from([0.0, 0.1, 0.6])), draw(st.sampled_from(outlier_rates))
    values[torch.rand(shape, generator=gen) < zeros] = 0.0
    far = torch.rand(shape, generator=gen) < outliers
    values[far] *= torch.where(torch.rand(shape, generator=gen) < 0.5, 1e-9, 1e9)[far].double()
    values = values.to(dtype)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and values.dim() >= 2:
        values = values.transpose(0, 1)
    elif layout == "strided" and values.dim() >= 1:
        values = values[::2]
    return values.float()  # codecs take fp32; the tensor may stay non-contiguous


def _bits32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.int32)


def _bf16_bits(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFF for v in t.reshape(-1).contiguous().to(torch.bfloat16).view(torch.int16).tolist()]


def _special_values() -> torch.Tensor:
    """Every awkward bf16 case: signed zeros, subnormals, overflow to inf, NaN, ties to even."""
    vals = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38,
            1e-40, -1e-40, 1e-45, 1.1754944e-38, 9.2e-41, 2.0**-126, 2.0**-133,
            1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20, 3.3961776e38]
    return torch.tensor(vals, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(values=tensors())
def test_fp32_round_trip_is_bit_exact(values: torch.Tensor) -> None:
    codec = Fp32Codec()
    payload = codec.encode(values)
    assert len(payload) == 4 * values.numel() == codec.max_encoded_bytes(values.numel())
    out = codec.decode(payload, values.numel())
    assert out.dtype == torch.float32 and out.shape == (values.numel(),)
    assert torch.equal(_bits32(out), _bits32(values))


@SETTINGS
@given(values=tensors(), threads=st.sampled_from([1, 2]), level=st.sampled_from([1, 3]))
def test_bf16_zstd_equals_torch_bf16_rounding(values: torch.Tensor, threads: int, level: int) -> None:
    # Small blocks so that most examples span several independently coded blocks.
    codec = Bf16ZstdCodec(level=level, threads=threads, block_values=1024)
    payload = codec.encode(values)
    assert len(payload) <= codec.max_encoded_bytes(values.numel())
    out = codec.decode(payload, values.numel())
    assert out.dtype == torch.float32 and out.shape == (values.numel(),)
    expected = values.reshape(-1).to(torch.bfloat16).float()
    assert torch.equal(_bits32(out), _bits32(expected))


def test_bf16_zstd_special_values_match_torch() -> None:
    codec = Bf16ZstdCodec(block_values=1024)
    special = _special_values()
    # Alone, and scattered through a block of ordinary weights (escapes, zeros, the fallback).
    weights = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 0.02
    weights[::7] = 0.0
    weights[3::97] = special.repeat(3)[: weights[3::97].numel()]
    for values in (special, weights):
        out = codec.decode(codec.encode(values), values.numel())
        assert torch.equal(_bits32(out), _bits32(values.to(torch.bfloat16).float()))


def test_bf16_zstd_larger_than_a_default_block_with_threads() -> None:
    codec = Bf16ZstdCodec(threads=2)
    n = 2 * codec.block_values + 12345
    values = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 0.02
    interleaved = torch.zeros(n, 2)
    interleaved[:, 0] = values
    payload = codec.encode(interleaved[:, 0])  # a non-contiguous view of the same values
    out = codec.decode(payload, n)
    assert torch.equal(_bits32(out), _bits32(values.to(torch.bfloat16).float()))
    assert _block_modes(payload)[0][0] == 3  # exponent codes: nibbles, zstd-compressed


def test_bf16_zstd_concurrent_callers_share_workers_safely() -> None:
    """Codecs share worker threads and per-thread scratch buffers; callers must not see each other."""
    from concurrent.futures import ThreadPoolExecutor

    inputs = [torch.randn(5 * 1024 + k, generator=torch.Generator().manual_seed(k)) * 10.0**-k for k in range(8)]

    def round_trip(values: torch.Tensor) -> bool:
        codec = Bf16ZstdCodec(threads=2, block_values=1024)
        ok = True
        for _ in range(5):
            out = codec.decode(codec.encode(values), values.numel())
            ok &= torch.equal(_bits32(out), _bits32(values.to(torch.bfloat16).float()))
        return ok

    with ThreadPoolExecutor(4) as callers:
        assert all(callers.map(round_trip, inputs))


def test_bf16_zstd_lossless_stage_ratio_on_weights() -> None:
    """The brief's target: >= 1.4x over bf16 bytes on N(0, 0.02) weights."""
    n = 1 << 20
    values = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.02
    payload = Bf16ZstdCodec().encode(values)
    assert 2 * n / len(payload) >= 1.4


@pytest.mark.parametrize("kind", ["random_bits", "wide_exponents", "all_zero", "constant", "escapes"])
def test_bf16_zstd_size_bound_holds_for_adversarial_inputs(kind: str) -> None:
    gen = torch.Generator().manual_seed(4)
    n = 3 * 1024 + 17
    if kind == "random_bits":
        bits = torch.randint(0, 2**31 - 1, (n,), generator=gen, dtype=torch.int32)
        values = bits.view(torch.float32).nan_to_num(0.0)
    elif kind == "wide_exponents":
        values = torch.ldexp(torch.ones(n), torch.randint(-120, 120, (n,), generator=gen))
    elif kind == "all_zero":
        values = torch.zeros(n)
    elif kind == "constant":
        values = torch.full((n,), 0.125)
    else:  # about 1/40 of values far below the block's largest exponent: just over the escape cap
        values = torch.randn(n, generator=gen) * 0.02
        values[::40] *= 1e-9
    codec = Bf16ZstdCodec(block_values=1024)
    payload = codec.encode(values)
    assert len(payload) <= codec.max_encoded_bytes(n)
    assert torch.equal(_bits32(codec.decode(payload, n)), _bits32(values.to(torch.bfloat16).float()))


@SETTINGS
@given(values=tensors(scales=[1e-6, 0.02, 1.0, 1e4], outlier_rates=[0.0]), block=st.sampled_from([8, 64, 256, 1000]))
def test_int8_block_within_half_a_step(values: torch.Tensor, block: int) -> None:
    codec = Int8BlockCodec(block_size=block)
    payload = codec.encode(values)
    assert len(payload) == codec.max_encoded_bytes(values.numel())
    out = codec.decode(payload, values.numel())
    flat = values.reshape(-1)
    step = codec.quantization_step(flat)
    # Half a step from rounding to the nearest level, plus fp32 rounding of x/s and q*s.
    tolerance = 0.5 * step * (1 + 1e-5) + flat.abs() * 2.0**-22
    assert bool(((out - flat).abs() <= tolerance).all())


def test_int8_block_step_is_per_block() -> None:
    codec = Int8BlockCodec(block_size=8)
    values = torch.cat([torch.full((8,), 1.0), torch.full((8,), 1000.0)])
    values[0], values[8] = 127.0, 127000.0
    step = codec.quantization_step(values)
    assert torch.equal(step, torch.tensor([1.0] * 8 + [1000.0] * 8))


def test_decoded_buffers_are_writable_and_independent() -> None:
    values = torch.randn(3000)
    for codec in (Fp32Codec(), Bf16ZstdCodec(block_values=1024), Int8BlockCodec()):
        payload = codec.encode(values)
        first = codec.decode(payload, values.numel())
        expected = first.clone()
        first += 1.0  # must not fail on a read-only buffer, nor alter what the payload decodes to
        assert torch.equal(codec.decode(payload, values.numel()), expected)


# ---------------------------------------------------------------------------------------------
# Strict decoding
# ---------------------------------------------------------------------------------------------

CODECS = [Fp32Codec(), Bf16ZstdCodec(block_values=1024), Int8BlockCodec(block_size=64)]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_truncated_or_padded_payload_raises_codec_error(codec) -> None:  # type: ignore[no-untyped-def]
    n = 2500
    payload = codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(5)))
    for cut in sorted({0, 1, 5, 11, 20, len(payload) // 2, len(payload) - 1}):
        with pytest.raises(CodecError):
            codec.decode(payload[:cut], n)
    with pytest.raises(CodecError):
        codec.decode(payload + b"\x00", n)
    for wrong_n in (n - 1, n + 1, n + 5000):
        with pytest.raises(CodecError):
            codec.decode(payload, wrong_n)


@pytest.mark.parametrize("codec", CODECS[1:], ids=lambda c: c.name)
def test_corrupted_header_bytes_raise_codec_error(codec) -> None:  # type: ignore[no-untyped-def]
    n = 2500
    payload = bytearray(codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(6))))
    header_len = 11 if codec.name == "bf16_zstd" else 6
    for pos in range(header_len):
        bad = bytearray(payload)
        bad[pos] ^= 0xFF
        with pytest.raises(CodecError):
            codec.decode(bytes(bad), n)


def test_bf16_zstd_corrupted_block_headers_raise_codec_error() -> None:
    codec = Bf16ZstdCodec(block_values=1024)
    n = 3000
    payload = codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(7)) * 0.02)
    block = 11  # first block header: modes, emax, reserved, escapes, lengths
    for offset, value in [(0, 9), (1, 7), (3, 1), (4, 0xFF), (8, 0xFF), (12, 0xFF), (11, 0x40), (15, 0x40)]:
        bad = bytearray(payload)
        bad[block + offset] = value
        with pytest.raises(CodecError):
            codec.decode(bytes(bad), n)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_corruption_raises_only_codec_error(data) -> None:  # type: ignore[no-untyped-def]
    """Flipped bytes either raise CodecError or decode to the right number of values; never anything
    else. (The codecs carry no checksum: a flipped raw mantissa byte decodes to a different value,
    which the chunk CRC-32C catches; see test_chunking.)"""
    codec = data.draw(st.sampled_from(CODECS), label="codec")
    n = data.draw(st.integers(1, 3000), label="n")
    payload = bytearray(codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02))
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] ^= data.draw(st.integers(1, 255))
    try:
        out = codec.decode(bytes(payload), n)
    except CodecError:
        return
    assert out.shape == (n,) and out.dtype == torch.float32


@settings(max_examples=60, deadline=None)
@given(garbage=st.binary(max_size=300), n=st.integers(0, 2000), name=st.sampled_from(CODEC_NAMES))
def test_garbage_raises_codec_error(garbage: bytes, n: int, name: str) -> None:
    codec = make_codec(name, threads=1)
    try:
        out = codec.decode(garbage, n)
    except CodecError:
        return
    assert out.shape == (n,)  # only possible when the garbage happens to be well formed
    if name == "bf16_zstd":
        assert garbage[:3] == b"BZ\x02"


def _with_exponent_data(payload: bytes, e_data: bytes) -> bytes:
    """A one-block bf16_zstd payload with its exponent data replaced (lengths fixed up)."""
    e_mode, m_mode, emax, reserved, k, e_len, m_len = struct.unpack_from("<BBBBIII", payload, 11)
    rest = payload[27 + e_len:]
    return payload[:11] + struct.pack("<BBBBIII", e_mode, m_mode, emax, reserved, k, len(e_data), m_len) + e_data + rest


@pytest.mark.parametrize("forgery", ["declares_more", "declares_less", "trailing_bytes", "two_frames", "no_size"])
def test_bf16_zstd_rejects_forged_zstd_frames(forgery: str) -> None:
    n = 1024
    codec = Bf16ZstdCodec(block_values=1024)
    payload = codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(9)) * 0.02)
    assert _block_modes(payload)[0][0] == 3
    codes = zstandard.ZstdDecompressor().decompress(payload[27:27 + struct.unpack_from("<I", payload, 19)[0]])
    compress = zstandard.ZstdCompressor(level=1).compress
    frame = {
        "declares_more": compress(codes + bytes(10**6)),  # a small bomb: a megabyte of zeros
        "declares_less": compress(codes[:-1]),
        "trailing_bytes": compress(codes) + b"\x00",
        "two_frames": compress(codes[:100]) + compress(codes[100:]),
        "no_size": zstandard.ZstdCompressor(level=1, write_content_size=False).compress(codes),
    }[forgery]
    with pytest.raises(CodecError):
        codec.decode(_with_exponent_data(payload, frame), n)
    assert torch.equal(codec.decode(_with_exponent_data(payload, compress(codes)), n),
                       codec.decode(payload, n))


def test_int8_rejects_absurd_block_size_without_allocating() -> None:
    n = 10
    payload = struct.pack("<2sI", b"I8", 0xFFFFFFFF) + struct.pack("<f", 1.0) + bytes(n)
    with pytest.raises(CodecError):
        Int8BlockCodec().decode(payload, n)


def test_bf16_zstd_rejects_previous_format_version() -> None:
    payload = struct.pack("<3sII", b"BZ\x01", 1 << 21, 1) + bytes(10)
    with pytest.raises(CodecError, match="version"):
        Bf16ZstdCodec().decode(payload, 4)


# ---------------------------------------------------------------------------------------------
# Construction
# ---------------------------------------------------------------------------------------------


def test_make_codec_and_names() -> None:
    assert CODEC_NAMES == ("fp32", "bf16_zstd", "int8_block", "int4_block", "int2_block")
    for name in CODEC_NAMES:
        assert make_codec(name).name == name
    assert make_codec("bf16_zstd", zstd_level=3, threads=1).level == 3
    assert make_codec("int8_block", int8_block=64).block_size == 64
    with pytest.raises(CodecError, match="unknown codec"):
        make_codec("gzip")


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_codecs_take_fp32_only(name: str, dtype: torch.dtype) -> None:
    with pytest.raises(CodecError, match="fp32"):
        make_codec(name).encode(torch.zeros(4, dtype=dtype))


@pytest.mark.parametrize("kwargs", [{"level": 23}, {"level": -8}, {"threads": 0}, {"block_values": 1000}])
def test_bf16_zstd_rejects_bad_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Bf16ZstdCodec(**kwargs)


@pytest.mark.parametrize("block", [0, 7, (1 << 20) + 1])
def test_int8_rejects_bad_block_size(block: int) -> None:
    with pytest.raises(ValueError):
        Int8BlockCodec(block_size=block)


# ---------------------------------------------------------------------------------------------
# The bf16_zstd payload format, pinned by an independent decoder
# ---------------------------------------------------------------------------------------------


def _block_modes(payload: bytes) -> list[tuple[int, int, int]]:
    """(exponent mode, sign/mantissa mode, escapes) of every block."""
    _, _, nblocks = struct.unpack_from("<3sII", payload, 0)
    pos, modes = 11, []
    for _ in range(nblocks):
        e_mode, m_mode, _, _, n_esc, e_len, m_len = struct.unpack_from("<BBBBIII", payload, pos)
        modes.append((e_mode, m_mode, n_esc))
        pos += 16 + e_len + 5 * n_esc + m_len
    return modes


def _reference_decode(payload: bytes, n: int) -> list[int]:
    """bf16 bit patterns, decoded value by value from the documented layout.

    Header ``<3sII``: b"BZ\\x02", values per block, blocks. Per block ``<BBBBIII``: exponent mode
    (0 raw plane, 1 zstd plane, 2 raw 4-bit codes, 3 zstd 4-bit codes), sign/mantissa mode (0 raw,
    1 zstd), reference exponent emax, 0, escapes k, exponent bytes, sign/mantissa bytes; then the
    exponent data, k uint32 escape indices, k escape exponents, the sign/mantissa data. Codes are
    packed two per byte, first in the low nibble: code c < 15 is exponent emax - c, 15 is
    exponent 0 unless an escape overrides it. Sign/mantissa byte: sign in bit 7, mantissa 0..6.
    """
    def plane(mode: int, data: bytes) -> bytes:
        return zstandard.ZstdDecompressor().decompress(data) if mode == 1 else data

    magic, block_values, nblocks = struct.unpack_from("<3sII", payload, 0)
    assert magic == b"BZ\x02"
    pos, out = 11, []
    for b in range(nblocks):
        count = min(block_values, n - b * block_values)
        e_mode, m_mode, emax, reserved, k, e_len, m_len = struct.unpack_from("<BBBBIII", payload, pos)
        assert reserved == 0
        pos += 16
        e_data = payload[pos:pos + e_len]
        pos += e_len
        esc_index = struct.unpack_from(f"<{k}I", payload, pos)
        pos += 4 * k
        esc_value = payload[pos:pos + k]
        pos += k
        sign_mantissa = plane(m_mode, payload[pos:pos + m_len])
        pos += m_len
        if e_mode in (0, 1):
            exponents = list(plane(e_mode, e_data))
        else:
            codes = [c for byte in plane(e_mode - 2, e_data) for c in (byte & 0xF, byte >> 4)][:count]
            exponents = [0 if c == 15 else emax - c for c in codes]
            for i, v in zip(esc_index, esc_value, strict=True):
                exponents[i] = v
        assert len(exponents) == len(sign_mantissa) == count
        out += [(s >> 7) << 15 | e << 7 | (s & 0x7F) for e, s in zip(exponents, sign_mantissa, strict=True)]
    assert pos == len(payload)
    return out


def test_payload_layout_matches_reference_decoder() -> None:
    gen = torch.Generator().manual_seed(8)
    n = 1024
    gaussian = torch.randn(n, generator=gen) * 0.02
    with_escapes = gaussian.clone()
    with_escapes[::100] *= 1e-12
    with_escapes[1::50] = 0.0
    # 15 equally likely exponents: 4-bit codes that zstd cannot shrink.
    uniform_codes = torch.ldexp(1 + 0.99 * torch.rand(n, generator=gen), torch.randint(-14, 1, (n,), generator=gen))
    many_escapes = gaussian.clone()
    many_escapes[::10] *= 1e-12  # too many escapes: the plain exponent plane, which still compresses
    wide = torch.ldexp(torch.randn(n, generator=gen), torch.randint(-100, 100, (n,), generator=gen))
    zeros = torch.zeros(n)
    values = torch.cat([gaussian, with_escapes, uniform_codes, many_escapes, wide, zeros, gaussian[:333]])
    payload = Bf16ZstdCodec(block_values=1024).encode(values)
    modes = _block_modes(payload)
    assert [m[0] for m in modes] == [3, 3, 2, 1, 0, 3, 3]  # every exponent mode is exercised
    assert modes[1][2] > 0 and modes[5][1] == 1  # escapes; a compressed sign/mantissa plane
    assert _reference_decode(payload, values.numel()) == _bf16_bits(values)
    decoded = Bf16ZstdCodec().decode(payload, values.numel())
    assert torch.equal(_bits32(decoded), _bits32(values.to(torch.bfloat16).float()))


def test_nibble_codes_of_odd_length_pad_with_zero() -> None:
    codec = Bf16ZstdCodec(block_values=1024)
    values = torch.randn(1025) * 0.02
    payload = codec.encode(values)
    assert _reference_decode(payload, 1025) == _bf16_bits(values)
    assert np.array_equal(codec.decode(payload, 1025).numpy(), values.to(torch.bfloat16).float().numpy())


def test_codec_benchmark_smoke(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``ddiloco bench codec --quick`` runs end to end and writes its JSON."""
    import json

    from ddiloco.lab.bench.cli import main

    out = tmp_path / "codec.json"
    threads = torch.get_num_threads()
    try:
        assert main(["codec", "--quick", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # the benchmark sets torch's thread count for the process
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu_count"] and doc["machine"]["torch"] == torch.__version__
    for result in doc["results"].values():
        assert result["memcpy_MBps"] > 0
        rows = {r["codec"]: r for r in result["codecs"]}
        assert set(rows) == {"fp32", "bf16_zstd level 1", "bf16_zstd level 3", "int8_block", "int4_block",
                             "int2_block"}
        assert rows["fp32"]["ratio_vs_fp32"] == 1.0 and rows["bf16_zstd level 1"]["bf16_ratio"] > 1.2
        assert all(r["encode_MBps"] > 0 and r["encode_vs_memcpy"] > 0 for r in rows.values())


def test_fp32_values_lend_their_memory_where_they_can_and_are_encoded_otherwise() -> None:
    values = torch.randn(1000)
    lent = lend_or_encode(make_codec("fp32"), values)
    assert isinstance(lent, memoryview) and bytes(lent) == values.numpy().tobytes()
    values[0] = 42.0  # a view: it reads the values as they are
    assert np.frombuffer(lent, dtype="<f4")[0] == 42.0
    # not flat contiguous (or needing grad): copied, as encode() does
    for other in (values[::2], values.clone().requires_grad_()):
        out = lend_or_encode(make_codec("fp32"), other)
        assert isinstance(out, bytes) and out == make_codec("fp32").encode(other)
    # other codecs always encode
    assert lend_or_encode(make_codec("bf16_zstd"), values) == make_codec("bf16_zstd").encode(values)
