"""Run plots draw what the logs hold, on the axes they claim, and are written as real PNG files.

Each plot is built as a figure first (``*_figure``), so the tests read back the lines, points and
bars that were drawn, not only that a file appeared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.lab.event_logs import RunLogs
from ddiloco.lab.goodput import fleet_summary
from ddiloco.lab.plots import (
    PLOT_FILES,
    compare_figure,
    fleet_tokens,
    goodput_figure,
    loss_figure,
    merges_figure,
    plot_compare,
    plot_run,
)

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
    (run / "synchronizer.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _merges()))
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


def _lines(fig: Any) -> dict[str, Any]:
    return {line.get_label(): line for line in fig.axes[0].get_lines()}


def test_loss_curves_share_the_fleet_token_axis() -> None:
    """Two learners stepping in lockstep: at each second the fleet has processed both learners'
    tokens, so a learner's loss at its own 100*k tokens sits at 200*k on the shared axis, where
    the global model's curve (fleet tokens) is drawn too."""
    logs = RunLogs(learners={"a": _learner("a"), "b": _learner("b")}, merges=_merges())
    times, tokens = fleet_tokens(logs)
    assert len(times) == 40 and tokens[-1] == 4000 and np.all(np.diff(tokens) >= 0)
    lines = _lines(loss_figure(logs, global_eval=[(0, 5.5), (2000, 4.0), (4000, 3.5)]))
    assert set(lines) == {"learner a train", "learner a eval", "learner b train", "learner b eval",
                          "global model eval"}
    train = lines["learner a train"]
    assert list(train.get_xdata()) == [200.0 * (i + 1) for i in range(20)]
    assert list(train.get_ydata()) == [5.0 - 0.1 * i for i in range(20)]
    assert list(lines["learner a eval"].get_xdata()) == [1000.0, 2000.0, 3000.0, 4000.0]
    assert list(lines["global model eval"].get_xdata()) == [0, 2000, 4000]


def test_a_restarted_learner_adds_its_tokens_to_the_fleet() -> None:
    logs = RunLogs(learners={"b": _learner("b", restart=True)})
    _, tokens = fleet_tokens(logs)
    assert tokens[-1] == 2000 and np.all(np.diff(tokens) > 0), "the counter restarts, the fleet's does not"


def test_merges_figure_draws_every_merge_and_the_outage() -> None:
    fig = merges_figure(RunLogs(merges=_merges()))
    points = fig.axes[0].collections[0].get_offsets()
    assert len(points) == 14 and set(points[:, 1]) == {0, 1}
    spans = [p for p in fig.axes[0].patches]
    assert len(spans) == 1, "one shaded outage between the stop and the restart"


def test_goodput_figure_draws_the_summary_numbers() -> None:
    learners = {"a": _learner("a"), "b": _learner("b")}
    summary = fleet_summary(learners, _merges())
    fig = goodput_figure(summary)
    heights = [bar.get_height() for bar in fig.axes[0].patches]
    per = summary["per_learner"]
    assert heights[:2] == [per["a"]["goodput"], per["b"]["goodput"]] and 0 < heights[0] < 1


def test_compare_figure_sorts_each_curve_and_skips_empty_ones() -> None:
    lines = _lines(compare_figure({"decoupled": [(3000, 2.95), (1000, 4.1)], "empty": []}))
    assert set(lines) == {"decoupled"} and list(lines["decoupled"].get_xdata()) == [1000.0, 3000.0]
