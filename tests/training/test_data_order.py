"""The data order (``DataConfig.order``): a text corpus's train files are laid out shuffled by
``data.seed``, so each contiguous learner shard draws from the whole corpus as data-parallel
training's batches do; ``contiguous`` keeps the sorted, non-IID layout. The eval split, the cap's
selection and the on-disk cache stay consistent whatever the order and seed."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddiloco.core.config import ConfigError, build
from ddiloco.training.data import (
    Corpus,
    DataConfig,
    TokenShard,
    load_corpus,
    order_files,
    sources,
    split_files,
    stdlib_cache_path,
)
from ddiloco.training.data.cache import read_cache

LEARNERS = 3
MIN_FILES = 6
"""Packages with at least this many train files are measured (a smaller one cannot be in every
third of a layout reliably, shuffled or not)."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("order-cache")


def _stdlib(cache_dir: Path, **kw: object) -> Corpus:
    return load_corpus(DataConfig(cache_dir=str(cache_dir), **kw))  # type: ignore[arg-type]


def _packages_per_shard(corpus: Corpus) -> tuple[dict[str, set[int]], list[str]]:
    """Which of the LEARNERS contiguous shards (``TokenShard``) each top-level stdlib package's
    train files fall into, and the packages with at least MIN_FILES train files."""
    root = sources.stdlib_root()
    shards = [TokenShard(corpus.train, s, LEARNERS) for s in range(LEARNERS)]
    where: dict[str, set[int]] = collections.defaultdict(set)
    files: collections.Counter[str] = collections.Counter()
    start = 0
    for rel in corpus.train_files:
        stop = start + (root / rel).stat().st_size
        if "/" in rel:  # a file of a package (top-level modules are packages of one file)
            package = rel.split("/")[0]
            files[package] += 1
            where[package] |= {s.shard_index for s in shards if start < s.stop and stop > s.start}
        start = stop + 1  # the separator
    assert start - 1 == len(corpus.train)  # the layout is the files in train_files order
    return where, sorted(p for p, n in files.items() if n >= MIN_FILES)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shuffled_shards_each_draw_from_the_whole_library(cache_dir: Path, seed: int) -> None:
    where, packages = _packages_per_shard(_stdlib(cache_dir, seed=seed))  # the default: shuffled
    assert len(packages) >= 8, packages
    for s in range(LEARNERS):
        covered = [p for p in packages if s in where[p]]
        assert len(covered) >= 2 / 3 * len(packages), (s, sorted(set(packages) - set(covered)))
    everywhere = [p for p in packages if len(where[p]) == LEARNERS]
    assert len(everywhere) >= 2 / 3 * len(packages), sorted(set(packages) - set(everywhere))


def test_contiguous_shards_split_the_library_by_package(cache_dir: Path) -> None:
    where, packages = _packages_per_shard(_stdlib(cache_dir, order="contiguous"))
    assert len(packages) >= 8, packages
    for s in range(LEARNERS):
        covered = [p for p in packages if s in where[p]]
        assert len(covered) <= len(packages) / 2, (s, covered)
    # sorted by path, a package's files are adjacent: only the two cuts between shards can split one
    assert len([p for p in packages if len(where[p]) > 1]) <= LEARNERS - 1


def test_same_seed_same_layout_other_seed_other_layout(cache_dir: Path, tmp_path: Path) -> None:
    a = _stdlib(cache_dir, seed=4)
    again = _stdlib(tmp_path, seed=4)  # built afresh, in an empty cache
    assert a.train_files == again.train_files and np.array_equal(a.train, again.train)
    b = _stdlib(cache_dir, seed=5)
    assert a.train_files != b.train_files and not np.array_equal(a.train, b.train)
    assert sorted(a.train_files) == sorted(b.train_files) and len(a.train) == len(b.train)
    contiguous = _stdlib(cache_dir, order="contiguous", seed=4)
    assert list(contiguous.train_files) == sorted(a.train_files)
    assert _stdlib(cache_dir, order="contiguous", seed=9).train_files == contiguous.train_files  # seed unused


@pytest.mark.parametrize("cap", [1 << 20, 8 << 20])
def test_eval_split_and_cap_do_not_depend_on_order_or_seed(cache_dir: Path, cap: int) -> None:
    corpora = [_stdlib(cache_dir, max_bytes=cap, **kw) for kw in  # type: ignore[arg-type]
               ({"order": "contiguous"}, {"seed": 0}, {"seed": 1}, {"seed": 12345})]
    first = corpora[0]
    assert list(first.eval_files) == sorted(first.eval_files)
    for c in corpora[1:]:
        assert c.eval_files == first.eval_files and np.array_equal(c.eval, first.eval)
        assert set(c.train_files) == set(first.train_files)  # the same files under the cap


