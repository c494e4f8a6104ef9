"""``ddiloco prepare-data --input PATH [PATH...] --out DIR``: tokenise text files into token files for a tokens: corpus.

Reads text files (folders are walked as ``text-dir:`` walks them: ``.txt``/``.py``/``.md``,
hidden folders and ``__pycache__`` skipped; a file named on the command line is read whatever
its suffix), tokenises them with ``--tokenizer`` (``bytes``, or a Hugging Face ``tokenizer.json``)
and writes ``DIR/train.bin``, ``DIR/val.bin`` and ``DIR/meta.json`` (see ``docs/data.md``).

Design decisions:

- **The same corpus as ``text-dir:``.** File selection (``--max-bytes``, the salted-hash order),
  the eval split (``is_eval_file`` on the relative path, with the same fallback for a folder
  where no file hashes into eval), document order (``--order``/``--seed``, as ``data.order``/
  ``data.seed``: train files shuffled by a sha1 of (seed, path) by default, or sorted by path)
  and separators all come from ``ddiloco.training.data``: ``tokens:DIR`` after ``prepare-data
  --input SRC`` trains on exactly the tokens of ``text-dir:SRC`` with the same tokenizer, cap,
  eval modulus, order and seed. ``tokens:`` uses files as written, so the order chosen here is
  the one its learners' contiguous shards are cut from. With several inputs a
  file's relative path is prefixed with its input's folder name (``a/x.txt``, ``b/x.txt``), so
  the split stays a property of each file. When there is nothing to split by file (one file, or
  every file hashing into eval), everything is train and no ``val.bin`` is written:
  ``tokens:`` then holds out the tail, as for any folder without an eval file.
- **Streaming, bounded memory.** Tokens are appended to the split's file as each batch of text
  is encoded; no split is ever held in memory, so the corpus may be far larger than RAM.
- **All or nothing.** Everything is written into a hidden sibling folder (``.DIR.prepare-*``),
  each file fsynced, then renamed to ``DIR``. Until that rename ``DIR`` is untouched; any error,
  Ctrl-C or SIGTERM removes the partial folder. An existing non-empty ``DIR`` is refused, and
  ``--force`` replaces only a previous output (a folder of ``train.bin``/``val.bin``/
  ``meta.json``, nothing else), so it can never delete unrelated files.
- **Exit codes.** 0 on success; 2 for bad input (a missing input, no text files, a tokenizer
  that cannot be read, a vocabulary too large for ``--dtype uint16``, a refused ``--out``), with
  nothing written; 1 when writing fails (a full disk), with the partial output removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.training.data import (
    META_NAME,
    TOKEN_DTYPES,
    TOKENS_FORMAT,
    DataOrder,
    TextTokenizer,
    encode_documents,
    load_tokenizer,
    order_files,
    scan_text_dir,
    split_files,
    token_dtype_for,
)

TRAIN_FILE = "train.bin"
EVAL_FILE = "val.bin"
OUTPUT_FILES = frozenset({TRAIN_FILE, EVAL_FILE, META_NAME})
"""What a previous output may hold for ``--force`` to replace it."""
PROGRESS_EVERY_S = 2.0


class Refused(Exception):
    """Bad input: reported with exit status 2, nothing written."""


def _sources(inputs: list[str]) -> tuple[dict[str, Path], dict[str, int]]:
    """Relative key -> path and key -> size of every text file the inputs name."""
    roots = [Path(i).expanduser() for i in inputs]
    paths: dict[str, Path] = {}
    sizes: dict[str, int] = {}
    for given, root in zip(inputs, roots, strict=True):
        if not root.exists():
            raise Refused(f"input {given} does not exist")
        if root.is_dir():
            found = scan_text_dir(root)
            located = {rel: root / rel for rel in found}
        elif root.is_file():
            size = root.stat().st_size
            found = {root.name: size} if size else {}
            located = {root.name: root}
        else:
            raise Refused(f"input {given} is neither a file nor a folder")
        prefix = f"{root.resolve().name}/" if len(roots) > 1 else ""
        for rel, size in found.items():
            key = prefix + rel
            if key in paths:
                raise Refused(
                    f"inputs give two files the same relative path {key!r} ({paths[key]} and {located[rel]}): "
                    "the eval split is decided by that path, so rename one input folder"
                )
            paths[key], sizes[key] = located[rel], size
    return paths, sizes


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise Refused(f"--out {out} exists and is not a folder")
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir())
        if entries and not force:
            raise Refused(f"--out {out} is not empty ({', '.join(entries[:5])}{', ...' if len(entries) > 5 else ''}); "
                          "give --force to replace a previous prepare-data output, or choose another folder")
        foreign = [e for e in entries if e not in OUTPUT_FILES]
        if foreign:
            raise Refused(f"--out {out} holds files prepare-data did not write ({', '.join(foreign[:5])}): "
                          "--force replaces only a previous output; choose another folder")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Progress:
    """One line on stderr at most every ``PROGRESS_EVERY_S`` seconds, and one per finished split."""

    def __init__(self, split: str, paths: list[Path], sizes: list[int]) -> None:
        self.split, self.paths, self.total = split, paths, sum(sizes)
        self.done_before = [0, *np.cumsum(sizes).tolist()]
        self.doc, self.tokens = 0, 0
        self.started = self.last = time.monotonic()

    def opened(self, doc: int) -> None:
        self.doc = doc
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.line(f"file {doc + 1}/{len(self.paths)}", self.done_before[doc])

    def line(self, where: str, read: int) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        share = read / self.total if self.total else 1.0
        print(f"prepare-data: {self.split} {where} ({share:.0%} of {self.total / 1e6:.1f} MB), "
              f"{self.tokens:,} tokens, {read / elapsed / 1e6:.1f} MB/s", file=sys.stderr, flush=True)


def _write_split(path: Path, tok: TextTokenizer, files: list[Path], sizes: list[int], dtype: np.dtype,
                 split: str) -> int:
    """Stream the tokens of ``files`` into ``path``; the number of tokens written."""
    progress = _Progress(split, files, sizes)
    with open(path, "wb") as f:
        for ids in encode_documents(tok, files, dtype, progress.opened):
            f.write(ids.astype(dtype, copy=False).tobytes())
            progress.tokens += int(ids.size)
        f.flush()
        os.fsync(f.fileno())
    progress.line(f"done, {len(files)} files", progress.total)
    return progress.tokens


def _staging_dir(out: Path) -> Path:
    """A new hidden sibling of ``out`` (same file system, so the final rename is atomic), created
    with the usual permissions (the umask's, not mkdtemp's 0700: it becomes ``out``)."""
    while True:
        staged = out.parent / f".{out.name}.prepare-{secrets.token_hex(4)}"
        try:
            staged.mkdir()
            return staged
        except FileExistsError:
            continue


def _install(staged: Path, out: Path) -> None:
    """Move the finished ``staged`` folder to ``out`` (absent, empty, or a previous output)."""
    if not out.exists() or not any(out.iterdir()):
        os.replace(staged, out)  # POSIX rename replaces an empty folder in one step
    else:
        aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.replace(out, aside)
        try:
            os.replace(staged, out)
        except OSError:
            os.replace(aside, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_dir(out.parent)


def _block_interrupts() -> set[int | signal.Signals] | None:
    """Block SIGTERM and SIGINT in this thread (the main thread only, where their handlers run);
    the previous mask, for ``_restore_interrupts``."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})


