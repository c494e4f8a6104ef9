"""A fragment's values as a transfer, and a received transfer checked and decoded.

``encode_fragment`` turns a flat fp32 buffer into chunks (codec, then chunking). ``decode_fragment``
is the receiving side's single gate: it checks the transfer against the fragment layout (tensor
names, shapes, dtypes, value count, size bound of the codec), decodes it, and refuses non-finite
values, raising the typed error whose ``reason`` is the wire reject reason. Nothing that fails
here ever reaches the global model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ddiloco.fragments.chunking import DEFAULT_MAX_CHUNK_BYTES, Chunk, Transfer, TransferHeader, split
from ddiloco.fragments.codec import Codec, Fp32Codec, Int8BlockCodec, make_codec
from ddiloco.fragments.errors import (
    CodecError,
    DTypeMismatchError,
    FragmentError,
    NonFiniteError,
    OversizedChunkError,
    ShapeMismatchError,
)
from ddiloco.fragments.outer_gradient import all_finite
from ddiloco.fragments.partition import Fragment, FragmentLayout


def encode_fragment(values: torch.Tensor, fragment: Fragment, *, codec: Codec, kind: str, version: int,
                    transfer_id: int, layout_hash: str = "", sequence: int = 0, tokens: int = 0,
                    steps: int = 0, learner_step: int = 0, round: int = 0, hand_over: bool = False,
                    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                    payload: bytes | memoryview | None = None,
                    frame: Callable[[list[Chunk]], list[Chunk]] | None = None,
                    trailing_digest: bool = False) -> list[Chunk]:
    """Encode ``values`` (flat fp32, the fragment's concatenated tensors) as a chunked transfer.

    ``payload`` may be passed when the caller already encoded the values (error feedback does), or
    lent them (``codec.lend_or_encode``): the chunks are views of it, read when each is written.
    ``frame`` (``ddiloco.protocol.wire.frame_chunks``) writes the chunks as wire messages before
    this returns; the fp32 codec then reads the values' memory in place, so each byte is copied
    once, into its message, and ``values`` may change as soon as this returns.
    ``trailing_digest``: the header leaves the payload digest to the last chunk, hashed as the
    chunks are written (``chunking.sealed``, which the learner's stream applies); it cannot go with
    ``frame``, which writes every chunk before the first is sent.
    """
    if trailing_digest and frame is not None:
        raise ValueError("a trailing digest is computed as the chunks are written; frame them as they are written")
    if values.numel() != fragment.numel:
        raise ShapeMismatchError(
            f"fragment {fragment.index} has {fragment.numel} values, got a buffer of {values.numel()}")
    header = TransferHeader(
        kind=kind, fragment_id=fragment.index, version=version, codec=codec.name, tensors=fragment.tensors,
        num_values=fragment.numel, sequence=sequence, tokens=tokens, steps=steps,
        block_size=codec.block_size if isinstance(codec, Int8BlockCodec) else 0,
        layout_hash=layout_hash, learner_step=learner_step, round=round, hand_over=hand_over,
    )
    data: bytes | memoryview | None = payload
    if data is None and frame is not None and isinstance(codec, Fp32Codec):
        data = codec.borrow(values)  # copied into the frames below, before this returns
    if data is None:
        data = codec.encode(values)
    chunks = split(header, data, transfer_id=transfer_id, max_chunk_bytes=max_chunk_bytes, trailing=trailing_digest)
    return frame(chunks) if frame is not None else chunks


def check_header(header: TransferHeader, layout: FragmentLayout) -> Fragment:
    """Validate a header against the layout; return the fragment it addresses."""
    if not 0 <= header.fragment_id < layout.num_fragments:
        err = FragmentError(f"fragment {header.fragment_id} does not exist (P={layout.num_fragments})")
        err.reason = "UNKNOWN_FRAGMENT"
        raise err
    fragment = layout[header.fragment_id]
    if len(header.tensors) != len(fragment.tensors) or header.num_values != fragment.numel:
        raise ShapeMismatchError(
            f"fragment {fragment.index}: {len(header.tensors)} tensors / {header.num_values} values, "
            f"expected {len(fragment.tensors)} / {fragment.numel}")
    for got, want in zip(header.tensors, fragment.tensors, strict=True):
        if got.name != want.name or got.shape != want.shape:
            raise ShapeMismatchError(
                f"fragment {fragment.index}: tensor {got.name}{list(got.shape)} where "
                f"{want.name}{list(want.shape)} was expected")
        if got.dtype != want.dtype:
            raise DTypeMismatchError(
                f"fragment {fragment.index}: tensor {got.name} is {got.dtype}, expected {want.dtype}")
    return fragment


def decode_fragment(transfer: Transfer, layout: FragmentLayout, *, zstd_threads: int = 2) -> torch.Tensor:
    """Check and decode a transfer into a flat fp32 tensor. Raises ``FragmentError`` subclasses."""
    header = transfer.header
    fragment = check_header(header, layout)
    try:
        codec = make_codec(header.codec, threads=zstd_threads,
                           int8_block=header.block_size if header.codec == "int8_block" and header.block_size else 256)
    except ValueError as exc:
        raise CodecError(f"fragment {fragment.index}: bad codec parameters: {exc}") from exc
    bound = codec.max_encoded_bytes(fragment.numel)
    if transfer.size > bound:
        raise OversizedChunkError(
            f"fragment {fragment.index}: {transfer.size} payload bytes exceed the {header.codec} "
            f"bound of {bound}")
    try:
        payload = transfer.payload
        if transfer.owned and isinstance(codec, Fp32Codec):  # its memory becomes the values'
            values = codec.take(payload, fragment.numel)
        else:
            values = codec.decode(payload, fragment.numel)
    except CodecError:
        raise
    except (ValueError, RuntimeError) as exc:
        raise CodecError(f"fragment {fragment.index}: payload does not decode: {exc}") from exc
    if not all_finite(values):
        bad = int((~torch.isfinite(values)).sum())
        raise NonFiniteError(f"fragment {fragment.index}: {bad} non-finite values")
    return values