def test_order_is_a_pure_function_of_files_order_and_seed() -> None:
    files = ["a.py", "b.py", "c/d.py", "c/e.py", "f.md", "g/h/i.txt"]
    # pinned: the layout must not change between releases, machines or Python versions
    assert order_files(files, "shuffled", 0) == ["c/d.py", "c/e.py", "f.md", "a.py", "b.py", "g/h/i.txt"]
    assert order_files(files, "shuffled", 1) == ["a.py", "f.md", "g/h/i.txt", "c/d.py", "b.py", "c/e.py"]
    assert order_files(list(reversed(files)), "shuffled", 0) == order_files(files, "shuffled", 0)
    assert order_files(list(reversed(files)), "contiguous", 3) == files
    sizes = {f: 10 for f in files}
    assert split_files(sizes, None, 3, order="contiguous")[0] == sorted(split_files(sizes, None, 3, seed=8)[0])


def test_shuffled_layout_ignores_python_hash_randomisation(cache_dir: Path) -> None:
    train = list(_stdlib(cache_dir, seed=3).train_files)
    script = (
        "import sys\n"
        "from ddiloco.training.data import order_files\n"
        "print('\\n'.join(order_files(sorted(sys.stdin.read().split()), 'shuffled', 3)))\n"
    )
    for hash_seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", script], input="\n".join(train), capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True)
        assert r.stdout.split() == train


def test_cache_never_mixes_orders_or_seeds(tmp_path: Path) -> None:
    shared, fresh = tmp_path / "shared", tmp_path / "fresh"
    layouts: tuple[dict[str, object], ...] = ({"order": "contiguous"}, {"seed": 0}, {"seed": 1})
    paths = [stdlib_cache_path(DataConfig(cache_dir=str(shared), **kw)) for kw in layouts]  # type: ignore[arg-type]
    assert len(set(paths)) == 3
    # the seed is not part of a contiguous layout, nor of its key
    assert stdlib_cache_path(DataConfig(cache_dir=str(shared), order="contiguous", seed=7)) == paths[0]
    built = [_stdlib(shared, **kw) for kw in layouts]
    assert sorted(p.name for p in shared.iterdir()) == sorted(p.name for p in paths)
    stamps = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in paths]
    for i, (kw, corpus) in enumerate(zip(layouts, built, strict=True)):
        cached = _stdlib(shared, **kw)  # read from its own cache file
        expected = _stdlib(fresh / str(i), **kw)  # built from the files
        for c in (corpus, cached):
            assert c.train_files == expected.train_files and np.array_equal(c.train, expected.train)
            assert np.array_equal(c.eval, expected.eval)
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in paths] == stamps  # hits: nothing rewritten
    assert built[0].train_files != built[1].train_files != built[2].train_files

    # a cache file of another layout in this layout's place (copied, renamed) is refused and rebuilt
    with pytest.raises(ValueError, match="layout"):
        read_cache(paths[1], {"order": "shuffled", "seed": 1})
    shutil.copyfile(paths[1], paths[2])
    again = _stdlib(shared, seed=1)
    assert again.train_files == built[2].train_files and np.array_equal(again.train, built[2].train)
    assert read_cache(paths[2], {"order": "shuffled", "seed": 1}).train_files == built[2].train_files


def test_bad_order_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match=r"data\.order: Input should be 'shuffled' or 'contiguous' \(got 'random'\)"):
        build(DataConfig, {"order": "random"}, "data")
    with pytest.raises(ValueError, match="'shuffled' or 'contiguous'"):
        DataConfig(order="sorted")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data order must be one of 'shuffled', 'contiguous', got 'sorted'"):
        order_files(["a.py"], "sorted", 0)  # type: ignore[arg-type]


def test_token_files_keep_their_written_order(tmp_path: Path) -> None:
    """``tokens:`` corpora are used as given: the order and seed change nothing."""
    (tmp_path / "train.bin").write_bytes(np.arange(1000, dtype="<u2").tobytes())
    (tmp_path / "val.bin").write_bytes(np.arange(100, dtype="<u2").tobytes())
    for kw in ({"order": "contiguous"}, {"seed": 0}, {"seed": 9}):
        c = load_corpus(DataConfig(corpus=f"tokens:{tmp_path}", **kw))  # type: ignore[arg-type]
        assert np.array_equal(np.asarray(c.train), np.arange(1000))
        assert np.array_equal(np.asarray(c.eval), np.arange(100))
