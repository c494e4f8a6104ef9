"""The codecs' names, apart from the codecs: configuration and the protocol check a name
without importing torch (``ddiloco.fragments.codec`` builds the codec itself)."""

from __future__ import annotations

from typing import Literal, get_args

CodecName = Literal["fp32", "bf16_zstd", "int8_block", "int4_block", "int2_block"]
CODEC_NAMES: tuple[str, ...] = get_args(CodecName)
