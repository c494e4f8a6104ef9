"""The event registry (``ddiloco.core.events``): writers are checked against it, and the events
reference (docs/events.md) is generated from it.

The test suite runs with ``DDILOCO_STRICT_EVENTS=1`` (tests/conftest.py), so every event any test
writes through a real writer is checked; the fleet test below also reads back what a learner and a
synchronizer wrote and checks each line, the envelope included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import time

import pytest
import torch
from torch import nn

from ddiloco.core import events as schema
from ddiloco.learner.events import EventLog

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "events.md"


def _check_line(log: str, line: dict) -> None:
    assert isinstance(line.get("t"), float), line
    assert schema.problems(log, line["event"], line.keys() - {"event", "t"}) == [], line


def test_the_registry_is_consistent():
    assert sum(len(events) for events in schema.REGISTRY.values()) == 28
    for log, events in schema.REGISTRY.items():
        for name, spec in events.items():
            assert spec.log == log and spec.name == name
            assert not set(spec.required) & set(spec.optional)
            assert not set(schema.LOGS[log].envelope) & (set(spec.required) | set(spec.optional))
    constants = {v for k, v in vars(schema).items() if k.isupper() and isinstance(v, str)
                 and not k.endswith(("_LOG", "_ENV")) and not k.startswith("DOC_")}
    assert constants == {name for events in schema.REGISTRY.values() for name in events}


def test_the_fault_event_carries_the_plans_fields():
    from ddiloco.lab.chaos import FaultEvent

    spec = schema.spec(schema.FAULTS_LOG, schema.FAULT)
    assert {f.name for f in dataclasses.fields(FaultEvent)} | {"ok"} == set(spec.required)


def test_strict_writers_raise_on_an_unknown_event_and_a_missing_field(monkeypatch):
    monkeypatch.setenv(schema.STRICT_ENV, "1")
    events = EventLog(None, learner_id="a", incarnation=1)
    events.emit(schema.POISONED, step=3)
    with pytest.raises(schema.EventSchemaError, match="unknown event 'poisonned'"):
        events.emit("poisonned", step=3)
    with pytest.raises(schema.EventSchemaError, match="missing field 'blocked_s'"):
        events.emit(schema.STEP, step=1, loss=2.0, tokens=10, step_s=0.1)
    events.emit(schema.POISONED, step=4)  # its names were checked once: not again
    for _ in range(2):  # names that failed are checked (and refused) every time
        with pytest.raises(schema.EventSchemaError, match="unknown field 'stp'"):
            events.emit(schema.POISONED, step=3, stp=3)
    with pytest.raises(schema.EventSchemaError, match="missing field 'incarnation'"):
        EventLog(None, learner_id="a").emit(schema.POISONED, step=3)
    events.emit(schema.START, num_fragments=1, fragment_sizes=[4], params=4, genesis=True, mode="dp",
                anything="a caller of join adds")  # start is open
    with pytest.raises(schema.EventSchemaError, match="missing field 'synchronizer_id'"):
        schema.validate(schema.SYNCHRONIZER_LOG, schema.SYNC_START, set())
    with pytest.raises(schema.EventSchemaError, match="no event 'merge' in the learner log"):
        schema.spec(schema.LEARNER_LOG, schema.MERGE)


def test_the_synchronizers_ledger_checks_its_lines(monkeypatch, tmp_path):
    from ddiloco.synchronizer.ledger import Ledger

    monkeypatch.setenv(schema.STRICT_ENV, "1")
    ledger = Ledger(membership=None, metrics=None, log=None, event_log=str(tmp_path / "s.jsonl"),  # type: ignore[arg-type]
                    wall=time.time)
    ledger.event({"event": schema.SYNC_START, "synchronizer_id": "s0"})
    with pytest.raises(schema.EventSchemaError, match="unknown event 'sync_begin'"):
        ledger.event({"event": "sync_begin", "synchronizer_id": "s0"})
    with pytest.raises(schema.EventSchemaError, match="missing field 'reason'"):
        ledger.event({"event": schema.REJECT, "fragment": 0, "learner": "a", "incarnation": 1, "sequence": 2})
    ledger.close()
    assert [json.loads(line)["event"] for line in (tmp_path / "s.jsonl").read_text().splitlines()] == ["sync_start"]


def test_outside_strict_mode_a_bad_event_is_logged_once_and_written(monkeypatch, tmp_path):
    from ddiloco.core import logs

    warnings: list[tuple[str, dict]] = []

    class Recorder:
        def warning(self, message: str, **fields: object) -> None:
            warnings.append((message, fields))

    monkeypatch.setattr(logs, "get_logger", lambda name, **bound: Recorder())
    monkeypatch.delenv(schema.STRICT_ENV, raising=False)
    events = EventLog(str(tmp_path / "l.jsonl"), learner_id="a", incarnation=1)
    for _ in range(3):
        events.emit("not_an_event", x=1)
    events.close()
    assert len((tmp_path / "l.jsonl").read_text().splitlines()) == 3
    assert warnings == [("event does not match its schema", {"detail": "learner log, event 'not_an_event': "
                                                                       "unknown event 'not_an_event'"})]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(sync, model: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    assert sync.join() is not None
    for _ in range(steps):
        loss = (model(torch.randn(16, 8, generator=gen)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.01)
        sync.step(tokens=100, loss=float(loss.detach()))
    assert sync.finish()


async def test_a_learner_and_a_synchronizer_write_only_registered_events(tmp_path):
    from ddiloco.learner.sync import DecoupledSync
    from tests.scripted import running_server, sync_config

    cfg = sync_config(tmp_path / "state", event_log=str(tmp_path / "synchronizer.jsonl"))
    async with running_server(cfg) as server:
        settings = {"protocol": {"mode": "decoupled", "num_fragments": 2, "sync_every": 4, "overlap": 1,
                                 "max_chunk_bytes": 4096, "global_codec": "fp32"}}
        model = _model()
        sync = DecoupledSync(model, config=settings, synchronizer=f"127.0.0.1:{server.port}", learner_id="a",
                             steps=24, event_log=str(tmp_path / "a.jsonl"))
        await asyncio.to_thread(_train, sync, model, 24)
    learner = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    merges = [json.loads(line) for line in (tmp_path / "synchronizer.jsonl").read_text().splitlines()]
    for line in learner:
        _check_line(schema.LEARNER_LOG, line)
    for line in merges:
        _check_line(schema.SYNCHRONIZER_LOG, line)
    written = {e["event"] for e in learner} | {e["event"] for e in merges}
    assert {schema.START, schema.STEP, schema.SEND, schema.RESULT, schema.APPLY, schema.CONNECT, schema.FLUSHED,
            schema.SYNC_START, schema.MERGE} <= written


def test_the_events_reference_is_generated_from_the_registry():
    text = DOC.read_text()
    begin, end = text.index(schema.DOC_BEGIN), text.index(schema.DOC_END) + len(schema.DOC_END) + 1
    assert text[begin:end] == schema.reference_markdown(), (
        "docs/events.md is out of date: run `python scripts/gen_events_doc.py`")
    for log, events in schema.REGISTRY.items():
        for name in events:
            assert f"| `{name}` |" in text[begin:end], (log, name)


def test_a_learner_log_given_a_relative_path_is_one_file_whatever_the_directory(monkeypatch, tmp_path):
    """The event log keeps its absolute path: the communication process appends to it from a
    directory of its own choosing, and a training process that changes directory keeps one file.
    ``observe`` counts and tells the observers without writing."""
    import json

    monkeypatch.chdir(tmp_path)
    events = EventLog("l.jsonl", learner_id="a", incarnation=1)
    seen = []
    events.observers.append(lambda event, fields: seen.append(event))
    try:
        assert events.path == str(tmp_path / "l.jsonl")
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
        other = EventLog(events.path, learner_id="a", incarnation=1)  # as the child opens it
        result = {"sequence": 1, "fragment": 0, "outcome": "merged", "version": 1, "reason": "", "weight": 1.0,
                  "staleness": 0, "detail": ""}
        other.emit(schema.RESULT, **result)
        other.close()
        events.observe(schema.RESULT, result)
        events.emit(schema.DROPPED, sequence=2, fragment=0, reason="stopped")
    finally:
        events.close()
    lines = [json.loads(line) for line in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines] == ["result", "dropped"], "observed, not written again"
    assert events.counts == {"result": 1, "dropped": 1} and seen == ["result", "dropped"]
    assert not (tmp_path / "elsewhere" / "l.jsonl").exists()
