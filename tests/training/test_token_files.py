"""``tokens:PATH`` corpora: memory-mapped uint16/uint32 token files, their sidecar, split and shards."""

from __future__ import annotations

import itertools
import json
import math
import mmap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import structlog
import torch

from ddiloco.training.data import (
    DataConfig,
    TokenSequence,
    TokenShard,
    eval_batches,
    load_corpus,
    shard_generator,
    unigram_entropy,
)
from ddiloco.training.model import ModelConfig

DTYPES = {"uint16": "<u2", "uint32": "<u4"}


def _write(path: Path, tokens: np.ndarray, dtype: str) -> np.ndarray:
    """Write ``tokens`` as a flat little-endian token file; the values as written."""
    array = np.asarray(tokens).astype(DTYPES[dtype])
    array.tofile(path)
    return array


def _meta(folder: Path, dtype: str, vocab_size: int | None = None, **extra: object) -> None:
    meta: dict[str, object] = {"dtype": dtype, **extra}
    if vocab_size is not None:
        meta["vocab_size"] = vocab_size
    (folder / "meta.json").write_text(json.dumps(meta))


def _ids(n: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n, dtype=np.int64)


def _corpus(spec: Path, **cfg: object) -> object:
    return load_corpus(DataConfig(corpus=f"tokens:{spec}", **cfg))


@pytest.mark.parametrize(("dtype", "vocab"), [("uint16", 50257), ("uint32", 100_277)])
def test_round_trip(tmp_path: Path, dtype: str, vocab: int) -> None:
    train = _write(tmp_path / "train.bin", _ids(5000, vocab, 1), dtype)
    val = _write(tmp_path / "val.bin", _ids(700, vocab, 2), dtype)
    assert int(train.max()) > 40_000  # the high ids survive (no byte truncation)
    _meta(tmp_path, dtype, vocab)
    c = _corpus(tmp_path)
    assert isinstance(c.train, TokenSequence) and c.train.dtype == np.dtype(DTYPES[dtype])
    assert np.array_equal(np.asarray(c.train), train) and np.array_equal(np.asarray(c.eval), val)
    assert (c.train_files, c.eval_files, c.vocab_size) == (("train.bin",), ("val.bin",), vocab)
    assert all(isinstance(p, np.memmap) for p in (*c.train.parts, *c.eval.parts))
    assert c.bytes == 5700
    DataConfig(corpus=f"tokens:{tmp_path}").check_model(ModelConfig(vocab_size=vocab))


