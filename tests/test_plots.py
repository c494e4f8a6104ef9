"""Run plots are written as real PNG files, from a run folder, from loaded logs and from nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddiloco.lab.goodput import RunLogs, fleet_summary
from ddiloco.lab.plots import PLOT_FILES, plot_compare, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _learner(lid: str, restart: bool = False) -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = [{"event": "start", "t": 0.0, "learner_id": lid, "incarnation": 0,
                                  "num_fragments": 2, "fragment_sizes": [2, 1]}]
    for i in range(20):
        if restart and i == 10:
            log.append({"event": "start", "t": 10.5, "learner_id": lid, "incarnation": 1,
                        "num_fragments": 2, "fragment_sizes": [2, 1]})
        tokens = 100 * (i % 10 + 1) if restart else 100 * (i + 1)
        log.append({"event": "step", "t": i + 1.0, "step": i, "step_s": 0.9, "blocked_s": 0.0,
                    "loss": 5.0 - 0.1 * i, "tokens": tokens})
        if i % 5 == 4:
            log.append({"event": "eval", "t": i + 1.0, "step": i, "tokens": tokens, "loss": 5.1 - 0.1 * i})
        if i % 2 == 1:
            seq, frag = i, (i // 2) % 2
            log.append({"event": "send", "t": i + 1.0, "step": i, "fragment": frag, "sequence": seq,
                        "base_version": 0, "tokens": 200, "steps": 2, "from_step": i - 1, "to_step": i})
            log.append({"event": "result", "t": i + 1.5, "sequence": seq, "fragment": frag,
                        "outcome": "merged" if i % 3 else "rejected", "version": 1, "reason": "stale",
                        "weight": 1.0, "staleness": 0})
    log.append({"event": "end", "t": 20.5, "step": 19, "tokens": 2000})
    return log


def _merges() -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = [{"event": "sync_start", "t": 0.0, "synchronizer_id": "s"}]
    log += [{"event": "merge", "t": 1.5 + i, "fragment": i % 2, "version": i // 2 + 1, "quorum": 2,
             "learners": ["a", "b"], "grace_s": 0.1, "sync_s": 0.01} for i in range(8)]
    log += [{"event": "sync_stop", "t": 9.7}, {"event": "sync_start", "t": 12.0, "synchronizer_id": "s"}]
    log += [{"event": "merge", "t": 13.5 + i, "fragment": i % 2, "version": 5 + i, "quorum": 1,
             "learners": ["a"], "grace_s": 0.0, "sync_s": 0.01} for i in range(6)]
    return log


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_MAGIC


def test_plot_run_from_logs(tmp_path: Path) -> None:
    logs = RunLogs(learners={"a": _learner("a"), "b": _learner("b", restart=True)}, merges=_merges())
    written = plot_run(logs, tmp_path / "plots", global_eval=[(1000, 4.8), (2000, 4.0), (4000, 3.5)])
    assert sorted(written) == sorted(PLOT_FILES)
    for name in PLOT_FILES:
        assert written[name] == tmp_path / "plots" / name
        _assert_png(written[name])


def test_plot_run_from_run_dir_with_summary(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    learners = {"a": _learner("a"), "b": _learner("b")}
    for lid, events in learners.items():
        (run / f"learner-{lid}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "merges.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _merges()))
    summary = fleet_summary(learners, _merges())
    written = plot_run(run, run, summary=summary)
    for name in PLOT_FILES:
        _assert_png(run / name)
    assert set(written) == set(PLOT_FILES)


def test_plot_run_without_data_still_writes_files(tmp_path: Path) -> None:
    written = plot_run(RunLogs(), tmp_path)
    for path in written.values():
        _assert_png(path)


def test_plot_compare(tmp_path: Path) -> None:
    runs = {"dp": [(1000, 4.0), (2000, 3.2), (3000, 2.9)],
            "decoupled": [(3000, 2.95), (1000, 4.1), (2000, 3.3)],
            "diloco": [(1000, 4.3), (2000, 3.5), (3000, 3.1)],
            "empty": []}
    path = plot_compare(runs, tmp_path / "cmp" / "compare.png")
    assert path == tmp_path / "cmp" / "compare.png"
    _assert_png(path)
