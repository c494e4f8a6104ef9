"""Typed errors of the fragments library.

Each error maps to one machine-readable reject reason of the wire contract (``reason``), so the
synchronizer can answer a bad input with the precise reason and the learner can act on it.
"""

from __future__ import annotations


class FragmentError(Exception):
    """Base class. ``reason`` names a ``RejectReason`` of the wire contract (without prefix)."""

    reason = "PROTOCOL"


class ChunkError(FragmentError):
    """A chunked transfer could not be reassembled."""


class MissingChunkError(ChunkError):
    """A transfer ended before all of its chunks arrived."""


class DuplicateChunkError(ChunkError):
    """A chunk index arrived twice."""


class ReorderedChunkError(ChunkError):
    """A chunk arrived out of order, or belongs to another transfer."""


class OversizedChunkError(ChunkError):
    """A chunk, or the whole payload, exceeds the allowed size."""

    reason = "OVERSIZED"


class ChecksumError(ChunkError):
    """A chunk's CRC-32C or the payload's digest does not match its bytes."""

    reason = "CHECKSUM"


class HeaderError(ChunkError):
    """The transfer header is missing, repeated or inconsistent."""


class CodecError(FragmentError):
    """A payload cannot be decoded with its codec, or the codec is unknown."""

    reason = "UNSUPPORTED_CODEC"


class LayoutMismatchError(FragmentError):
    """Two parties disagree about the fragment layout (names, shapes, dtypes, assignment)."""

    reason = "LAYOUT_MISMATCH"


class ShapeMismatchError(FragmentError):
    """A payload's tensors do not match the fragment they claim to belong to."""

    reason = "BAD_SHAPE"


class DTypeMismatchError(FragmentError):
    """A payload's tensor dtypes do not match the fragment layout."""

    reason = "BAD_DTYPE"


class NonFiniteError(FragmentError):
    """A payload holds NaN or infinite values."""

    reason = "NON_FINITE"