def _restore_interrupts(previous: set[int | signal.Signals] | None) -> None:
    """Unblock what ``_block_interrupts`` blocked: one that came meanwhile is handled now."""
    if previous is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _terminate_cleanly() -> Iterator[None]:
    """SIGTERM raises SystemExit, so ``finally`` blocks remove partial output (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def prepare(inputs: list[str], out: Path, tokenizer: str = "bytes", eval_modulus: int = 20,
            dtype: str = "auto", max_bytes: int | None = None, force: bool = False,
            order: DataOrder = "shuffled", seed: int = 0) -> dict[str, Any]:
    """Tokenise ``inputs`` into ``out``; the meta written. Raises Refused (nothing written) on bad
    input and OSError when writing fails (partial output removed). ``order`` and ``seed`` lay out
    the train files as ``data.order`` and ``data.seed`` lay out a ``text-dir:`` corpus."""
    paths, sizes = _sources(inputs)
    if not paths:
        raise Refused(f"no text files (.txt/.py/.md, or files named directly) in {' '.join(inputs)}")
    train, evals = split_files(sizes, max_bytes, eval_modulus, order=order, seed=seed)
    if not train and not evals:
        raise Refused(f"no file fits --max-bytes {max_bytes} (the smallest has {min(sizes.values())} bytes)")
    if not train or not evals:  # nothing to split by file: all is train, tokens: holds out the tail
        train, evals = order_files(train + evals, order, seed), []
    _check_out(out, force)
    try:
        tok = load_tokenizer(tokenizer)
    except ValueError as e:
        raise Refused(str(e)) from None
    dtype_name = token_dtype_for(tok.vocab_size) if dtype == "auto" else dtype
    item = TOKEN_DTYPES[dtype_name]
    if np.iinfo(item).max < tok.vocab_size - 1:
        raise Refused(f"the tokenizer's vocab_size {tok.vocab_size} does not fit {dtype_name} "
                      "(ids up to 65535): use --dtype uint32 or auto")
    out.parent.mkdir(parents=True, exist_ok=True)
    # A SIGTERM or Ctrl-C between the staging folder's creation and the ``try`` that removes it
    # would leave it behind: they wait (blocked) until the folder is in the cleanup's hands.
    masked = _block_interrupts()
    try:
        staged = _staging_dir(out)
    except BaseException:
        _restore_interrupts(masked)
        raise
    try:
        _restore_interrupts(masked)
        counts: dict[str, int] = {}
        files_meta: dict[str, dict[str, Any]] = {}
        for split, keys, name in (("train", train, TRAIN_FILE), ("eval", evals, EVAL_FILE)):
            if not keys:
                continue
            n = _write_split(staged / name, tok, [paths[k] for k in keys], [sizes[k] for k in keys], item, split)
            if n == 0:
                raise Refused(f"the {split} split ({len(keys)} files) encodes to no tokens")
            counts[split] = n
            files_meta[name] = {"split": split, "tokens": n, "documents": len(keys)}
        meta = {
            "format": TOKENS_FORMAT,
            "version": 1,
            "dtype": dtype_name,
            "vocab_size": tok.vocab_size,
            "tokenizer": tok.describe(),
            "eval_split": "files" if evals else "tail",
            "eval_modulus": eval_modulus,
            "max_bytes": max_bytes,
            "order": order,
            "seed": seed,
            "tokens": {"train": counts.get("train", 0), "eval": counts.get("eval", 0)},
            "documents": {"train": len(train), "eval": len(evals)},
            "files": files_meta,
            "inputs": [str(Path(i).expanduser().resolve()) for i in inputs],
        }
        with open(staged / META_NAME, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(staged)
        _check_out(out, force)  # again: something may have appeared there while tokenising
        _install(staged, out)
        return meta
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddiloco prepare-data",
        description="Tokenise text files into token files (train.bin, val.bin, meta.json) for tokens:DIR.",
        epilog="Then train with data.corpus: tokens:DIR (see docs/data.md).")
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="text files and folders (folders: every .txt/.py/.md file under them)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (train.bin, val.bin, meta.json)")
    parser.add_argument("--tokenizer", default="bytes", metavar="bytes|FILE.json",
                        help="'bytes' (a token is a byte; default) or a Hugging Face tokenizer.json")
    parser.add_argument("--eval-modulus", type=int, default=20, metavar="N",
                        help="a file is eval when sha1(relative path) %% N == 0 (default 20: ~5%%)")
    parser.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto",
                        help="token type; auto: uint16 when the vocab has <= 65536 ids, else uint32")
    parser.add_argument("--max-bytes", type=int, metavar="N",
                        help="read at most N bytes of text (whole files, the text-dir selection); default: all")
    parser.add_argument("--order", choices=("shuffled", "contiguous"), default="shuffled",
                        help="layout of the train files: shuffled by --seed (default: every contiguous learner "
                             "shard draws from the whole corpus) or contiguous (sorted by path), as data.order")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="seed of the shuffled order (default 0); give the run's data.seed to match text-dir:")
    parser.add_argument("--force", action="store_true", help="replace a previous prepare-data output in DIR")
    args = parser.parse_args(argv)
    if args.eval_modulus < 2:
        parser.error(f"--eval-modulus must be >= 2, got {args.eval_modulus}")
    if args.max_bytes is not None and args.max_bytes < 1:
        parser.error(f"--max-bytes must be >= 1, got {args.max_bytes}")
    out = Path(args.out).expanduser()
    try:
        with _terminate_cleanly():
            meta = prepare(args.input, out, tokenizer=args.tokenizer, eval_modulus=args.eval_modulus,
                           dtype=args.dtype, max_bytes=args.max_bytes, force=args.force,
                           order=args.order, seed=args.seed)
    except Refused as e:
        print(f"ddiloco prepare-data: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"ddiloco prepare-data: writing {out} failed, nothing was written: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ddiloco prepare-data: interrupted, nothing was written", file=sys.stderr)
        return 130
    tokens, docs = meta["tokens"], meta["documents"]
    where = out.resolve()
    eval_part = (f"eval {tokens['eval']:,} tokens ({docs['eval']} files)" if meta["eval_split"] == "files"
                 else "eval: none (tokens: holds out the last 1/eval_modulus of train)")
    print(f"prepared {where}: {docs['train'] + docs['eval']} files; train {tokens['train']:,} tokens "
          f"({docs['train']} files); {eval_part}; dtype {meta['dtype']}; vocab_size {meta['vocab_size']} "
          f"(tokenizer {args.tokenizer}); train files in {meta['order']} order"
          + (f" (seed {meta['seed']})" if meta["order"] == "shuffled" else ""))
    print(f"train on it with data.corpus: tokens:{where} (model.vocab_size >= {meta['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
