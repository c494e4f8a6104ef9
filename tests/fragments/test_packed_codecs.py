"""What ``int4_block`` and ``int2_block`` share: their header (``<2sI``: magic, block size), the
scales after it and the packed codes, and strict decoding of a payload whose header, scales or
length were forged or corrupted: a ``CodecError``, before anything is allocated, never another
exception."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.fragments.codec import Int2BlockCodec, Int4BlockCodec
from ddiloco.fragments.errors import CodecError

HEAD = 6  # <2sI: magic, block size
# codec, its magic, another packed codec's magic, block sizes a header may not carry
CODECS = [
    pytest.param(Int4BlockCodec, b"I4", b"I2", [0, 6, 63, (1 << 20) + 2], id="int4_block"),
    pytest.param(Int2BlockCodec, b"I2", b"I4", [0, 4, 62, 63, (1 << 20) + 4], id="int2_block"),
]
# value counts that do not match a payload of 1001 values (codes packed 2 or 4 a byte)
WRONG_COUNTS = [pytest.param(Int4BlockCodec, [999, 1002, 1003, 6001, -1], id="int4_block"),
                pytest.param(Int2BlockCodec, [1000, 997, 1005, 6001, -1], id="int2_block")]


def _payload(codec: Any, n: int = 1000, block: int = 64) -> bytes:
    return codec(block_size=block).encode(torch.randn(n, generator=torch.Generator().manual_seed(n)))


@pytest.mark.parametrize("codec, wrong_counts", WRONG_COUNTS)
def test_truncated_padded_or_wrong_count_raises(codec: Any, wrong_counts: list[int]) -> None:
    n = 1001
    payload = _payload(codec, n)
    for cut in sorted({0, 1, 5, 6, 9, len(payload) // 2, len(payload) - 1}):
        with pytest.raises(CodecError):
            codec().decode(payload[:cut], n)
    with pytest.raises(CodecError, match="bytes, expected"):
        codec().decode(payload + b"\x00", n)
    for wrong in wrong_counts:
        with pytest.raises(CodecError):
            codec().decode(payload, wrong)


@pytest.mark.parametrize("codec, magic, other, bad_blocks", CODECS)
def test_bad_header_raises(codec: Any, magic: bytes, other: bytes, bad_blocks: list[int]) -> None:
    body = _payload(codec)[HEAD:]
    cases = [(struct.pack("<2sI", other, 64), "magic"),
             (struct.pack("<2sI", magic, 32), "bytes, expected")]  # a valid size, not the one sent
    cases += [(struct.pack("<2sI", magic, b), "block size") for b in bad_blocks]
    for header, match in cases:
        with pytest.raises(CodecError, match=match):
            codec().decode(header + body, 1000)


@pytest.mark.parametrize("codec, magic, other, bad_blocks", CODECS)
def test_forged_block_size_does_not_allocate(codec: Any, magic: bytes, other: bytes, bad_blocks: list[int]) -> None:
    """A huge declared block size is refused by its range; an in-range one by the exact length,
    which is checked before anything is allocated."""
    with pytest.raises(CodecError):
        codec().decode(struct.pack("<2sI", magic, 0xFFFFFFFC) + struct.pack("<f", 1.0) + bytes(3), 10)
    with pytest.raises(CodecError):
        codec().decode(struct.pack("<2sI", magic, 8) + bytes(64), 1 << 40)


@pytest.mark.parametrize("scale", [-1.0, float("-inf"), -0.0 - 1e-30])
@pytest.mark.parametrize("codec, magic, other, bad_blocks", CODECS)
def test_negative_scale_raises(codec: Any, magic: bytes, other: bytes, bad_blocks: list[int], scale: float) -> None:
    payload = bytearray(_payload(codec))
    struct.pack_into("<f", payload, HEAD + 4 * 7, scale)
    with pytest.raises(CodecError, match="negative scale"):
        codec().decode(bytes(payload), 1000)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), codec=st.sampled_from([Int4BlockCodec, Int2BlockCodec]))
def test_any_corruption_raises_only_codec_error(data, codec) -> None:  # type: ignore[no-untyped-def]
    n = data.draw(st.integers(1, 3000), label="n")
    block = data.draw(st.sampled_from([8, 64, 256]), label="block")
    payload = bytearray(_payload(codec, n, block))
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] ^= data.draw(st.integers(1, 255))
    try:
        out = codec().decode(bytes(payload), n)
    except CodecError:
        return
    assert out.shape == (n,) and out.dtype == torch.float32
