"""The one rule for a damaged JSON Lines log (docs/events.md), for whole files (``read_jsonl`` /
``load_jsonl``) and live ones (``Tail``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddiloco.core import events
from ddiloco.lab.event_logs import Tail, load_jsonl, read_jsonl, synchronizer_logs


def _line(event: str, t: float, **fields: object) -> str:
    return json.dumps({"event": event, "t": t, **fields}) + "\n"


GOOD = _line(events.SYNC_START, 0.0, synchronizer_id="s0") + _line(events.SYNC_STOP, 1.0)


def test_a_torn_last_line_is_dropped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "synchronizer.jsonl"
    path.write_text(GOOD + '{"event": "merge", "t": 2.0, "frag')
    read = read_jsonl(path)
    assert [e["event"] for e in read.records] == [events.SYNC_START, events.SYNC_STOP]
    assert (read.torn_last, read.spliced) == (1, 0)
    path.write_text(GOOD + '{"event": "merge", "t": 2.0, "frag\n\n')  # blank lines after it change nothing
    assert read_jsonl(path).torn_last == 1
    path.write_text(GOOD)
    assert (read_jsonl(path).torn_last, read_jsonl(path).spliced) == (0, 0)


def test_a_record_spliced_onto_a_torn_line_is_kept_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "synchronizer.jsonl"
    path.write_text(GOOD + '{"event": "merge", "t": 2.0, "fr' + _line(events.SYNC_STOP, 3.0) + _line(events.SYNC_STOP, 4.0))
    read = read_jsonl(path)
    assert [e["t"] for e in read.records] == [0.0, 1.0, 3.0, 4.0]
    assert (read.torn_last, read.spliced) == (0, 1)


def test_a_bad_line_in_the_middle_raises_with_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "synchronizer.jsonl"
    path.write_text(GOOD + "not json at all\n" + _line(events.SYNC_STOP, 3.0))
    with pytest.raises(ValueError, match=r"synchronizer\.jsonl:3: malformed"):
        load_jsonl(path)
    path.write_text(GOOD + "[1, 2]\n" + _line(events.SYNC_STOP, 3.0))  # JSON, but not a record
    with pytest.raises(ValueError, match=r"synchronizer\.jsonl:3: malformed"):
        load_jsonl(path)


def test_an_empty_file_holds_no_events(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert load_jsonl(path) == []
    path.write_text("\n  \n\n")
    assert load_jsonl(path) == [] and read_jsonl(path).torn_last == 0


def test_a_missing_file_raises_unless_missing_is_ok(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "nowhere.jsonl")
    assert load_jsonl(tmp_path / "nowhere.jsonl", missing_ok=True) == []


def test_a_live_tail_follows_the_same_rule(tmp_path: Path) -> None:
    path = tmp_path / "learner.jsonl"
    tail = Tail(path)
    assert tail.read() == []  # not created yet
    path.write_text(GOOD + '{"event": "sync_stop", "t"')
    assert [e["t"] for e in tail.read()] == [0.0, 1.0]  # the last line is held back until complete
    with open(path, "a") as f:
        f.write(': 2.0}\n{"event": "merge", "t": 3' + _line(events.SYNC_STOP, 4.0))
    assert [e["t"] for e in tail.read()] == [2.0, 4.0] and tail.damage.spliced == 1
    with open(path, "a") as f:
        f.write("garbage\n")
    with pytest.raises(ValueError, match=r"learner\.jsonl:5: malformed"):
        tail.read()


def test_synchronizer_logs_come_in_shard_order_as_numbers(tmp_path: Path) -> None:
    for s in range(12):  # lexical order would put shard 10 and 11 between 1 and 2
        (tmp_path / f"synchronizer-{s}.jsonl").write_text("")
    (tmp_path / "synchronizer-old.jsonl").write_text("")  # not a shard's log
    (tmp_path / "learners").mkdir()
    got = synchronizer_logs(tmp_path)
    assert [s for s, _ in got] == list(range(12))
    assert [p.name for _, p in got] == [f"synchronizer-{s}.jsonl" for s in range(12)]


def test_synchronizer_logs_of_one_synchronizer_and_of_none(tmp_path: Path) -> None:
    assert synchronizer_logs(tmp_path) == []
    (tmp_path / "synchronizer.jsonl").write_text("")
    assert synchronizer_logs(tmp_path) == [(None, tmp_path / "synchronizer.jsonl")]
