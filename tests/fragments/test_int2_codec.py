"""``int2_block``: the 4-level Lloyd-Max quantiser per block (scale: the block's RMS), its error
bounds and mean squared error, wire size, error feedback, and strict decoding of every malformed
payload."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.fragments.codec import CODEC_NAMES, Int2BlockCodec, make_codec
from ddiloco.fragments.error_feedback import ErrorFeedback
from ddiloco.fragments.errors import CodecError
from ddiloco.protocol import wire

HEAD = 6  # <2sI: b"I2", block size
LEVELS = (-1.5104, -0.4528, 0.4528, 1.5104)  # J. Max (1960), 4 levels, unit Gaussian
THRESHOLD = 0.9816
LLOYD_MAX_MSE = 0.1175


def _wire_bytes(n: int, block: int) -> int:
    return HEAD + 4 * (-(-n // block)) + (n + 3) // 4


def _reference_sigma(x: np.ndarray, block: int) -> np.ndarray:
    """Each value's block RMS over the block's real values, in fp64."""
    out = np.empty(x.size)
    for start in range(0, x.size, block):
        part = x[start:start + block].astype(np.float64)
        out[start:start + block] = np.sqrt(np.mean(part * part))
    return out


def _reference_decode(payload: bytes, n: int) -> np.ndarray:
    """The layout, decoded independently: scales, then value 4i + k in bits 2k..2k+1 of byte i."""
    magic, block = struct.unpack_from("<2sI", payload, 0)
    assert magic == b"I2"
    nblocks = -(-n // block)
    scales = np.frombuffer(payload, dtype="<f4", count=nblocks, offset=HEAD)
    packed = np.frombuffer(payload, dtype=np.uint8, offset=HEAD + 4 * nblocks)
    codes = [(int(packed[i // 4]) >> (2 * (i % 4))) & 3 for i in range(n)]
    return np.array([np.float32(LEVELS[c]) * scales[i // block] for i, c in enumerate(codes)], dtype=np.float32)


def _error_bound(codec: Int2BlockCodec, x: torch.Tensor) -> torch.Tensor:
    """Half a step within +-1.5104 sigma; beyond it, the distance to the outer level (clipping)."""
    clipped = x.abs() - 1.5104 * codec.sigma(x)
    return torch.maximum(codec.quantization_step(x) * 0.5, clipped) * (1 + 1e-4)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6, width=32), min_size=0, max_size=700),
       block=st.sampled_from([8, 12, 64, 256]))
def test_error_bounds_and_layout(values: list[float], block: int) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    codec = Int2BlockCodec(block_size=block)
    payload = codec.encode(x)
    assert len(payload) == _wire_bytes(x.numel(), block) <= codec.max_encoded_bytes(x.numel())
    out = codec.decode(payload, x.numel())
    assert out.shape == x.shape and out.dtype == torch.float32
    assert np.array_equal(out.numpy(), _reference_decode(payload, x.numel()))
    sigma = codec.sigma(x).double().numpy()
    assert np.allclose(sigma, _reference_sigma(x.numpy(), block), rtol=1e-5, atol=0)
    # Absolute slack for a sigma below fp32's normal range (values under ~1e-38), itself rounded.
    assert bool(((out - x).abs() <= _error_bound(codec, x) + 1e-37).all())
    # Inside +-1.5104 sigma the step bounds the error; an outlier is clipped to the outer level.
    inside = x.abs() <= 1.5104 * codec.sigma(x)
    assert bool(((out - x).abs()[inside] <= codec.quantization_step(x)[inside] * 0.5 * (1 + 1e-4) + 1e-37).all())
    outer = (x.abs() > 1.5104 * codec.sigma(x) * (1 + 1e-4)) & (x != 0)
    assert torch.allclose(out[outer].abs(), 1.5104 * codec.sigma(x)[outer], rtol=1e-4, atol=0)


def test_codes_are_the_nearest_level_by_the_thresholds() -> None:
    """Every value maps to the level whose cell (thresholds -0.9816, 0, 0.9816 sigma) holds it,
    with x > threshold comparisons: a value on a threshold takes the level below."""
    sigma = 2.0  # RMS of the block below: values chosen, then one value fixes the sum of squares
    inner = [-3.0, -1.9632, -1.9, -0.5, 0.0, 0.7, 1.9632, 1.97, 3.1]
    rest = 64 * sigma**2 - sum(v * v for v in inner)
    filler = (rest / (64 - len(inner))) ** 0.5
    x = torch.tensor(inner + [filler] * (64 - len(inner)), dtype=torch.float32)
    codec = Int2BlockCodec()
    s = float(codec.sigma(x)[0])
    assert abs(s - sigma) < 1e-5
    out = codec.decode(codec.encode(x), 64)
    high = np.float32(s) * np.float32(THRESHOLD)  # the thresholds in fp32, as the encoder has them
    xs = x.numpy()
    expected = ((xs > -high).astype(int) + (xs > 0) + (xs > high)).tolist()
    assert torch.allclose(out, torch.tensor([LEVELS[c] * s for c in expected]), rtol=1e-6)
    assert set(expected[:len(inner)]) == {0, 1, 2, 3}


def test_mse_on_gaussian_data_is_lloyd_max() -> None:
    """On Gaussian values the error is Max's 0.1175 sigma^2, to the noise of estimating sigma
    from 64 values; an absmax scale with the same levels would do far worse."""
    n = 1 << 20
    for std in (1e-4, 0.02, 3.0):
        x = torch.randn(n, generator=torch.Generator().manual_seed(5)) * std
        codec = Int2BlockCodec()
        out = codec.decode(codec.encode(x), n)
        mse = float(((out - x).double() ** 2).mean()) / std**2
        assert abs(mse - LLOYD_MAX_MSE) < 0.006, mse
        per_block = float((((out - x).double() / codec.sigma(x).double()) ** 2).mean())
        assert abs(per_block - LLOYD_MAX_MSE) < 0.006, per_block
    absmax = x.view(-1, 64).abs().amax(dim=1, keepdim=True) / 1.5104
    snapped = torch.tensor(LEVELS)[torch.bucketize(x.view(-1, 64) / absmax,
                                                    torch.tensor([-THRESHOLD, 0.0, THRESHOLD]))] * absmax
    assert float(((snapped.view(-1) - x).double() ** 2).mean()) / 3.0**2 > 1.5 * LLOYD_MAX_MSE


def test_zero_and_constant_blocks() -> None:
    codec = Int2BlockCodec(block_size=16)
    zeros = torch.zeros(40)
    assert torch.equal(codec.decode(codec.encode(zeros), 40), zeros)
    constant = torch.full((40,), -0.3)  # sigma = 0.3: every value is an outlier, clipped
    assert torch.allclose(codec.decode(codec.encode(constant), 40), torch.full((40,), -0.3 * 1.5104))
    tiny = torch.full((16,), 1e-30)  # squares underflow fp32: the sum is redone in fp64
    assert torch.allclose(codec.decode(codec.encode(tiny), 16), tiny * 1.5104, rtol=1e-5)
    huge = torch.full((16,), 3e37)  # squares overflow fp32: the same, and the scale stays finite
    huge[0] = -3e37
    out = codec.decode(codec.encode(huge), 16)
    assert bool(torch.isfinite(out).all()) and torch.allclose(out, huge * 1.5104, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 63, 65, 66, 67, 100, 129, 1001])
def test_last_block_shorter_than_the_others(n: int) -> None:
    codec = Int2BlockCodec(block_size=64)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02
    payload = codec.encode(x)
    assert len(payload) == _wire_bytes(n, 64)
    out = codec.decode(payload, n)
    assert np.array_equal(out.numpy(), _reference_decode(payload, n))
    # The last block's sigma is over its real values, not the zero padding.
    tail = x[(n // 64) * 64:] if n % 64 else x[-64:]
    assert abs(float(codec.sigma(x)[-1]) - float(tail.double().pow(2).mean().sqrt())) < 1e-6 * 0.02
    assert bool(((out - x).abs() <= _error_bound(codec, x)).all())
    if n % 4:
        assert payload[-1] >> (2 * (n % 4)) == 0  # the padding codes


def test_bytes_on_the_wire() -> None:
    n = 1 << 16
    payload = Int2BlockCodec().encode(torch.randn(n))
    assert len(payload) == HEAD + n // 4 + 4 * n // 64
    assert 4 * n / len(payload) > 12.79  # 0.3125 bytes a value against fp32's 4
    assert len(Int2BlockCodec(block_size=256).encode(torch.randn(n))) == HEAD + n // 4 + 4 * n // 256


def test_error_feedback_keeps_the_accumulated_error_bounded() -> None:
    """With feedback the running sum of what was sent trails the true running sum by the last
    round's residual, which is one encode's error of the compensated values: within half a step
    where they lie within +-1.5104 sigma, the clipped part beyond. It stays bounded over 200
    rounds (no growth from the first half to the second); without feedback the errors add up."""
    n, rounds = 4096, 200
    codec = Int2BlockCodec()
    gen = torch.Generator().manual_seed(11)
    scale = torch.logspace(-4, -1, n)
    deltas = [torch.randn(n, generator=gen) * scale for _ in range(rounds)]
    ef = ErrorFeedback()
    true_sum = torch.zeros(n, dtype=torch.float64)
    sent_sum = torch.zeros(n, dtype=torch.float64)
    plain_sum = torch.zeros(n, dtype=torch.float64)
    worst = [0.0, 0.0]  # max relative gap in the first and second half of the rounds
    for r, delta in enumerate(deltas):
        compensated = ef.compensate(0, delta)
        payload, sent = ef.encode(0, delta, codec)
        assert torch.equal(codec.decode(payload, n), sent)
        true_sum += delta.double()
        sent_sum += sent.double()
        plain_sum += codec.decode(codec.encode(delta), n).double()
        gap = (true_sum - sent_sum).abs()
        bound = _error_bound(codec, compensated).double() + 1e-9
        assert bool((gap <= bound).all())
        worst[r * 2 // rounds] = max(worst[r * 2 // rounds], float((gap / scale.double()).max()))
    assert worst[1] < 1.5 * worst[0]  # bounded: it does not grow with the rounds
    assert worst[1] < 4.0  # a few of each value's own standard deviation
    drift = float(((true_sum - plain_sum).abs() / scale.double()).max())
    assert drift > 5 * worst[1]  # without feedback the error walks away


def test_error_feedback_sends_a_lone_outlier_in_full() -> None:
    """A value far outside its block's spread is clipped to 1.51 sigma each round; feedback
    carries the rest until all of it has been sent."""
    codec = Int2BlockCodec()
    delta = torch.zeros(64)
    delta[5] = 1.0
    ef = ErrorFeedback()
    sent_sum = torch.zeros(64, dtype=torch.float64)
    _, sent = ef.encode(0, delta, codec)
    assert 0.15 < float(sent[5]) < 0.25  # 1.5104 * 1/8: sigma of one 1.0 among 64 values
    sent_sum += sent.double()
    for _ in range(60):
        _, sent = ef.encode(0, torch.zeros(64), codec)
        sent_sum += sent.double()
    assert abs(float(sent_sum[5]) - 1.0) < 0.05
    assert float(sent_sum.abs().sum() - sent_sum[5].abs()) < 0.1


# ---------------------------------------------------------------------------------------------
# Non-finite values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_block_decodes_non_finite(bad: float) -> None:
    """Like every codec, int2_block carries a non-finite value to the receiver, whose gate
    (``decode_fragment``) refuses it as NON_FINITE: the block's scale is NaN or +inf."""
    x = torch.randn(200, generator=torch.Generator().manual_seed(3))
    x[70] = bad
    codec = Int2BlockCodec()
    payload = codec.encode(x)
    scale = struct.unpack_from("<f", payload, HEAD + 4)[0]
    assert scale != scale or scale == float("inf")
    out = codec.decode(payload, 200)
    assert not bool(torch.isfinite(out[64:128]).any())
    assert bool(torch.isfinite(out[:64]).all()) and bool(torch.isfinite(out[128:]).all())
    with pytest.raises(CodecError, match="fp32"):
        codec.encode(torch.zeros(4, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# Strict decoding
# ---------------------------------------------------------------------------------------------


def _payload(n: int = 1000, block: int = 64) -> bytes:
    return Int2BlockCodec(block_size=block).encode(torch.randn(n, generator=torch.Generator().manual_seed(n)))


@pytest.mark.parametrize("n", [1001, 1002, 1003])
def test_non_zero_padding_bits_raise(n: int) -> None:
    payload = _payload(n)
    for bit in range(2 * (n % 4), 8):
        bad = bytearray(payload)
        bad[-1] |= 1 << bit
        with pytest.raises(CodecError, match="padding"):
            Int2BlockCodec().decode(bytes(bad), n)


def test_every_code_byte_is_valid() -> None:
    """All four codes are levels: any code byte decodes (only padding bits are checked)."""
    n = 1024
    payload = bytearray(_payload(n))
    payload[HEAD + 4 * 16:] = bytes(range(256))
    out = Int2BlockCodec().decode(bytes(payload), n)
    assert np.array_equal(out.numpy(), _reference_decode(bytes(payload), n))


@pytest.mark.parametrize("block", [0, 4, 6, 10, 62, 2**20 + 4])
def test_rejects_bad_block_size(block: int) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        Int2BlockCodec(block_size=block)


def test_registration_and_bound() -> None:
    assert "int2_block" in CODEC_NAMES
    codec = make_codec("int2_block", int2_block=128)
    assert isinstance(codec, Int2BlockCodec) and codec.block_size == 128 and not codec.lossless
    assert make_codec("int2_block").block_size == 64
    for n in (0, 1, 1000, 12345):  # the bound holds whatever block size the sender chose
        for block in (8, 64, 1 << 20):
            assert len(Int2BlockCodec(block).encode(torch.randn(n))) <= codec.max_encoded_bytes(n)
    assert wire.codec_from_pb(wire.codec_to_pb("int2_block")) == "int2_block"
    assert wire.codec_to_pb("int2_block") == 5
    assert "int2_block" in wire.Hello.__dataclass_fields__["codecs"].default
