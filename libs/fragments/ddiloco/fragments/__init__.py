"""ddiloco.fragments: the shared fragments library.

The data path, one module per stage: ``partition`` (tensors -> P fragments) -> ``schedule``
(which fragment falls due when) -> ``outer_gradient`` (fp32 Delta = base - theta) -> ``codec``
(bf16 + byte planes + zstd, fp32, int8, int4, int2) with ``error_feedback`` -> ``chunking`` (bounded chunks,
CRC-32C, digest, strict reassembly) -> ``payload`` (layout checks and decode) -> ``wire``
(protobuf messages; the only importer of the generated code).
"""

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
from ddiloco.fragments.outer_gradient import all_finite, gather, outer_gradient, scatter
from ddiloco.fragments.partition import Fragment, FragmentLayout, TensorSpec, partition, partition_tensors
from ddiloco.fragments.payload import check_header, decode_fragment, encode_fragment
from ddiloco.fragments.schedule import FragmentSchedule

__all__ = [
    "CODEC_NAMES", "DEFAULT_MAX_CHUNK_BYTES", "Bf16ZstdCodec", "ChecksumError", "Chunk", "ChunkError", "Codec",
    "CodecError", "DTypeMismatchError", "DuplicateChunkError", "ErrorFeedback", "Fp32Codec", "Fragment",
    "FragmentError", "FragmentLayout", "FragmentSchedule", "HeaderError", "Int2BlockCodec", "Int4BlockCodec", "Int8BlockCodec",
    "LayoutMismatchError", "MissingChunkError", "NonFiniteError", "OversizedChunkError", "Reassembler",
    "ReorderedChunkError", "ShapeMismatchError", "TensorSpec", "Transfer", "TransferHeader", "all_finite", "check_header",
    "decode_fragment", "encode_fragment", "gather", "make_codec", "outer_gradient", "partition",
    "partition_tensors", "scatter", "split",
]
