"""``ddiloco prepare-data`` and tokenizer.json corpora: the written token files read back by
``tokens:`` are the tokens of tokenising the text directly (and of ``text-dir:``)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ddiloco.training import prepare_data
from ddiloco.training.data import Corpus, DataConfig, load_corpus, split_files, tokenizer
from ddiloco.training.model import ModelConfig

tokenizers = pytest.importorskip("tokenizers")

DDILOCO = Path(sys.executable).with_name("ddiloco")
"""The installed command: a few runs prove the entry point; the rest run the module (the same
``main``) because every ``ddiloco`` start lists all commands, which imports torch (seconds)."""
EOT = "<|endoftext|>"
SAMPLES = [
    "def add(a, b):\n    return a + b\n\n",
    "The quick brown fox jumps over the lazy dog.\n" * 3,
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate.\n",
    "naïve café, smörgåsbord — ünïcödé text\n",
    "import os\nimport sys\n\nclass Thing:\n    pass\n",
]


def _bpe(path: Path, special: list[str]) -> Path:
    """A tiny byte-level BPE trained on SAMPLES, saved as a tokenizer.json."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=420, special_tokens=special, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SAMPLES * 4, trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tokenizers")
    _bpe(d / "bpe.json", [EOT])
    _bpe(d / "no-separator.json", [])
    big = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}, unk_token="[UNK]"))
    big.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    big.save(str(d / "big.json"))
    return d


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    for i in range(40):
        sub = root / f"part{i % 4}"
        sub.mkdir(exist_ok=True)
        (sub / f"doc{i}.{['txt', 'py', 'md'][i % 3]}").write_text(SAMPLES[i % len(SAMPLES)] * (1 + i % 7) + f"#{i}\n")
    (root / "part0" / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))  # invalid UTF-8
    (root / "skip.bin").write_bytes(b"\x00\x01")
    (root / "empty.txt").write_text("")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.txt").write_text("never read")
    return root


def _command(*args: object, installed: bool = False) -> list[str]:
    head = [str(DDILOCO), "prepare-data"] if installed else [sys.executable, "-m", "ddiloco.training.prepare_data"]
    return [*head, *map(str, args)]


def _cli(*args: object, installed: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_command(*args, installed=installed), capture_output=True, text=True, timeout=120)


def _vocab(tokenizer: Path) -> int:
    return tokenizers.Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)


def _tokens(folder: Path, **cfg: object) -> Corpus:
    return load_corpus(DataConfig(corpus=f"tokens:{folder}", **cfg))


