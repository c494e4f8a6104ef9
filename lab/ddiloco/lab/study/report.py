"""``ddiloco study report``: the saved results as tables and plots.

Every result is set against the data-parallel reference of the same budget (learners, steps,
batch, model, seed, data order, and measured the same way: eval set and Python version): the
untuned one (at the inner learning rate and warm-up of the result itself, as when every mode
shared one) and the tuned one (the best inner learning rate among the saved ``dp`` cases of that
budget). The
report prints markdown tables, writes them to ``<out>/report.md`` with the plots beside them:

- ``frontier.png``: eval-loss gap to tuned dp against bytes per token (log scale), one point a
  decoupled case at the default budget that changes only what trades bytes for quality (the sync
  period, fragments, overlap, codecs, error feedback), a line per codec through its sync periods;
- ``trends.png``: the default decoupled run's gap against tokens, model size and learners;
- ``curves.png``: eval loss against tokens of tuned dp and of the decoupled cases of the default
  budget's best and default settings.
"""

from __future__ import annotations

import math
import pathlib
import shutil
import statistics
from collections import defaultdict
from typing import Any

from ddiloco.lab.study.case import DEFAULTS, Case, saved_settings
from ddiloco.lab.study.store import Results

BUDGET = ("learners", "steps", "batch_size", "model", "seed", "data_order", "eval_batches", "python")
"""What makes two results comparable: the same tokens, model, seed and data layout, measured on the
same held-out set of the same corpus (the stdlib corpus is the Python version's)."""
PLOTS = ("frontier.png", "trends.png", "curves.png")


def budget(result: dict[str, Any]) -> tuple:
    settings = saved_settings(result)
    return tuple(settings[k] for k in BUDGET)


def references(results: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """budget -> {"at": (inner lr, warm-up) -> dp loss there, "tuned": best dp loss over its inner
    lr and warm-up, "tuned_lr": its inner lr, "tuned_warmup": its warm-up, "lrs": inner lr -> the
    best loss over the warm-ups}."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in results:
        if r["mode"] != "dp" or not _dp_plain(r):
            continue
        ref = out.setdefault(budget(r), {"at": {}, "tuned": math.inf, "tuned_lr": None, "tuned_warmup": None,
                                         "lrs": {}})
        ref["lrs"][r["inner_lr"]] = min(r["final_eval_loss"], ref["lrs"].get(r["inner_lr"], math.inf))
        ref["at"][(r["inner_lr"], r["warmup_steps"])] = r["final_eval_loss"]
        if r["final_eval_loss"] < ref["tuned"]:
            ref["tuned"], ref["tuned_lr"], ref["tuned_warmup"] = r["final_eval_loss"], r["inner_lr"], r["warmup_steps"]
    return out


def _dp_plain(r: dict[str, Any]) -> bool:
    """A dp case that differs from dp's defaults at most in its budget, inner lr and warm-up (what
    dp is tuned over)."""
    base, settings = DEFAULTS["dp"].settings(), saved_settings(r)
    return all(settings[k] == base[k] for k in DEFAULTS["dp"].used()
               if k not in (*BUDGET, "inner_lr", "warmup_steps", "mode", "curve_points"))


def annotate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each non-dp result with ``vs_dp`` (against dp at the result's own inner lr and warm-up,
    untuned for its batch) and ``vs_tuned_dp`` added (None without a reference)."""
    refs = references(results)
    out = []
    for r in results:
        if r["mode"] == "dp":
            continue
        ref = refs.get(budget(r))
        r = dict(r)
        same = ref["at"].get((r["inner_lr"], r["warmup_steps"])) if ref else None
        r["vs_dp"] = r["final_eval_loss"] / same - 1 if same else None
        r["vs_tuned_dp"] = r["final_eval_loss"] / ref["tuned"] - 1 if ref else None
        out.append(r)
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _changes(r: dict[str, Any]) -> str:
    """The settings of a result that differ from its mode's defaults, budget and seed aside."""
    keep = saved_settings(r)
    case = Case(**keep)
    parts = [p for p in case.id.split("-")[1:]
             if not p.startswith(("seed_", "steps_", "learners_", "model_", "eval_batches_", "curve_points_",
                                  "python_"))]
    return ", ".join(parts) or "(defaults)"


