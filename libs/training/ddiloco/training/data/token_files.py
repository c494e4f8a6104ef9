"""Token files: ``tokens:PATH``, flat little-endian arrays of token ids, and their sidecar.

PATH is a folder of ``*.bin`` files (or one file), each a flat little-endian array of token ids
(``train.bin``/``val.bin``, as nanoGPT-style pipelines and ``ddiloco prepare-data`` write them),
with an optional ``meta.json`` sidecar. Nothing is read up front but the sidecar and the file
sizes: each file is a read-only ``numpy.memmap`` (the page cache serves it, and a learner touches
only its shard), mapped by ``sources``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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


def token_dtype_for(vocab_size: int) -> str:
    """The smallest token file type for ids below ``vocab_size``: uint16 up to 65536, else uint32."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


@dataclass(frozen=True)
class TokenLayout:
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


def token_layout(spec: str, default_dtype: str) -> TokenLayout:
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
    return TokenLayout(root=root, dtype=dtype, vocab_size=vocab_size, vocab_note=note,
                        meta_path=meta_path if meta is not None else None, train_files=train, eval_files=evals)


def looks_like_uint32(first: np.ndarray) -> bool:
    """uint32 ids below 65536 read as uint16 are ``id, 0, id, 0, ...``: every odd item is zero."""
    head = np.asarray(first[:8192])
    return head.size >= 64 and not head[1::2].any() and bool(head[0::2].any())