def test_without_sidecar_token_dtype_decides_and_vocab_check_is_logged(tmp_path: Path) -> None:
    ids = _ids(3000, 60_000, 3)
    _write(tmp_path / "train.bin", ids, "uint32")
    cfg16, cfg32 = DataConfig(corpus=f"tokens:{tmp_path}"), DataConfig(corpus=f"tokens:{tmp_path}", token_dtype="uint32")
    assert np.array_equal(np.asarray(load_corpus(cfg32).train), ids[: 3000 - 3000 // 20])
    with structlog.testing.capture_logs() as logs:
        as16 = load_corpus(cfg16)  # the default reads the same bytes as twice as many uint16 items
        cfg16.check_model(ModelConfig(vocab_size=256))  # unknown vocab: not refused, logged
    assert len(as16.train) + len(as16.eval) == 6000 and as16.vocab_size is None
    events = {e["event"]: e for e in logs}
    assert "token_files_without_meta" in events and "token_vocab_unchecked" in events
    assert "token_files_look_like_uint32" in events  # every odd uint16 item of small uint32 ids is 0
    assert "no meta.json" in events["token_vocab_unchecked"]["reason"]


def test_eval_split_by_file_name(tmp_path: Path) -> None:
    parts = {name: _write(tmp_path / name, _ids(n, 1000, i), "uint16")
             for i, (name, n) in enumerate([("train-1.bin", 300), ("train-0.bin", 200), ("val.bin", 150),
                                            ("eval-extra.bin", 50), ("validation.bin", 10)])}
    (tmp_path / "README.txt").write_text("not tokens")
    (tmp_path / ".partial.bin").write_bytes(b"\x01")  # hidden: a half-written file is never read
    (tmp_path / "nested").mkdir()
    _write(tmp_path / "nested" / "more.bin", _ids(5, 10, 9), "uint16")  # folders are not walked
    _meta(tmp_path, "uint16", 1000)
    c = _corpus(tmp_path)
    assert c.train_files == ("train-0.bin", "train-1.bin")
    assert c.eval_files == ("eval-extra.bin", "val.bin", "validation.bin")
    assert np.array_equal(np.asarray(c.train), np.concatenate([parts["train-0.bin"], parts["train-1.bin"]]))
    assert np.array_equal(np.asarray(c.eval), np.concatenate(
        [parts["eval-extra.bin"], parts["val.bin"], parts["validation.bin"]]))
    assert len(c.train.parts) == 2 and len(c.eval.parts) == 3


@pytest.mark.parametrize("modulus", [20, 7])
def test_folder_without_eval_file_holds_out_the_tail(tmp_path: Path, modulus: int) -> None:
    a = _write(tmp_path / "a.bin", _ids(1000, 500, 1), "uint16")
    b = _write(tmp_path / "b.bin", _ids(333, 500, 2), "uint16")
    whole = np.concatenate([a, b])
    held = len(whole) // modulus
    for _ in range(2):  # the same cut every time
        c = _corpus(tmp_path, eval_modulus=modulus)
        assert np.array_equal(np.asarray(c.train), whole[: len(whole) - held])
        assert np.array_equal(np.asarray(c.eval), whole[len(whole) - held :])
        assert c.train_files == ("a.bin", "b.bin") and c.eval_files == ()
    single = _corpus(tmp_path / "a.bin", eval_modulus=modulus)  # one file: all of it, tail held out
    assert np.array_equal(np.asarray(single.train), a[: 1000 - 1000 // modulus])
    assert np.array_equal(np.asarray(single.eval), a[1000 - 1000 // modulus :])


def test_shards_are_disjoint_and_cover_the_train_tokens(tmp_path: Path) -> None:
    whole = np.concatenate([_write(tmp_path / f"train-{i}.bin", _ids(n, 70_000, i), "uint32")
                            for i, n in enumerate([1000, 1, 2345, 77])])
    _write(tmp_path / "val.bin", _ids(500, 70_000, 9), "uint32")
    _meta(tmp_path, "uint32", 70_000)
    c = _corpus(tmp_path)
    for n in (1, 2, 3, 5, 8, 13):
        shards = [TokenShard(c.train, s, n) for s in range(n)]
        assert shards[0].start == 0 and shards[-1].stop == len(whole)
        assert all(a.stop == b.start for a, b in itertools.pairwise(shards))
        assert all((s.start, s.stop) == (i * len(whole) // n, (i + 1) * len(whole) // n) for i, s in enumerate(shards))
        assert np.array_equal(np.concatenate([np.asarray(s.sequence) for s in shards]), whole)
        assert np.array_equal(np.concatenate([s.tokens.numpy() for s in shards]), whole)
        assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


def test_shard_spanning_two_files_samples_the_expected_windows(tmp_path: Path) -> None:
    first = _write(tmp_path / "train-a.bin", np.arange(1000), "uint16")
    second = _write(tmp_path / "train-b.bin", np.arange(1000) + 30_000, "uint16")
    _write(tmp_path / "val.bin", np.arange(100), "uint16")
    _meta(tmp_path, "uint16", 31_000)
    whole = np.concatenate([first, second]).astype(np.int64)
    shard = TokenShard(_corpus(tmp_path).train, 1, 3)  # tokens [666, 1333): both files
    assert (shard.start, shard.stop) == (666, 1333) and len(shard.sequence.parts) == 2
    context, batch = 200, 64
    x, y = shard.sample_batch(shard_generator(4, 1), batch, context)
    starts = torch.randint(0, len(shard) - context, (batch,), generator=shard_generator(4, 1)).numpy()
    expected = np.stack([whole[shard.start + s : shard.start + s + context + 1] for s in starts])
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (batch, context)
    assert np.array_equal(x.numpy(), expected[:, :-1]) and np.array_equal(y.numpy(), expected[:, 1:])
    crossing = [(shard.start + s < 1000 < shard.start + s + context) for s in starts]
    assert any(crossing) and not all(crossing)  # windows across the file boundary, and inside one


def test_mapped_and_in_memory_shards_give_identical_batches(tmp_path: Path) -> None:
    ids = _ids(4000, 256, 5)
    _write(tmp_path / "train.bin", ids, "uint16")
    _write(tmp_path / "val.bin", ids[:900], "uint16")
    c = _corpus(tmp_path)
    as_bytes = ids.astype(np.uint8)  # the same values as a byte corpus: the batches must not change
    for s in range(3):
        mapped, in_memory = TokenShard(c.train, s, 3), TokenShard(as_bytes, s, 3)
        a = mapped.sample_batch(shard_generator(1, s), 8, 33)
        b = in_memory.sample_batch(shard_generator(1, s), 8, 33)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    mapped_eval, memory_eval = eval_batches(c.eval, 4, 16, 6), eval_batches(as_bytes[:900], 4, 16, 6)
    assert all(torch.equal(p, q) and torch.equal(r, t) for (p, r), (q, t) in zip(mapped_eval, memory_eval, strict=True))


def test_eval_batches_over_several_eval_files(tmp_path: Path) -> None:
    _write(tmp_path / "train.bin", np.arange(500), "uint16")
    v0 = _write(tmp_path / "val-0.bin", np.arange(300) + 1000, "uint16")
    v1 = _write(tmp_path / "val-1.bin", np.arange(300) + 2000, "uint16")
    c = _corpus(tmp_path)
    whole = torch.from_numpy(np.concatenate([v0, v1]).astype(np.int64))
    batches = eval_batches(c.eval, 5, 31, 4)
    assert len(batches) == 4
    assert torch.equal(batches[0][0][0], whole[:31]) and torch.equal(batches[-1][1][-1], whole[-31:])
    for x, y in batches:
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_a_64_mb_file_is_mapped_not_copied(tmp_path: Path) -> None:
    big = tmp_path / "train.bin"
    with open(big, "wb") as f:  # 32 Mi uint16 tokens (sparse: no 64 MB write)
        f.truncate(64 << 20)
    _write(tmp_path / "val.bin", np.arange(4096), "uint16")
    _meta(tmp_path, "uint16", 50257)
    tracemalloc.start()
    try:
        c = _corpus(tmp_path)
        shards = [TokenShard(c.train, s, 2) for s in range(2)]
        for s in shards:
            for _ in range(5):
                s.sample_batch(shard_generator(0, s.shard_index), 16, 1024)
        eval_batches(c.eval, 16, 128, 2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(shards[0]) == 16 << 20
    assert peak < 4 << 20, f"{peak} bytes allocated: the shard was copied"
    part = shards[1].sequence.parts[0]
    assert isinstance(part, np.memmap) and isinstance(part._mmap, mmap.mmap) and not part.flags.writeable
    assert np.shares_memory(part, c.train.parts[0])


def test_unigram_entropy_of_token_files(tmp_path: Path) -> None:
    ids = np.concatenate([np.full(100, 40_000), np.full(100, 7), np.full(200, 65_535)])
    _write(tmp_path / "train.bin", ids, "uint16")
    _write(tmp_path / "val-a.bin", ids[:200], "uint16")
    _write(tmp_path / "val-b.bin", ids[200:], "uint16")
    c = _corpus(tmp_path)
    p = np.array([0.25, 0.25, 0.5])
    assert unigram_entropy(c.eval) == pytest.approx(float(-(p * np.log(p)).sum()))
    assert unigram_entropy(np.full(10, 70_000, dtype=np.uint32)) == 0.0
    assert unigram_entropy(np.arange(300, dtype=np.uint16)) == pytest.approx(math.log(300))


def test_token_sequence_indexing() -> None:
    a, b = np.arange(5, dtype=np.uint16), np.arange(5, 9, dtype=np.uint16)
    seq = TokenSequence([a, np.empty(0, np.uint16), b])
    assert len(seq) == 9 and seq.shape == (9,) and len(seq.parts) == 2
    assert [int(seq[i]) for i in range(9)] == list(range(9)) and int(seq[-1]) == 8
    assert np.array_equal(np.asarray(seq[3:7]), [3, 4, 5, 6]) and len(seq[7:3]) == 0
    assert np.array_equal(seq.take(np.array([[8, 0], [4, 5]])), [[8, 0], [4, 5]])
    assert np.array_equal(np.concatenate(list(seq.chunks(3))), np.arange(9))
    with pytest.raises(IndexError):
        seq[9]
    with pytest.raises(IndexError):
        seq.take(np.array([9]))
    with pytest.raises(ValueError, match="step 1"):
        seq[::2]
    with pytest.raises(ValueError, match="uint8, uint16 or uint32"):
        TokenSequence([np.arange(3)])
    with pytest.raises(ValueError, match="mix"):
        TokenSequence([a, b.astype(np.uint32)])
    with pytest.raises(ValueError, match="uint8, uint16 or uint32"):
        TokenShard(np.arange(100, dtype=np.int64), 0, 1)


def _bad(tmp_path: Path, **cfg: object) -> str:
    with pytest.raises(ValueError) as e:
        load_corpus(DataConfig(corpus=f"tokens:{tmp_path}", **cfg))
    return str(e.value)


def test_bad_token_folders_are_refused_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"{missing} does not exist"):
        _corpus(missing)
    assert "holds no token files" in _bad(tmp_path)  # empty folder
    (tmp_path / "notes.txt").write_text("text, not tokens")
    assert "holds no token files" in _bad(tmp_path)
    _write(tmp_path / "val.bin", np.arange(100), "uint16")
    assert "only eval files" in _bad(tmp_path)
    (tmp_path / "train.bin").write_bytes(b"\x01\x02\x03")
    assert f"token file {tmp_path / 'train.bin'} is 3 bytes, not a whole number of uint16" in _bad(tmp_path)
    (tmp_path / "train.bin").write_bytes(b"\x01\x02\x03\x04\x05\x06")
    assert "not a whole number of uint32" in _bad(tmp_path, token_dtype="uint32")
    (tmp_path / "train.bin").write_bytes(b"")
    assert f"token file {tmp_path / 'train.bin'} is empty" in _bad(tmp_path)
    _write(tmp_path / "train.bin", np.arange(1000), "uint16")
    _meta(tmp_path, "int32")
    assert f"token sidecar {tmp_path / 'meta.json'}: dtype must be 'uint16' or 'uint32', got 'int32'" in _bad(tmp_path)
    _meta(tmp_path, "uint16", vocab_size=70_000)
    assert "vocab_size must be a positive int that fits uint16" in _bad(tmp_path)
    _meta(tmp_path, "uint16", vocab_size="big")
    assert "vocab_size must be a positive int" in _bad(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    assert f"token sidecar {tmp_path / 'meta.json'} is not readable JSON" in _bad(tmp_path)
    (tmp_path / "meta.json").write_text("[1, 2]")
    assert "must hold a JSON object" in _bad(tmp_path)
    _meta(tmp_path, "uint16", 1000, files={"train.bin": {"tokens": 999}})
    assert f"token file {tmp_path / 'train.bin'} holds 1000 tokens but" in _bad(tmp_path)
    _meta(tmp_path, "uint16", 1000, files={"train.bin": {"tokens": 1000}})
    assert len(_corpus(tmp_path).train) == 1000
    (tmp_path / "val.bin").unlink()
    (tmp_path / "meta.json").unlink()
    _write(tmp_path / "train.bin", np.arange(10), "uint16")
    assert "too few to hold out 1/20" in _bad(tmp_path)


def test_config_and_model_checks_for_token_files(tmp_path: Path) -> None:
    _write(tmp_path / "train.bin", np.arange(1000), "uint16")
    _meta(tmp_path, "uint16", 50257)
    cfg = DataConfig(corpus=f"tokens:{tmp_path}")
    assert cfg.corpus_vocab_size() == 50257
    cfg.check_model(ModelConfig(vocab_size=50304))
    with pytest.raises(ValueError, match=r"needs vocab_size >= 50257, got 256"):
        cfg.check_model(ModelConfig(vocab_size=256))
    with pytest.raises(ValueError, match="context"):
        DataConfig(corpus=f"tokens:{tmp_path}", context=64).check_model(ModelConfig(vocab_size=50304))
    with pytest.raises(ValueError, match="does not exist"):
        DataConfig(corpus=f"tokens:{tmp_path / 'gone'}").check_model(ModelConfig())
    with pytest.raises(ValueError, match="'tokens:PATH' needs a folder"):
        DataConfig(corpus="tokens:")
    with pytest.raises(ValueError, match="token_dtype must be 'uint16' or 'uint32'"):
        DataConfig(corpus=f"tokens:{tmp_path}", token_dtype="int64")
    with pytest.raises(ValueError, match="applies to 'text-dir:PATH' corpora only"):
        DataConfig(corpus=f"tokens:{tmp_path}", tokenizer=str(tmp_path / "tokenizer.json"))
    assert DataConfig().corpus_vocab_size() == 256
