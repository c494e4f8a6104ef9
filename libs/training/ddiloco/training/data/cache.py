"""The on-disk cache of built corpora.

Building the stdlib corpus reads ~700 files; the result is cached under ``$DDILOCO_CACHE_DIR``
(default ``~/.cache/ddiloco``) in one file (``sources.stdlib_cache_path`` names it). The file
carries a header with the payload's sha256 and is written to a temp file, fsynced and renamed, so
concurrent learners starting at once never read a half-written cache; a corrupt or truncated
cache is refused here (``read_cache`` raises ValueError) and rebuilt by the caller.

The cache key (the file name) holds the data order and, for ``shuffled``, the seed; the header
records that layout too, and ``read_cache`` refuses a file whose layout is not the one asked for
(a file copied or renamed into another key's place), so a corpus of another order or seed is
never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.training.data.corpus import Corpus

CACHE_ENV = "DDILOCO_CACHE_DIR"
CACHE_FORMAT = 2
"""2: the header records the layout (data order and seed)."""
_CACHE_MAGIC = b"DDILOCO-CORPUS\x00"


def default_cache_dir() -> Path:
    """The one place the environment is read for data: ``$DDILOCO_CACHE_DIR`` or ``~/.cache/ddiloco``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "ddiloco"


def write_cache(path: Path, corpus: Corpus, layout: dict[str, Any]) -> None:
    """Write ``corpus`` to ``path`` atomically; ``layout`` (the data order, and the seed when it
    is used) goes into the header for ``read_cache`` to check."""
    payload = np.asarray(corpus.train).tobytes() + np.asarray(corpus.eval).tobytes()
    header = json.dumps(
        {
            "name": corpus.name,
            "train_len": int(corpus.train.size),
            "eval_len": int(corpus.eval.size),
            "train_files": corpus.train_files,
            "eval_files": corpus.eval_files,
            "layout": layout,
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


def read_cache(path: Path, layout: dict[str, Any]) -> Corpus:
    """The cached corpus at ``path``; ValueError when it is not a complete, intact cache file, or
    when it was built with another layout than ``layout`` (data order and seed)."""
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
    if meta.get("layout") != layout:
        raise ValueError(f"built with layout {meta.get('layout')}, not {layout}")
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
