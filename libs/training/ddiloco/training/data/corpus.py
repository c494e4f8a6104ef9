"""A corpus as token arrays, and the one rule that splits a text corpus's files into train and eval.

Files are enumerated by relative path (POSIX separators). The ``max_bytes`` cap keeps whole files
in the order of a salted sha1 of their path (a fixed pseudo-random order, so the cap samples the
whole library rather than its first packages alphabetically). A file belongs to the eval split
when ``sha1(path) % eval_modulus == 0`` (~5% with 20): the split of a file never depends on which
other files exist, nor on the data order or seed. The eval files are laid out sorted by path; the
train files in the data order (``order_files``): ``shuffled`` (the default) sorts them by a sha1
of (seed, path), so every contiguous learner shard draws from the whole corpus, as data-parallel
training does; ``contiguous`` sorts them by path (neighbouring files, hence whole packages or
folders, land in the same shard: the non-IID case).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ddiloco.training.data.sequences import TokenSequence
from ddiloco.training.data.tokenizer import BYTE_VOCAB

DataOrder = Literal["shuffled", "contiguous"]
DATA_ORDERS: tuple[DataOrder, ...] = ("shuffled", "contiguous")
"""How a text corpus's train files are laid out (``DataConfig.order``, ``prepare-data --order``)."""


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


def order_files(files: list[str], order: DataOrder, seed: int) -> list[str]:
    """``files`` in the data order: ``contiguous`` sorted by path; ``shuffled`` sorted by the
    sha1 of ``"order:{seed}:"`` + path (ties, which sha1 never gives in practice, by path).

    A pure function of (the set of files, order, seed): the same on every machine, Python version
    and learner (no ``random``, no ``hash()``), so all learners of a fleet agree on the layout and
    on which files each contiguous shard holds.
    """
    if order == "contiguous":
        return sorted(files)
    if order != "shuffled":
        raise ValueError(f"data order must be one of {', '.join(map(repr, DATA_ORDERS))}, got {order!r}")
    salt = f"order:{seed}:".encode()
    return sorted(files, key=lambda r: (_path_hash(r, salt), r))


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


def split_files(
    sizes: dict[str, int], max_bytes: int | None, eval_modulus: int, *, order: DataOrder = "shuffled", seed: int = 0
) -> tuple[list[str], list[str]]:
    """(train files, eval files) of a text corpus: the cap, then the hash split; the train files
    in the data order (``order_files`` with ``order`` and ``seed``), the eval files sorted.

    The one rule every text corpus and ``ddiloco prepare-data`` follow, so a folder prepared
    into token files splits and lays out exactly as ``text-dir:`` does. Which files are kept and
    which are eval never depends on ``order`` or ``seed``. Either list may be empty (no files, or
    a single file): the caller decides whether that is an error.
    """
    files = _select(sizes, max_bytes)
    train_files = [f for f in files if not is_eval_file(f, eval_modulus)]
    eval_files = [f for f in files if is_eval_file(f, eval_modulus)]
    if not eval_files and len(train_files) > 1:
        # A small folder may have no file that hashes into eval: hold out the first by hash order.
        first = min(train_files, key=lambda r: (_path_hash(r), r))
        train_files.remove(first)
        eval_files.append(first)
    return order_files(train_files, order, seed), eval_files
