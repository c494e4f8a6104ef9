"""PNG plots of a run: loss vs tokens, merges over time, goodput; and an overlay of several runs.

Design decisions:

- **Headless and thread-safe.** Figures are built with ``matplotlib.figure.Figure`` and written
  by the Agg canvas; ``pyplot`` (global state, GUI backends) is never imported, so plotting works
  on servers, in worker threads and under pytest.
- **Same inputs as the numbers.** Plots read the event logs that ``ddiloco.lab.goodput``
  reads (a run folder or a ``RunLogs``) and the goodput plot draws ``fleet_summary``'s numbers,
  so a plot never disagrees with ``summary.json``.
- **Time axes start at zero** (the run's first event), and every token axis counts the *fleet's*
  tokens: a learner's loss at time t is drawn at the tokens all learners had processed by t, the
  axis the global model's curve uses (per-learner tokens put the global curve about M times
  further right and made it look worse than it is).
- **Empty data still writes a file** (with a note), so a run folder always has its three PNGs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ddiloco.core import events as schema
from ddiloco.lab.event_logs import RunLogs, load_run_dir
from ddiloco.lab.goodput import fleet_summary

MAX_TRAIN_POINTS = 4000
"""Train-loss points drawn per learner; longer series are strided (the faint curve is context)."""

PLOT_FILES = ("loss_vs_tokens.png", "merges_over_time.png", "goodput.png")

Curve = Sequence[tuple[float, float]]


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=110)
    return path


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", ha="center", va="center", transform=ax.transAxes, color="gray")


def fleet_tokens(logs: RunLogs) -> tuple[np.ndarray, np.ndarray]:
    """(times, tokens all learners had processed by then), one point per step of any learner.

    A learner's step events carry its process's running token count; the increments of every
    incarnation of every learner, in time order, add up to the fleet's count."""
    times: list[float] = []
    added: list[float] = []
    for events in logs.learners.values():
        last = 0.0
        for e in events:
            kind = e.get("event")
            if kind == schema.START:
                last = 0.0
            elif kind == schema.STEP and e.get("tokens") is not None and e.get("t") is not None:
                tokens = float(e["tokens"])
                times.append(float(e["t"]))
                added.append(max(0.0, tokens - last))
                last = tokens
    if not times:
        return np.zeros(0), np.zeros(0)
    order = np.argsort(times, kind="stable")
    return np.asarray(times)[order], np.cumsum(np.asarray(added)[order])


def _at(timeline: tuple[np.ndarray, np.ndarray], t: np.ndarray) -> np.ndarray:
    """Fleet tokens at times ``t`` (those of the last step that ended by then)."""
    times, tokens = timeline
    if not len(times):
        return np.zeros(len(t))
    i = np.searchsorted(times, t, side="right") - 1
    return np.where(i >= 0, tokens[np.clip(i, 0, None)], 0.0)


