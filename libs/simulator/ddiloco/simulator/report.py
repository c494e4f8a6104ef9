"""Tables, JSON and the plot: what ``ddiloco simulate`` shows.

The paper's numbers appear only here, as a separately labelled reference column next to the
simulated one; nothing in the model reads them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from ddiloco.simulator.strategies import StrategyResult

PAPER = "Decoupled DiLoCo (arXiv 2604.21428)"
PAPER_GOODPUT: dict[int, dict[str, float]] = {
    150_000: {"dp": 72.0, "elastic": 88.0, "decoupled M=8": 98.0, "decoupled M=16": 99.0},
    1_200_000: {"dp": 27.0, "elastic": 58.0, "decoupled M=8": 88.0, "decoupled M=16": 93.0},
}
"""Goodput (%) as reported in summaries of the paper: a reference to explain, never a model input."""

TABLE_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
TABLE_LEARNERS = (8, 16)
TABLE_LABELS = ("dp", "elastic", "decoupled M=8", "decoupled M=16")
SHORT = {"dp": "DP", "elastic": "elastic", "decoupled M=8": "M=8", "decoupled M=16": "M=16"}


def fmt_chips(n: int) -> str:
    for div, suffix in ((1_000_000, "M"), (1_000, "k")):
        if n >= div and n % (div // 10) == 0:
            return f"{n / div:g}{suffix}"
    return str(n)


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _grid(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [list(r) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True)))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(out)


def _sync_modelled(results: Sequence[StrategyResult]) -> bool:
    """Whether any run has a sharded or failing synchronizer (only then does the table show it)."""
    return any(r.details.get("shards", 1) > 1 or math.isfinite(r.details.get("sync_mtbf_hours", math.inf))
               for r in results)


def results_table(results: Sequence[StrategyResult]) -> str:
    """One row per (fleet size, strategy): goodput, uptime, interruptions, merges and the losses; with a
    sharded or failing synchronizer also S, its failures, the share of fragment-time whose shard was
    down, the share of fragments one failure stalled (measured on the merge replay), the time no
    fragment could merge, and the longest any fragment went without a merge."""
    headers = ["chips", "strategy", "goodput %", "uptime %", "failures", "interruptions", "merges/h",
               "paused %", "rollback %", "unavail %", "straggle %", "late %"]
    sync = _sync_modelled(results)
    if sync:
        headers += ["S", "sync fails", "stalled %", "per fail %", "no merge s", "frag gap s"]
    rows = []
    for r in results:
        per_hour = r.details.get("merges_per_hour")
        row = [fmt_chips(r.chips), r.label, _pct(100 * r.goodput), _pct(100 * r.uptime, 2),
               str(r.failures), str(r.interruptions), "—" if per_hour is None else f"{per_hour:.0f}",
               _pct(100 * r.lost["paused"], 2), _pct(100 * r.lost["rollback"], 2),
               _pct(100 * r.lost["unavailable"], 2), _pct(100 * r.lost["stragglers"], 2),
               _pct(100 * r.lost["late_merges"], 2)]
        if sync:
            d = r.details
            if "shards" in d:
                row += [str(d["shards"]), str(d["sync_failures"]), _pct(100 * d["stalled_fragment_share"], 2),
                        _pct(100 * d["stalled_share_per_failure"], 0), f"{d['merge_downtime_s']:.0f}",
                        f"{d['max_fragment_gap_s']:.0f}"]
            else:
                row += ["—"] * 6
        rows.append(row)
    return _grid(headers, rows)


def paper_table(results: Sequence[StrategyResult]) -> tuple[str, list[dict]]:
    """Goodput per fleet size, simulated beside the paper's reference column; and the cells as dicts."""
    by = {(r.chips, r.label): r for r in results}
    sizes = sorted({r.chips for r in results})
    labels = [label for label in TABLE_LABELS if any(r.label == label for r in results)]
    headers = ["chips", "fleet MTBI"]
    for label in labels:
        headers += [f"{SHORT[label]} sim", f"{SHORT[label]} paper"]
    rows, cells = [], []
    for n in sizes:
        any_r = next(r for r in results if r.chips == n)
        mtbi = any_r.details.get("fleet_mtbi_s")
        row = [fmt_chips(n), "—" if mtbi is None else f"{mtbi:.0f} s"]
        for label in labels:
            r = by.get((n, label))
            sim = None if r is None else 100 * r.goodput
            ref = PAPER_GOODPUT.get(n, {}).get(label)
            row += [_pct(sim), _pct(ref, 0)]
            cells.append({"chips": n, "strategy": label, "simulated": sim, "paper": ref,
                          "diff": None if sim is None or ref is None else sim - ref})
        rows.append(row)
    diffs = [abs(c["diff"]) for c in cells if c["diff"] is not None]
    title = (f"Goodput (% of allocated chip-time): simulated vs the paper's reported values ({PAPER}); "
             "'paper' is a reference column, '—' = not reported")
    foot = (f"paper cells compared: {len(diffs)}, max |sim - paper| = {max(diffs):.1f} points"
            if diffs else "no paper cell at these sizes")
    return "\n".join([title, _grid(headers, rows), foot]), cells


def _finite(x: object) -> object:
    """JSON has no infinity: non-finite floats become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def write_json(path: str | Path, payload: dict) -> None:
    Path(path).write_text(json.dumps(_finite(payload), indent=2) + "\n")


def plot(results: Sequence[StrategyResult], path: str | Path, title: str = "") -> None:
    """Goodput vs fleet size per strategy (log x), with the paper's points as hollow markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r.label for r in results))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, label in enumerate(labels):
        pts = sorted((r.chips, 100 * r.goodput) for r in results if r.label == label)
        color = f"C{i}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"{label} (simulated)")
        ref = sorted((n, v[label]) for n, v in PAPER_GOODPUT.items() if label in v)
        if ref and {p[0] for p in pts} & {n for n, _ in ref}:
            ax.plot([n for n, _ in ref], [v for _, v in ref], "s", mfc="none", ms=9, color=color,
                    label=f"{label} (paper)")
    ax.set_xscale("log")
    sizes = sorted({r.chips for r in results})
    ax.set_xticks(sizes, [fmt_chips(n) for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("chips in the fleet")
    ax.set_ylabel("goodput (% of allocated chip-time)")
    ax.set_ylim(0, 101)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title or "Goodput vs fleet size (same failure trace per size)")
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