def _listing(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def _direct(tokenizer: Path, root: Path, files: tuple[str, ...]) -> np.ndarray:
    """The split as tokenizers itself encodes it: each whole file, EOT between files."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer))
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for i, rel in enumerate(files):
        if i:
            ids.append(eot)
        ids += tok.encode((root / rel).read_bytes().decode("utf-8", "replace"), add_special_tokens=False).ids
    return np.array(ids)


def test_cli_bytes_output_is_the_text_dir_corpus(texts: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _cli("--input", texts, "--out", out, installed=True)
    assert r.returncode == 0, r.stderr
    assert "prepare-data: train done" in r.stderr and "prepare-data: eval done" in r.stderr
    assert "dtype uint16; vocab_size 256" in r.stdout and f"tokens:{out}" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left behind
    text = load_corpus(DataConfig(corpus=f"text-dir:{texts}", max_bytes=1 << 30))
    assert list(text.train_files) != sorted(text.train_files)  # the default order: shuffled, seed 0
    prepared = _tokens(out)
    assert np.array_equal(np.asarray(prepared.train), text.train)
    assert np.array_equal(np.asarray(prepared.eval), text.eval)
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["order"], meta["seed"]) == ("shuffled", 0) and "shuffled order (seed 0)" in r.stdout
    assert meta["format"] == "ddiloco-tokens" and meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    assert meta["tokenizer"] == {"kind": "bytes", "vocab_size": 256, "separator_id": 0}
    assert meta["documents"] == {"train": len(text.train_files), "eval": len(text.eval_files)}
    assert meta["tokens"] == {"train": text.train.size, "eval": text.eval.size}
    assert meta["files"]["val.bin"] == {"split": "eval", "tokens": text.eval.size, "documents": len(text.eval_files)}
    assert (out / "train.bin").stat().st_size == 2 * text.train.size


@pytest.mark.parametrize(("flags", "data"), [
    (["--seed", "7"], {"seed": 7}),
    (["--order", "shuffled", "--seed", "-3"], {"order": "shuffled", "seed": -3}),
    (["--order", "contiguous"], {"order": "contiguous"}),
    (["--order", "contiguous", "--seed", "7"], {"order": "contiguous", "seed": 2}),  # no seed in a sorted layout
])
def test_prepared_tokens_follow_the_data_order(flags: list[str], data: dict[str, object], texts: Path,
                                               tmp_path: Path) -> None:
    """prepare-data --order/--seed lays the train files out as data.order/data.seed lay out text-dir:."""
    out = tmp_path / "out"
    assert prepare_data.main(["--input", str(texts), "--out", str(out), *flags]) == 0
    text = load_corpus(DataConfig(corpus=f"text-dir:{texts}", max_bytes=1 << 30, **data))  # type: ignore[arg-type]
    prepared = _tokens(out)
    assert np.array_equal(np.asarray(prepared.train), text.train)
    assert np.array_equal(np.asarray(prepared.eval), text.eval)
    contiguous = data.get("order") == "contiguous"
    assert (list(text.train_files) == sorted(text.train_files)) is contiguous
    meta = json.loads((out / "meta.json").read_text())
    assert meta["order"] == data.get("order", "shuffled") and meta["seed"] == int(flags[-1] if "--seed" in flags else 0)
    default = load_corpus(DataConfig(corpus=f"text-dir:{texts}", max_bytes=1 << 30))
    assert not np.array_equal(np.asarray(prepared.train), default.train)  # the order changed the layout
    assert np.array_equal(np.asarray(prepared.eval), default.eval)  # and never the eval split
    assert sorted(text.train_files) == sorted(default.train_files)


def test_cli_tokenizer_output_is_direct_tokenisation(texts: Path, tok_dir: Path, tmp_path: Path) -> None:
    bpe = tok_dir / "bpe.json"
    vocab = _vocab(bpe)
    assert 256 < vocab < 512
    r = _cli("--input", texts, "--out", tmp_path / "out", "--tokenizer", bpe)
    assert r.returncode == 0, r.stderr
    prepared = _tokens(tmp_path / "out")
    text = load_corpus(DataConfig(corpus=f"text-dir:{texts}", max_bytes=1 << 30, tokenizer=str(bpe)))
    assert text.train.dtype == np.uint16 and text.vocab_size == prepared.vocab_size == vocab
    assert np.array_equal(np.asarray(prepared.train), _direct(bpe, texts, text.train_files))
    assert np.array_equal(np.asarray(prepared.eval), _direct(bpe, texts, text.eval_files))
    assert np.array_equal(np.asarray(prepared.train), text.train)
    assert np.array_equal(np.asarray(prepared.eval), text.eval)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "tokenizers" and meta["tokenizer"]["separator"] == EOT
    assert meta["tokenizer"]["separator_id"] == 0 and len(meta["tokenizer"]["sha256"]) == 64
    DataConfig(corpus=f"tokens:{tmp_path / 'out'}").check_model(ModelConfig(vocab_size=vocab))
    with pytest.raises(ValueError, match=f"needs vocab_size >= {vocab}"):
        DataConfig(corpus=f"tokens:{tmp_path / 'out'}").check_model(ModelConfig(vocab_size=vocab - 1))


def test_text_dir_with_tokenizers(texts: Path, tok_dir: Path) -> None:
    bpe, plain, big = tok_dir / "bpe.json", tok_dir / "no-separator.json", tok_dir / "big.json"
    cfg = DataConfig(corpus=f"text-dir:{texts}", tokenizer=str(bpe))
    assert cfg.corpus_vocab_size() == _vocab(bpe)
    cfg.check_model(ModelConfig(vocab_size=512))
    with pytest.raises(ValueError, match=rf"vocab_size {_vocab(bpe)}: the model needs vocab_size >= {_vocab(bpe)}, "
                                         "got 256"):
        cfg.check_model(ModelConfig(vocab_size=256))
    joined = load_corpus(DataConfig(corpus=f"text-dir:{texts}", tokenizer=str(plain)))
    assert np.array_equal(joined.train, np.concatenate(
        [_direct(plain, texts, (f,)) for f in joined.train_files]))  # no separator: nothing in between
    wide = load_corpus(DataConfig(corpus=f"text-dir:{texts}", tokenizer=str(big)))
    assert wide.train.dtype == np.uint32 and wide.vocab_size == 70_001
    assert int(wide.train.max()) == 70_000  # every word is unknown to this vocabulary
    with pytest.raises(ValueError, match="applies to 'text-dir:PATH' corpora only"):
        DataConfig(tokenizer=str(bpe))


def test_tokenizer_file_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="no such file"):
        DataConfig(corpus=f"text-dir:{tmp_path}", tokenizer=str(tmp_path / "missing.json")).corpus_vocab_size()
    (tmp_path / "broken.json").write_text('{"model": "not a tokenizer"}')
    with pytest.raises(ValueError, match=r"is not a readable tokenizer\.json"):
        DataConfig(corpus=f"text-dir:{tmp_path}", tokenizer=str(tmp_path / "broken.json")).corpus_vocab_size()
    _bpe(tmp_path / "fresh.json", [EOT])
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # the import fails even though it is installed
    with pytest.raises(ValueError, match=r"pip install 'ddiloco-training\[hf\]'"):
        DataConfig(corpus=f"text-dir:{tmp_path}", tokenizer=str(tmp_path / "fresh.json")).corpus_vocab_size()
    assert prepare_data.main(["--input", str(tmp_path), "--out", str(tmp_path / "o"),
                              "--tokenizer", str(tmp_path / "fresh.json")]) == 2
    assert not (tmp_path / "o").exists()


def test_long_documents_are_encoded_in_pieces_cut_between_words(
    tmp_path: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer, "_PIECE_CHARS", 4096)  # many cuts in a small text (1 MiB in use)
    monkeypatch.setattr(tokenizer, "_READ_BYTES", 1000)
    text = "".join(SAMPLES[i % len(SAMPLES)] + ("\n\n" if i % 3 else "    indented\n") for i in range(3000))
    (tmp_path / "long.txt").write_text(text)
    with open(tmp_path / "long.txt", "rb") as f:
        pieces = list(tokenizer._text_pieces(f))
    assert "".join(pieces) == text and len(pieces) > 30
    assert all(len(piece) <= tokenizer._PIECE_CHARS for piece in pieces)
    for a, b in itertools.pairwise(pieces):
        assert a[-1].isalpha() and b[0] == " " and b[1].isalpha(), (a[-5:], b[:5])
    whole = tokenizers.Tokenizer.from_file(str(tok_dir / "bpe.json")).encode(text, add_special_tokens=False).ids
    in_pieces = np.concatenate(list(tokenizer.encode_documents(
        tokenizer.load_tokenizer(str(tok_dir / "bpe.json")), [tmp_path / "long.txt"], np.dtype("<u2"))))
    assert np.array_equal(in_pieces, whole)  # byte-level BPE: cuts between words change nothing
    (tmp_path / "no-words.txt").write_text("7" * 10_000)  # no place between words: cut at the limit
    with open(tmp_path / "no-words.txt", "rb") as f:
        assert [len(p) for p in tokenizer._text_pieces(f)] == [4096, 4096, 1808]


def test_refusals_and_force_leave_the_folder_untouched(texts: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = _listing(out)
    r = _cli("--input", texts, "--out", out, "--force")
    assert r.returncode == 2 and "holds files prepare-data did not write (notes.txt)" in r.stderr
    assert _listing(out) == before
    assert prepare_data.main(["--input", str(texts), "--out", str(out)]) == 2
    assert _listing(out) == before
    (out / "notes.txt").unlink()
    assert prepare_data.main(["--input", str(texts), "--out", str(out), "--max-bytes", "2000"]) == 0
    previous = _listing(out)
    assert prepare_data.main(["--input", str(texts), "--out", str(out)]) == 2  # a previous output, no --force
    assert _listing(out) == previous
    assert prepare_data.main(["--input", str(texts), "--out", str(out), "--force"]) == 0
    assert json.loads((out / "meta.json").read_text())["max_bytes"] is None
    assert _listing(out)["train.bin"][0] != previous["train.bin"][0]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_bad_inputs_exit_2_and_write_nothing(
    texts: Path, tok_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binaries = tmp_path / "binaries"
    binaries.mkdir()
    (binaries / "x.bin").write_bytes(b"\x00")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    out = tmp_path / "out"
    cases = {  # expected message -> arguments
        "does not exist": ["--input", tmp_path / "missing", "--out", out],
        "no text files": ["--input", binaries, "--out", out],
        "does not fit uint16": ["--input", texts, "--out", out, "--tokenizer", tok_dir / "big.json",
                                "--dtype", "uint16"],
        "nope.json': no such file": ["--input", texts, "--out", out, "--tokenizer", tmp_path / "nope.json"],
        "is not a readable tokenizer.json": ["--input", texts, "--out", out, "--tokenizer", a_file],
        "is not a folder": ["--input", texts, "--out", a_file],
        "--eval-modulus must be >= 2": ["--input", texts, "--out", out, "--eval-modulus", "1"],
        "--max-bytes must be >= 1": ["--input", texts, "--out", out, "--max-bytes", "0"],
        "no file fits --max-bytes 3": ["--input", texts, "--out", out, "--max-bytes", "3"],
        "same relative path": ["--input", texts / "part0", texts / "part1", texts / "part0", "--out", out],
        "invalid choice: 'int8'": ["--input", texts, "--out", out, "--dtype", "int8"],
        "--order: invalid choice: 'random'": ["--input", texts, "--out", out, "--order", "random"],
        "--seed: invalid int value: 'x'": ["--input", texts, "--out", out, "--seed", "x"],
    }
    before = sorted(p.name for p in tmp_path.iterdir())
    for msg, args in cases.items():
        try:
            code = prepare_data.main([str(a) for a in args])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        assert code == 2 and msg in capsys.readouterr().err, msg
    r = _cli("--input", tmp_path / "missing", "--out", out)
    assert r.returncode == 2 and f"ddiloco prepare-data: input {tmp_path / 'missing'} does not exist" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert a_file.read_text() == "x"


def test_single_file_several_inputs_and_dtypes(texts: Path, tok_dir: Path, tmp_path: Path) -> None:
    one = texts / "part1" / "doc1.py"
    assert prepare_data.main(["--input", str(one), "--out", str(tmp_path / "one")]) == 0
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["meta.json", "train.bin"]
    assert json.loads((tmp_path / "one" / "meta.json").read_text())["eval_split"] == "tail"
    c = _tokens(tmp_path / "one", eval_modulus=4)
    whole = np.frombuffer(one.read_bytes(), dtype=np.uint8)
    assert np.array_equal(np.concatenate([np.asarray(c.train), np.asarray(c.eval)]), whole)
    assert len(c.eval) == len(whole) // 4

    inputs = [texts / "part2", texts / "part3"]
    assert prepare_data.main(["--input", *map(str, inputs), "--out", str(tmp_path / "two"),
                              "--dtype", "uint32", "--eval-modulus", "3"]) == 0
    keys = {f"{d.name}/{p.name}": p.stat().st_size for d in inputs for p in d.iterdir()}
    train, evals = split_files(keys, None, 3)
    c = _tokens(tmp_path / "two")
    assert c.train.dtype == np.dtype("<u4") and (tmp_path / "two" / "train.bin").stat().st_size == 4 * len(c.train)
    expected = b"\x00".join((texts / k).read_bytes() for k in train)
    assert np.array_equal(np.asarray(c.train), np.frombuffer(expected, dtype=np.uint8))
    assert len(c.eval) == len(b"\x00".join((texts / k).read_bytes() for k in evals))

    assert prepare_data.main(["--input", str(texts), "--out", str(tmp_path / "wide"),
                              "--tokenizer", str(tok_dir / "big.json")]) == 0
    assert json.loads((tmp_path / "wide" / "meta.json").read_text())["dtype"] == "uint32"
    assert _tokens(tmp_path / "wide").vocab_size == 70_001


def test_sigterm_mid_write_leaves_nothing(tmp_path: Path, tok_dir: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    block = "".join(SAMPLES) * 2000
    for i in range(12):
        (src / f"big{i}.txt").write_text(block)  # ~24 MB of text through a BPE: seconds of work
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen(_command("--input", src, "--out", work / "out", "--tokenizer", tok_dir / "bpe.json"),
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(work.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, "finished before it could be interrupted"
        staged = [p.name for p in work.iterdir()]
        assert len(staged) == 1 and staged[0].startswith(".out.prepare-")
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM
    assert list(work.iterdir()) == []
