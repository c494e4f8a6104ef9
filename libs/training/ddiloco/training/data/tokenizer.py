"""Tokenizers: text documents (files) into one stream of token ids.

A tokenizer turns the documents of a split into one token stream. Both kinds yield (document
index, ids) pairs in document order; ``encode_documents`` places the separators, so ``text-dir``
corpora and ``prepare-data`` join documents by one piece of code. Bytes are tokens by default
(vocab 256, documents joined by a 0x00 byte); a Hugging Face ``tokenizer.json`` is read with the
``tokenizers`` package of the ``hf`` extra.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import structlog

log = structlog.get_logger(__name__)

SEPARATOR = b"\x00"
"""Byte placed between files: the document boundary."""
BYTE_VOCAB = 256

DOCUMENT_SEPARATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
"""Tokens tried, in this order, as the document separator of a ``tokenizer.json``: the first one
its vocabulary holds is placed between documents (GPT-2/NeoX, Llama 3, Llama 2/Mistral/T5,
Gemma, BERT). A tokenizer with none of them joins documents with no separator."""
_READ_BYTES = 1 << 20
"""Files are read in blocks of this many bytes (bounded memory for files of any size)."""
_PIECE_CHARS = 1 << 20
"""Text longer than this is encoded in pieces cut between words (see ``_text_pieces``)."""
_BATCH_CHARS = 4 << 20
"""Pieces are encoded in batches of about this many characters (the tokenizer's threads share them)."""


class TextTokenizer(Protocol):
    name: str
    """``"bytes"`` or the tokenizer file's path."""
    vocab_size: int
    separator: int | None
    """Id placed between documents; None: documents are joined with nothing in between."""

    def encode_files(
        self, paths: Sequence[Path], opened: Callable[[int], None] | None = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """(document index, ids) in document order; ``opened(i)`` is called as file i is opened."""
        ...

    def describe(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """A token is a byte; documents are separated by 0x00 (as the byte corpora are)."""

    name = "bytes"
    vocab_size = BYTE_VOCAB
    separator: int | None = SEPARATOR[0]

    def encode_files(
        self, paths: Sequence[Path], opened: Callable[[int], None] | None = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        for doc, path in enumerate(paths):
            if opened is not None:
                opened(doc)
            with open(path, "rb") as f:
                while block := f.read(_READ_BYTES):
                    yield doc, np.frombuffer(block, dtype=np.uint8)

    def describe(self) -> dict[str, Any]:
        return {"kind": "bytes", "vocab_size": BYTE_VOCAB, "separator_id": self.separator}


def _safe_cut(text: str, limit: int) -> int:
    """Where to end a piece of at most ``limit`` characters: before a single space between two
    letters (``word| word``), the last such place. Every common pre-tokenizer ends a pre-token at
    that letter and starts the next at that space (GPT-2 and Llama 3 byte-level regexes attach
    one leading space to a word; whitespace, BERT and Metaspace splitters split there), so the
    pieces encode as the whole text does. Text with no such place is cut at ``limit``."""
    pos = text.rfind(" ", 0, min(limit, len(text) - 1))
    while pos > 0 and not (text[pos - 1].isalpha() and text[pos + 1].isalpha()):
        pos = text.rfind(" ", 0, pos)
    return pos if pos > 0 else limit


def _text_pieces(f: BinaryIO) -> Iterator[str]:
    """The text of a file as UTF-8 (invalid bytes become U+FFFD, so one stray Latin-1 byte does not
    stop a long preparation), in pieces of at most ``_PIECE_CHARS`` characters.

    A file shorter than that is one piece, encoded exactly as a whole; a longer one is cut
    between words (``_safe_cut``) so its memory stays bounded. A tokenizer that treats the start
    of a sequence specially (a normalizer that prepends a SentencePiece "▁", a model without
    pre-tokenization) may encode such a cut slightly differently from the whole file;
    ``text-dir`` and ``prepare-data`` cut identically, so they always agree with each other.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    while True:
        block = f.read(_READ_BYTES)
        pending += decoder.decode(block, final=not block)
        while len(pending) >= _PIECE_CHARS:
            cut = _safe_cut(pending, _PIECE_CHARS)
            yield pending[:cut]
            pending = pending[cut:]
        if not block:
            break
    if pending:
        yield pending


def _import_tokenizers(path: Path) -> Any:
    try:
        return importlib.import_module("tokenizers")
    except ImportError:
        raise ValueError(
            f"tokenizer {str(path)!r}: reading a tokenizer.json needs the tokenizers package: "
            "pip install 'ddiloco-training[hf]'"
        ) from None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (any model the ``tokenizers`` package reads: BPE,
    WordPiece, Unigram, WordLevel), applied without its post-processor
    (``add_special_tokens=False``): the document separator is the only token added."""

    def __init__(self, path: Path) -> None:
        tokenizers = _import_tokenizers(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception for every parse error
            raise ValueError(f"tokenizer {str(path)!r} is not a readable tokenizer.json: {e}") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ValueError(f"tokenizer {str(path)!r} has an empty vocabulary")
        self.name = str(path)
        # the largest id + 1, not the count: added tokens may leave gaps above the base vocab
        self.vocab_size = max(vocab.values()) + 1
        self.separator_token = next((t for t in DOCUMENT_SEPARATORS if t in vocab), None)
        self.separator = None if self.separator_token is None else vocab[self.separator_token]
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        if self.separator is None:
            log.warning("tokenizer_without_separator", tokenizer=self.name, tried=list(DOCUMENT_SEPARATORS),
                        note="documents are joined with no token in between")

    def encode_files(
        self, paths: Sequence[Path], opened: Callable[[int], None] | None = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        # Pieces of many small files are encoded together (encode_batch spreads them over the
        # tokenizer's threads); each piece is encoded on its own, so batching never changes ids.
        batch: list[str] = []
        owners: list[int] = []
        chars = 0
        for doc, path in enumerate(paths):
            if opened is not None:
                opened(doc)
            with open(path, "rb") as f:
                for piece in _text_pieces(f):
                    batch.append(piece)
                    owners.append(doc)
                    chars += len(piece)
                    if chars >= _BATCH_CHARS:
                        yield from self._encode(batch, owners)
                        batch, owners, chars = [], [], 0
        if batch:
            yield from self._encode(batch, owners)

    def _encode(self, batch: list[str], owners: list[int]) -> Iterator[tuple[int, np.ndarray]]:
        for doc, enc in zip(owners, self._tok.encode_batch(batch, add_special_tokens=False), strict=True):
            yield doc, np.asarray(enc.ids, dtype=np.uint32)

    def describe(self) -> dict[str, Any]:
        return {"kind": "tokenizers", "file": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "separator": self.separator_token, "separator_id": self.separator}


BYTES_TOKENIZER = ByteTokenizer()


@functools.lru_cache(maxsize=8)
def _load_hf_tokenizer(path: str, mtime_ns: int, size: int) -> HFTokenizer:
    return HFTokenizer(Path(path))


def load_tokenizer(spec: str) -> TextTokenizer:
    """``"bytes"`` or a ``tokenizer.json`` path (loaded once per file version: the config check
    and the corpus build share it)."""
    if spec == "bytes":
        return BYTES_TOKENIZER
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"tokenizer {spec!r}: no such file (give 'bytes' or the path of a tokenizer.json)")
    st = path.stat()
    return _load_hf_tokenizer(str(path.resolve()), st.st_mtime_ns, st.st_size)


def encode_documents(
    tok: TextTokenizer, paths: Sequence[Path], dtype: np.dtype, opened: Callable[[int], None] | None = None
) -> Iterator[np.ndarray]:
    """The tokens of ``paths`` as one stream, in pieces: each document's ids, with the separator
    between documents (not after the last), as ``dtype``. Memory is bounded by one batch;
    ``opened(i)`` reports progress as document i is opened."""
    if np.iinfo(dtype).max < tok.vocab_size - 1:
        raise ValueError(f"{dtype.name} cannot hold the ids of a vocabulary of {tok.vocab_size}")
    sep = None if tok.separator is None else np.array([tok.separator], dtype=dtype)
    separators = 0  # separators emitted so far: document d is preceded by exactly d of them
    for doc, ids in tok.encode_files(paths, opened):
        if sep is not None:
            for _ in range(doc - separators):
                yield sep
            separators = doc
        yield ids.astype(dtype, copy=False)
    if sep is not None:  # documents that encoded to no piece at all still get their boundary
        for _ in range(len(paths) - 1 - separators):
            yield sep