def _learner_curves(events: Sequence[Mapping[str, Any]], timeline: tuple[np.ndarray, np.ndarray]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(fleet tokens, train loss, fleet tokens, eval loss) of one learner's log."""
    series: dict[str, tuple[list[float], list[float]]] = {schema.STEP: ([], []), schema.EVAL: ([], [])}
    for e in events:
        kind = e.get("event")
        if kind in series and e.get("loss") is not None and e.get("t") is not None:
            series[kind][0].append(float(e["t"]))
            series[kind][1].append(float(e["loss"]))
    (tt, tl), (et, el) = series[schema.STEP], series[schema.EVAL]
    return _at(timeline, np.asarray(tt)), np.asarray(tl), _at(timeline, np.asarray(et)), np.asarray(el)


def loss_figure(logs: RunLogs, *, global_eval: Curve | None = None) -> Figure:
    """Eval loss per learner (solid), train loss (faint) and ``global_eval`` (black), all against
    the fleet's tokens."""
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    drawn = False
    timeline = fleet_tokens(logs)
    for k, (lid, events) in enumerate(sorted(logs.learners.items())):
        color = f"C{k % 10}"
        tx, ty, ex, ey = _learner_curves(events, timeline)
        if len(tx):
            stride = max(1, len(tx) // MAX_TRAIN_POINTS)
            ax.plot(tx[::stride], ty[::stride], color=color, alpha=0.2, linewidth=0.8, label=f"learner {lid} train")
            drawn = True
        if len(ex):
            ax.plot(ex, ey, color=color, marker="o", markersize=3, linewidth=1.5, label=f"learner {lid} eval")
            drawn = True
    if global_eval:
        gx, gy = zip(*global_eval, strict=True)
        ax.plot(gx, gy, color="black", linewidth=2.2, marker="s", markersize=3, label="global model eval")
        drawn = True
    if not drawn:
        _no_data(ax, "loss events")
    ax.set_xlabel("tokens processed by the whole fleet")
    ax.set_ylabel("loss")
    ax.set_title("Loss vs tokens (faint: train loss)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return fig


def plot_loss_vs_tokens(logs: RunLogs, path: str | os.PathLike[str], *,
                        global_eval: Curve | None = None) -> Path:
    return _save(loss_figure(logs, global_eval=global_eval), Path(path))


def _run_t0(logs: RunLogs) -> float:
    times = [float(e["t"]) for e in logs.merges if "t" in e]
    times += [float(e["t"]) for events in logs.learners.values() for e in events[:1] if "t" in e]
    return min(times) if times else 0.0


def merges_figure(logs: RunLogs) -> Figure:
    """Merge events per fragment vs time (top) and cumulative merges (bottom).

    Synchronizer stops (red) and starts after a stop (green) are marked with vertical lines and
    the outage between them is shaded.
    """
    t0 = _run_t0(logs)
    fig = Figure(figsize=(9, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.yaxis.get_major_locator().set_params(integer=True)
    merges = [e for e in logs.merges if e.get("event") == schema.MERGE]
    if merges:
        t = np.array([float(e["t"]) - t0 for e in merges])
        frag = np.array([int(e.get("fragment", 0)) for e in merges])
        quorum = np.array([float(e.get("quorum") or 1) for e in merges])
        sc = top.scatter(t, frag, c=quorum, s=40, cmap="viridis", marker="|", linewidths=1.5)
        fig.colorbar(sc, ax=[top, bottom], label="quorum (learners merged)")
        order = np.argsort(t, kind="stable")
        bottom.step(t[order], np.arange(1, len(t) + 1), where="post", color="C0")
    else:
        _no_data(top, "merges")
    stop: float | None = None
    for e in sorted(logs.merges, key=lambda e: float(e.get("t", 0.0))):
        kind, at = e.get("event"), float(e.get("t", 0.0)) - t0
        if kind == schema.SYNC_STOP:
            stop = at
            for ax in (top, bottom):
                ax.axvline(at, color="red", linestyle="--", linewidth=1)
        elif kind == schema.SYNC_START and stop is not None:
            for ax in (top, bottom):
                ax.axvline(at, color="green", linestyle="--", linewidth=1)
                ax.axvspan(stop, at, color="red", alpha=0.08)
            stop = None
    top.set_ylabel("fragment")
    top.set_title("Merges over time (red: synchronizer stop, green: restart)")
    bottom.set_ylabel("merges")
    bottom.set_xlabel("time since run start (s)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return fig


def plot_merges_over_time(logs: RunLogs, path: str | os.PathLike[str]) -> Path:
    return _save(merges_figure(logs), Path(path))


def goodput_figure(summary: Mapping[str, Any], *, target: float = 0.95) -> Figure:
    """Per-learner goodput, compute share and blocked share bars, from ``fleet_summary``'s dict."""
    per = summary.get("per_learner", {})
    ids = sorted(per)
    fig = Figure(figsize=(max(6.0, 0.9 * len(ids) + 4), 4.5), layout="constrained")
    ax = fig.add_subplot()
    if ids:
        x = np.arange(len(ids))
        w = 0.27
        series = (("goodput", "goodput", "C2"), ("compute_share", "compute share", "C0"),
                  ("blocked_share", "blocked share", "C3"))
        for k, (key, label, color) in enumerate(series):
            ax.bar(x + (k - 1) * w, [per[i][key] for i in ids], width=w, color=color, label=label)
        ax.set_xticks(x, [str(i) for i in ids])
        ax.axhline(summary.get("learner_goodput", 0.0), color="C2", linestyle="--", linewidth=1,
                   label=f"fleet goodput {summary.get('learner_goodput', 0.0):.1%}")
        ax.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"target {target:.0%}")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        _no_data(ax, "learners")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("learner")
    ax.set_ylabel("share of learner wall time")
    downtime = summary.get("global_downtime_s")
    gap = summary.get("max_merge_gap_s")
    ax.set_title("Goodput"
                 + (f" | global downtime {downtime:.2f}s" if downtime is not None else "")
                 + (f" | max merge gap {gap:.2f}s" if gap is not None else ""))
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_goodput(summary: Mapping[str, Any], path: str | os.PathLike[str], *, target: float = 0.95) -> Path:
    return _save(goodput_figure(summary, target=target), Path(path))


def plot_run(run: str | os.PathLike[str] | RunLogs, out_dir: str | os.PathLike[str], *,
             summary: Mapping[str, Any] | None = None,
             global_eval: Curve | None = None) -> dict[str, Path]:
    """Write ``loss_vs_tokens.png``, ``merges_over_time.png`` and ``goodput.png`` into ``out_dir``.

    ``run`` is a run folder (read with ``load_run_dir``) or already-loaded ``RunLogs``.
    ``summary`` is ``fleet_summary``'s dict (computed here when omitted); ``global_eval`` is an
    optional ``[(tokens, loss), ...]`` curve of the global model. Returns file name -> path.
    """
    logs = run if isinstance(run, RunLogs) else load_run_dir(run)
    out = Path(out_dir)
    if summary is None:
        summary = fleet_summary(logs.learners, logs.merges)
    return {
        "loss_vs_tokens.png": plot_loss_vs_tokens(logs, out / "loss_vs_tokens.png", global_eval=global_eval),
        "merges_over_time.png": plot_merges_over_time(logs, out / "merges_over_time.png"),
        "goodput.png": plot_goodput(summary, out / "goodput.png"),
    }


def compare_figure(runs: Mapping[str, Curve], *, title: str = "Eval loss vs tokens") -> Figure:
    """Overlay several runs' eval curves, e.g. ``{"dp": [(tokens, loss), ...], "decoupled": ...}``."""
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    drawn = False
    for label, curve in runs.items():
        if not curve:
            continue
        points = sorted((float(x), float(y)) for x, y in curve)
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.6, label=label)
        drawn = True
    if drawn:
        ax.legend()
    else:
        _no_data(ax, "curves")
    ax.set_xlabel("tokens")
    ax.set_ylabel("eval loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig


def plot_compare(runs: Mapping[str, Curve], path: str | os.PathLike[str], *,
                 title: str = "Eval loss vs tokens") -> Path:
    return _save(compare_figure(runs, title=title), Path(path))