def tables(results: list[dict[str, Any]]) -> str:
    refs = references(results)
    lines = ["## Data-parallel reference (inner learning rate; each cell the best over the warm-ups tried)", "",
             "| learners | steps | model | seed | " + " | ".join(f"lr {lr:g}" for lr in _all_lrs(refs)) + " | tuned |",
             "|---|---|---|---|" + "---|" * (len(_all_lrs(refs)) + 1)]
    for key, ref in sorted(refs.items()):
        m, steps, _, model, seed, *_ = key
        cells = [f"{ref['lrs'][lr]:.4f}" if lr in ref["lrs"] else "" for lr in _all_lrs(refs)]
        lines.append(f"| {m} | {steps} | {model} | {seed} | " + " | ".join(cells) +
                     f" | {ref['tuned']:.4f} (lr {ref['tuned_lr']:g}, warm-up {ref['tuned_warmup']}) |")
    lines += ["", "## Every other case", "",
              "| mode | settings | learners | steps | model | seed | eval loss | vs dp | vs tuned dp | B/token | "
              "final from learners' mean |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(annotate(results), key=lambda r: (budget(r), r["mode"], r["final_eval_loss"])):
        mean = r.get("learner_mean_eval_loss")
        lines.append(f"| {r['mode']} | {_changes(r)} | {r['learners']} | {r['steps']} | {r['model']} | {r['seed']} | "
                     f"{r['final_eval_loss']:.4f} | {_pct(r['vs_dp'])} | {_pct(r['vs_tuned_dp'])} | "
                     f"{r['bytes_per_token']:.1f} | {'' if mean is None else f'{mean:.4f}'} |")
    seeds = _seed_groups(annotate(results))
    if seeds:
        lines += ["", "## Over seeds", "", "| mode | settings | learners | steps | model | seeds | eval loss mean (min-max) "
                  "| vs tuned dp mean (min-max) |", "|---|---|---|---|---|---|---|---|"]
        for (mode, changes, m, steps, model), group in sorted(seeds.items()):
            losses = [r["final_eval_loss"] for r in group]
            gaps = [r["vs_tuned_dp"] for r in group if r["vs_tuned_dp"] is not None]
            gap = f"{_pct(statistics.mean(gaps))} ({_pct(min(gaps))}..{_pct(max(gaps))})" if gaps else "-"
            lines.append(f"| {mode} | {changes} | {m} | {steps} | {model} | {len(group)} | "
                         f"{statistics.mean(losses):.4f} ({min(losses):.4f}-{max(losses):.4f}) | {gap} |")
    return "\n".join(lines) + "\n"


def _all_lrs(refs: dict[tuple, dict[str, Any]]) -> list[float]:
    return sorted({lr for ref in refs.values() for lr in ref["lrs"]})


def _seed_groups(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["mode"], _changes(r), r["learners"], r["steps"], r["model"])].append(r)
    return {k: v for k, v in groups.items() if len({r["seed"] for r in v}) > 1}


def report(out: str, docs: str | None = None) -> int:
    folder = pathlib.Path(out)
    store = Results(folder)
    for old, new in store.reindex():
        print(f"renamed {old.name} -> {new.name} (a default changed)")
    results = store.all()
    if not results:
        print(f"no results in {folder}")
        return 1
    text = tables(results)
    print(text)
    (folder / "report.md").write_text(text)
    plots = plot(results, folder)
    if docs:
        target = pathlib.Path(docs)
        target.mkdir(parents=True, exist_ok=True)
        for path in plots:
            shutil.copy(path, target / f"quality_{path.name}")
    print(f"report: {folder / 'report.md'}; plots: {', '.join(str(p) for p in plots)}")
    return 0


