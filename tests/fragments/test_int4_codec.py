"""``int4_block``: 4-bit symmetric levels per block, error bound, wire size, error feedback, and
strict decoding of every malformed payload."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.fragments.codec import CODEC_NAMES, Int4BlockCodec, make_codec
from ddiloco.fragments.error_feedback import ErrorFeedback
from ddiloco.fragments.errors import CodecError

HEAD = 6  # <2sI: b"I4", block size


def _wire_bytes(n: int, block: int) -> int:
    return HEAD + 4 * (-(-n // block)) + (n + 1) // 2


def _reference_decode(payload: bytes, n: int) -> np.ndarray:
    """The layout, decoded independently: scales, then value 2i in the low nibble of byte i."""
    magic, block = struct.unpack_from("<2sI", payload, 0)
    assert magic == b"I4"
    nblocks = -(-n // block)
    scales = np.frombuffer(payload, dtype="<f4", count=nblocks, offset=HEAD)
    packed = np.frombuffer(payload, dtype=np.uint8, offset=HEAD + 4 * nblocks)
    codes = np.empty(2 * packed.size, dtype=np.int32)
    codes[0::2], codes[1::2] = packed & 0xF, packed >> 4
    levels = codes[:n] - 8
    return np.array([levels[i] * scales[i // block] for i in range(n)], dtype=np.float32)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6, width=32), min_size=0, max_size=700),
       block=st.sampled_from([8, 10, 64, 256]))
def test_within_half_a_step_and_layout(values: list[float], block: int) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    codec = Int4BlockCodec(block_size=block)
    payload = codec.encode(x)
    assert len(payload) == _wire_bytes(x.numel(), block) <= codec.max_encoded_bytes(x.numel())
    out = codec.decode(payload, x.numel())
    assert out.shape == x.shape and out.dtype == torch.float32
    assert np.array_equal(out.numpy(), _reference_decode(payload, x.numel()))
    step = codec.quantization_step(x)
    # Half a step, plus fp32 rounding of the scale; a scale below fp32's normal range (a block
    # whose largest value is under 7 * 2**-126) is itself rounded, hence the absolute slack.
    assert bool(((out - x).abs() <= step * 0.5 * (1 + 1e-5) + 1e-37).all())


def test_levels_are_the_fifteen_symmetric_ones() -> None:
    x = torch.linspace(-1.0, 1.0, 64 * 50)
    codec = Int4BlockCodec()
    out = codec.decode(codec.encode(x), x.numel())
    steps = codec.quantization_step(x)
    levels = torch.round(out / steps)
    assert torch.equal(levels * steps, out)
    assert set(levels.int().tolist()) == set(range(-7, 8))


def test_zeros_constant_and_signed_blocks() -> None:
    codec = Int4BlockCodec(block_size=16)
    zeros = torch.zeros(40)
    assert torch.equal(codec.decode(codec.encode(zeros), 40), zeros)
    constant = torch.full((40,), -0.3)
    assert torch.equal(codec.decode(codec.encode(constant), 40), constant)  # absmax is a level
    mixed = torch.cat([torch.zeros(16), torch.full((16,), 2.5), torch.full((8,), 1e-3)])
    out = codec.decode(codec.encode(mixed), 40)
    assert torch.equal(out, mixed)
    one_big = torch.zeros(16)
    one_big[3] = 7.0
    one_big[4] = 0.4  # below half a step (0.5): rounds to zero
    assert codec.decode(codec.encode(one_big), 16).tolist() == [0.0] * 3 + [7.0] + [0.0] * 12


@pytest.mark.parametrize("n", [1, 7, 63, 65, 100, 129, 1001])
def test_last_block_shorter_than_the_others(n: int) -> None:
    codec = Int4BlockCodec(block_size=64)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02
    payload = codec.encode(x)
    assert len(payload) == _wire_bytes(n, 64)
    out = codec.decode(payload, n)
    assert bool(((out - x).abs() <= codec.quantization_step(x) * 0.5 * (1 + 1e-5)).all())
    if n % 2:
        assert payload[-1] >> 4 == 0  # the padding nibble


def test_bytes_on_the_wire() -> None:
    n = 1 << 16
    payload = Int4BlockCodec().encode(torch.randn(n))
    assert len(payload) == HEAD + n // 2 + 4 * n // 64
    assert 4 * n / len(payload) > 7.1  # 0.5625 bytes a value against fp32's 4
    assert len(Int4BlockCodec(block_size=256).encode(torch.randn(n))) == HEAD + n // 2 + 4 * n // 256


def test_error_feedback_tracks_the_true_sum() -> None:
    """The running sum of what was sent stays within half a step of the true running sum over
    100 rounds; without feedback the same errors add up well past it."""
    n, rounds = 4096, 100
    codec = Int4BlockCodec()
    gen = torch.Generator().manual_seed(11)
    scale = torch.logspace(-4, -1, n)
    deltas = [torch.randn(n, generator=gen) * scale for _ in range(rounds)]
    ef = ErrorFeedback()
    true_sum = torch.zeros(n, dtype=torch.float64)
    sent_sum = torch.zeros(n, dtype=torch.float64)
    plain_sum = torch.zeros(n, dtype=torch.float64)
    worst = 0.0
    for delta in deltas:
        compensated = ef.compensate(0, delta)
        payload, sent = ef.encode(0, delta, codec)
        assert torch.equal(codec.decode(payload, n), sent)
        true_sum += delta.double()
        sent_sum += sent.double()
        plain_sum += codec.decode(codec.encode(delta), n).double()
        gap = (true_sum - sent_sum).abs()
        bound = codec.quantization_step(compensated).double() * 0.5 * (1 + 1e-4) + 1e-9
        assert bool((gap <= bound).all())
        worst = max(worst, float(gap.max()))
    drift = float((true_sum - plain_sum).abs().max())
    assert drift > 3 * worst  # the bound is not vacuous: without feedback the error walks away


# ---------------------------------------------------------------------------------------------
# Strict decoding
# ---------------------------------------------------------------------------------------------


def _payload(n: int = 1000, block: int = 64) -> bytes:
    return Int4BlockCodec(block_size=block).encode(torch.randn(n, generator=torch.Generator().manual_seed(n)))


def test_invalid_codes_raise() -> None:
    n = 1001
    payload = _payload(n)
    codes_at = HEAD + 4 * (-(-n // 64))
    for pos, value in [(codes_at, 0x80), (codes_at + 17, 0x08), (codes_at + 3, 0x00), (len(payload) - 1, 0x00),
                       (len(payload) - 1, 0x18)]:  # a zero code, or a padding nibble that is not 0
        bad = bytearray(payload)
        bad[pos] = value
        with pytest.raises(CodecError, match="code"):
            Int4BlockCodec().decode(bytes(bad), n)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_block_decodes_non_finite(bad: float) -> None:
    """Like every codec, int4_block carries a non-finite value to the receiver, whose gate
    (``decode_fragment``) refuses it as NON_FINITE: the block's scale is NaN or +inf."""
    x = torch.randn(200, generator=torch.Generator().manual_seed(3))
    x[70] = bad
    codec = Int4BlockCodec()
    out = codec.decode(codec.encode(x), 200)
    assert not bool(torch.isfinite(out[64:128]).any())
    assert bool(torch.isfinite(out[:64]).all()) and bool(torch.isfinite(out[128:]).all())
    with pytest.raises(CodecError, match="fp32"):
        codec.encode(torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("block", [0, 7, 9, 2**20 + 2])
def test_rejects_bad_block_size(block: int) -> None:
    with pytest.raises(ValueError):
        Int4BlockCodec(block_size=block)


def test_make_codec_and_bound() -> None:
    assert "int4_block" in CODEC_NAMES
    codec = make_codec("int4_block", int4_block=128)
    assert isinstance(codec, Int4BlockCodec) and codec.block_size == 128 and not codec.lossless
    assert make_codec("int4_block").block_size == 64
    for n in (0, 1, 1000, 12345):  # the bound holds whatever block size the sender chose
        for block in (8, 64, 1 << 20):
            assert len(Int4BlockCodec(block).encode(torch.randn(n))) <= codec.max_encoded_bytes(n)
