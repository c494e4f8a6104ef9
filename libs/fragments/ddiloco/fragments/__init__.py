"""ddiloco.fragments: the shared fragments library.

The data path, one module per stage: ``partition`` (tensors -> P fragments) -> ``schedule``
(which fragment falls due when) -> ``outer_gradient`` (fp32 Delta = base - theta) -> ``codec``
(bf16 + byte planes + zstd, fp32, int8, int4, int2) with ``error_feedback`` -> ``chunking`` (bounded chunks,
CRC-32C, digest, strict reassembly) -> ``payload`` (layout checks and decode) -> ``wire``
(protobuf messages; the only importer of the generated code).

Importing the package loads only torch-free modules; every other name below comes from its
module on first use, so reaching ``ddiloco.fragments.chunking`` (the protocol's and ``ddiloco
status``'s) does not import torch through this file.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# ``partition`` and ``outer_gradient`` each name a function and the module defining it. Importing
# such a module (chunking and payload do) sets the package's attribute to the module, so the two
# functions are bound here, from their torch-free modules, where no later import replaces them.
from ddiloco.fragments.outer_gradient import outer_gradient
from ddiloco.fragments.partition import partition

_MODULES: dict[str, tuple[str, ...]] = {
    "chunking": ("DEFAULT_MAX_CHUNK_BYTES", "Chunk", "Reassembler", "Transfer", "TransferHeader", "split"),
    "codec": ("CODEC_NAMES", "Bf16ZstdCodec", "Codec", "Fp32Codec", "Int2BlockCodec", "Int4BlockCodec",
              "Int8BlockCodec", "make_codec"),
    "error_feedback": ("ErrorFeedback",),
    "errors": ("ChecksumError", "ChunkError", "CodecError", "DTypeMismatchError", "DuplicateChunkError",
               "FragmentError", "HeaderError", "LayoutMismatchError", "MissingChunkError", "NonFiniteError",
               "OversizedChunkError", "ReorderedChunkError", "ShapeMismatchError"),
    "outer_gradient": ("all_finite", "gather", "outer_gradient", "scatter"),
    "partition": ("Fragment", "FragmentLayout", "TensorSpec", "partition", "partition_tensors"),
    "payload": ("check_header", "decode_fragment", "encode_fragment"),
    "schedule": ("FragmentSchedule",),
}
"""This package's modules and the public names each defines."""

_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "CODEC_NAMES", "DEFAULT_MAX_CHUNK_BYTES", "Bf16ZstdCodec", "ChecksumError", "Chunk", "ChunkError", "Codec",
    "CodecError", "DTypeMismatchError", "DuplicateChunkError", "ErrorFeedback", "Fp32Codec", "Fragment",
    "FragmentError", "FragmentLayout", "FragmentSchedule", "HeaderError", "Int2BlockCodec", "Int4BlockCodec",
    "Int8BlockCodec", "LayoutMismatchError", "MissingChunkError", "NonFiniteError", "OversizedChunkError",
    "Reassembler", "ReorderedChunkError", "ShapeMismatchError", "TensorSpec", "Transfer", "TransferHeader",
    "all_finite", "check_header", "decode_fragment", "encode_fragment", "gather", "make_codec", "outer_gradient",
    "partition", "partition_tensors", "scatter", "split",
]

if TYPE_CHECKING:
    from ddiloco.fragments.chunking import (
        DEFAULT_MAX_CHUNK_BYTES,
        Chunk,
        Reassembler,
        Transfer,
        TransferHeader,
        split,
    )
    from ddiloco.fragments.codec import (
        CODEC_NAMES,
        Bf16ZstdCodec,
        Codec,
        Fp32Codec,
        Int2BlockCodec,
        Int4BlockCodec,
        Int8BlockCodec,
        make_codec,
    )
    from ddiloco.fragments.error_feedback import ErrorFeedback
    from ddiloco.fragments.errors import (
        ChecksumError,
        ChunkError,
        CodecError,
        DTypeMismatchError,
        DuplicateChunkError,
        FragmentError,
        HeaderError,
        LayoutMismatchError,
        MissingChunkError,
        NonFiniteError,
        OversizedChunkError,
        ReorderedChunkError,
        ShapeMismatchError,
    )
    from ddiloco.fragments.outer_gradient import all_finite, gather, scatter
    from ddiloco.fragments.partition import Fragment, FragmentLayout, TensorSpec, partition_tensors
    from ddiloco.fragments.payload import check_header, decode_fragment, encode_fragment
    from ddiloco.fragments.schedule import FragmentSchedule


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