def plot(results: list[dict[str, Any]], folder: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = annotate(results)
    refs = references(results)
    default_budget = budget(DEFAULTS["decoupled"].settings() | {"seed": 0})
    written = []

    fig, ax = plt.subplots(figsize=(8, 5))
    frontier = _frontier([r for r in rows if budget(r) == default_budget and r["vs_tuned_dp"] is not None
                          and r["mode"] == "decoupled"])
    colours = {"bf16_zstd": "tab:blue", "int4_block": "tab:orange", "int2_block": "tab:green", "fp32": "tab:grey",
               "int8_block": "tab:purple"}
    for codec, colour in colours.items():
        base = DEFAULTS["decoupled"].settings()
        line = sorted((r for r in frontier if r["codec"] == codec and r["fragments"] == r["sync_every"]
                       and r["overlap"] == min(base["overlap"], r["sync_every"] - 1)
                       and r["global_codec"] == base["global_codec"] and r["error_feedback"] == base["error_feedback"]),
                      key=lambda r: r["bytes_per_token"])
        if len(line) > 1:
            periods = ", ".join(str(r["sync_every"]) for r in line)
            ax.plot([r["bytes_per_token"] for r in line], [100 * r["vs_tuned_dp"] for r in line], "-", color=colour,
                    lw=0.8, label=f"{codec}, H = P = {periods}")
    for r in frontier:
        ax.scatter(r["bytes_per_token"], 100 * r["vs_tuned_dp"], color=colours[r["codec"]], s=18)
        ax.annotate(_bandwidth_label(r),
                    (r["bytes_per_token"], 100 * r["vs_tuned_dp"]), fontsize=6, xytext=(3, 2),
                    textcoords="offset points")
    ref = refs.get(default_budget)
    dp_bytes = next((r["bytes_per_token"] for r in results if r["mode"] == "dp" and budget(r) == default_budget), None)
    if ref and dp_bytes:
        ax.scatter(dp_bytes, 0, color="black", marker="*", s=80, label="tuned dp (ring all-reduce, fp32)")
    default = next((r for r in frontier if _bandwidth_label(r) == "defaults"), None)
    if default:
        ax.axvline(default["bytes_per_token"], color="grey", lw=0.8, ls="--", label="the default's bytes/token")
    ax.axhline(0, color="black", lw=0.6)
    ax.axhline(3, color="tab:red", lw=0.6, ls=":", label="3% target")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per token trained (learners -> synchronizer and back)")
    ax.set_ylabel("eval loss above tuned dp (%)")
    others = _changes({**frontier[0], **{k: DEFAULTS["decoupled"].settings()[k] for k in BANDWIDTH}}) \
        if frontier else ""
    ax.set_title("Quality against bandwidth (decoupled, 3 learners x 600 steps, seed 0"
                 + ("" if others in ("", "(defaults)") else f"; {others}") + ")", fontsize=9)
    ax.legend(fontsize=7)
    written.append(_save(fig, folder / "frontier.png"))

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("steps", "model", "learners"), ("inner steps per learner", "model", "learners M"),
                              strict=True):
        for mode, colour in (("decoupled", "tab:blue"), ("diloco", "tab:orange")):
            # models in the order of their size, the rest by value
            pts = sorted((r["params"] if key == "model" else r[key], r[key], 100 * r["vs_tuned_dp"]) for r in rows
                          if r["mode"] == mode and r["vs_tuned_dp"] is not None and _trend_point(r, key))
            if pts:
                ax.plot([str(p[1]) for p in pts], [p[2] for p in pts], "o-", color=colour, label=mode)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xlabel(label)
        ax.set_ylabel("eval loss above tuned dp (%)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("The gap to data-parallel against budget, model size and fleet size (defaults otherwise)")
    written.append(_save(fig, folder / "trends.png"))

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        if budget(r) != default_budget or not r.get("curve"):
            continue
        is_tuned_dp = (r["mode"] == "dp" and ref is not None and r["inner_lr"] == ref["tuned_lr"]
                       and r["warmup_steps"] == ref["tuned_warmup"] and _dp_plain(r))
        is_default = r["mode"] in ("decoupled", "diloco") and Case(**saved_settings(r)).id \
            in ("decoupled", "diloco")
        if is_tuned_dp or is_default:
            xs, ys = zip(*r["curve"], strict=True)
            ax.plot(xs, ys, label=("tuned dp" if is_tuned_dp else r["mode"]))
    ax.set_xlabel("tokens")
    ax.set_ylabel("eval loss on 8 evenly spaced held-out batches\n(the final eval loss reads the whole split)")
    ax.set_ylim(top=3.0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    written.append(_save(fig, folder / "curves.png"))
    return written


BANDWIDTH = ("sync_every", "fragments", "overlap", "codec", "global_codec", "error_feedback")
"""The settings that trade bytes for quality: the frontier plots the cases that change only these."""


def _bandwidth_label(r: dict[str, Any]) -> str:
    """What a frontier point changes of the bandwidth settings (H, P, tau, codecs, feedback)."""
    base = DEFAULTS["decoupled"].settings()
    short = {"sync_every": "H", "fragments": "P", "overlap": "tau", "codec": "", "global_codec": "global ",
             "error_feedback": "feedback "}
    parts = [f"{short[k]}{r[k]}" for k in BANDWIDTH if r[k] != base[k]]
    return " ".join(parts) or "defaults"


def _frontier(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases that differ from each other only in what trades bytes for quality: of the groups
    that share every other setting, the largest (the frontier sweep, around the defaults it ran
    at)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[tuple(v for k, v in saved_settings(r).items() if k not in BANDWIDTH)].append(r)
    return max(groups.values(), key=len, default=[])


def _trend_point(r: dict[str, Any], key: str) -> bool:
    """Whether ``r`` is its mode's defaults except (at most) ``key``, seed 0."""
    settings = saved_settings(r)
    base = DEFAULTS[r["mode"]].settings()
    return r["seed"] == 0 and all(settings[k] == base[k] for k in settings if k not in (key, "mode"))


def _save(fig: Any, path: pathlib.Path) -> pathlib.Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
