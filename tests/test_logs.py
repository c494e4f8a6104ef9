"""Logging writes to the ``sys.stderr`` of the moment, whenever it was configured."""

from __future__ import annotations

import io
import json
import sys

from ddiloco.core import logs


def test_lines_go_to_the_stderr_of_the_moment_not_to_one_closed_since(monkeypatch):
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logs.configure(level="info", json=True)  # configured while ``first`` stands for stderr
    logs.get_logger("test").info("one")
    monkeypatch.setattr(sys, "stderr", second)
    first.close()  # a capture that ended, as a test's output capture does
    logs.get_logger("test").info("two")
    assert json.loads(second.getvalue())["event"] == "two"


def test_a_file_given_is_written_to(monkeypatch):
    out = io.StringIO()
    logs.configure(level="info", json=True, file=out)
    try:
        logs.get_logger("test", learner_id="a").warning("three")
    finally:
        monkeypatch.setattr(logs, "_CONFIGURED", False)  # the next logger configures stderr again
    line = json.loads(out.getvalue())
    assert (line["event"], line["learner_id"], line["level"]) == ("three", "a", "warning")
